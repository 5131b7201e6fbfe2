"""Append-only JSON-lines files that outlive processes (events, step times): reading what was fully written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_complete_lines(path: Path) -> list[dict[str, Any]]:
    """Every complete line of ``path`` (a process killed mid-write leaves a partial last line); [] if absent."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
