"""lightning-emig: elastic LLM training with direct model-state migration."""

from lightning_emig.layout import HybridLayout, LayoutError, LayoutMesh, MeshAxis, build_mesh

__all__ = ["HybridLayout", "LayoutError", "LayoutMesh", "MeshAxis", "build_mesh"]
__version__ = "0.1.0"
