"""lightning-emig: elastic LLM training with direct model-state migration.

The names below are imported on first use: ``lightning-emig-run`` imports this package before it can set its
handler for an early preemption notice (see :mod:`lightning_emig.run`), and torch takes seconds to import.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HybridLayout", "LayoutError", "LayoutMesh", "MeshAxis", "build_mesh"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in __all__:
        from lightning_emig import layout

        return getattr(layout, name)
    raise AttributeError(f"module 'lightning_emig' has no attribute {name!r}")
