"""tools/migration_sides.py: a model runs the transitions its shape allows and is told why it skips the others."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from migration_sides import parse_transitions, transitions_for  # noqa: E402


def test_a_model_skips_the_transitions_its_shape_cannot_take() -> None:
    transitions = parse_transitions("s4:t2s2,p2t2:p4,p2s2:s4", world=4)
    kept, skipped = transitions_for("tiny", transitions)  # two blocks: two stages at most
    assert [t.name for t in kept] == ["s4:t2s2", "p2s2:s4"]
    assert len(skipped) == 1 and skipped[0].startswith("tiny p2t2:p4: ") and "stages" in skipped[0]
    kept, skipped = transitions_for("llama_25m", transitions)
    assert [t.name for t in kept] == ["s4:t2s2", "p2t2:p4", "p2s2:s4"] and skipped == []
