"""The typed record of a change: a drain (or a rebuild) followed by the next fit's local re-layout is one change."""

from __future__ import annotations

from lightning_emig import HybridLayout
from lightning_emig.migration.change import ChangeRecord


def test_a_change_followed_by_its_completion_is_one_change_from_the_first_world_to_the_last() -> None:
    drain = ChangeRecord(kind="preempt", step=40, old_layout=HybridLayout(dp_shard=3), new_layout=HybridLayout(dp_shard=2),
                         old_world=3, new_world=2, bytes_moved=1000, bytes_copied_locally=10,
                         seconds={"transfer": 0.5}, nodes=("b",))
    local = ChangeRecord(kind="join", step=40, old_layout=HybridLayout(dp_shard=2), new_layout=HybridLayout(dp_shard=2),
                         old_world=2, new_world=2, bytes_moved=0, bytes_copied_locally=500,
                         seconds={"handshake": 0.1, "transfer": 0.25})
    whole = drain.then(local)
    assert (whole.kind, whole.step, whole.old_world, whole.new_world, whole.nodes) == ("preempt", 40, 3, 2, ("b",))
    assert (whole.old_layout.dp_shard, whole.new_layout.dp_shard) == (3, 2)
    assert (whole.bytes_moved, whole.bytes_copied_locally) == (1000, 510)
    assert list(whole.seconds) == ["handshake", "transfer"] and whole.seconds["transfer"] == 0.75
