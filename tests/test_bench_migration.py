"""tools/migration_sides.py: a model runs the transitions its shape allows and is told why it skips the others."""

from __future__ import annotations

import json
import os
import subprocess
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


def test_the_benchmark_moves_a_state_exactly_and_measures_both_limits_beside_it(tmp_path: Path) -> None:
    """The whole tool on the smallest case (2 processes, one transition): direct migration bit-exact and within its
    memory bound, and the link and host limits measured with the traffic it had (the survivor keeps its half, so the
    host limit has local bytes to copy)."""
    out = tmp_path / "migration.json"
    tool = Path(__file__).resolve().parents[1] / "tools" / "bench_migration.py"
    subprocess.run([sys.executable, str(tool), "--models", "tiny", "--world", "2", "--transitions", "s2:s1",
                    "--methods", "direct", "--repeats", "1", "--timeout-s", "120", "--out", str(out)],
                   check=True, timeout=300, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    (record,) = json.loads(out.read_text())
    assert record["method"] == "direct" and record["transition"] == "s2:s1"
    assert record["bit_exact"] and record["memory_run_bit_exact"] and record["within_memory_bound"]
    # the leaver's half came over the wire (not the optimizer's step counts: the survivor holds its own alike)
    assert 0.99 * record["old_state_bytes"] < record["bytes_moved"] <= record["old_state_bytes"]
    assert record["bytes_copied"] > 0  # the survivor's own half, copied where the new layout wants it
    assert record["link_limit_seconds"] > 0 and record["host_limit_seconds"] > 0


def test_the_benchmarks_measure_the_checkout_on_pythonpath(tmp_path: Path) -> None:
    """Code measured side by side with the code before it comes from a checkout put on ``PYTHONPATH``: the tools
    that start agents must import the package from there, not from the checkout they sit in (they put their own
    first on ``sys.path`` before, so such comparisons measured the same code twice)."""
    package = tmp_path / "lightning_emig"
    package.mkdir()
    (package / "__init__.py").write_text("raise SystemExit('the package on PYTHONPATH was imported')\n")
    tools = Path(__file__).resolve().parents[1] / "tools"
    for tool in ("bench_elastic.py", "bench_prepare.py"):
        result = subprocess.run([sys.executable, str(tools / tool), "--help"], capture_output=True, text=True,
                                timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
        assert "the package on PYTHONPATH was imported" in result.stderr, (tool, result.stdout, result.stderr)
