"""The death watch: a survivor stops computing as soon as a peer's agent marks it dead, not at its next collective
(:mod:`lightning_emig.membership.death_watch`). Here, against a store: which marks count (only the other nodes of
the generation the process trains in), a poll that fails halfway, and the hooks (no module runs forward or backward
once a death is noticed, nothing raised after the optimizer step's hook). End to end, through a user's own script:
``tests/test_user_script.py::test_the_script_survives_a_killed_peer[worker_with_replicas]`` (the worker is killed
while the survivor is inside a step; the death watch, not a collective, ends that step).
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist

from lightning_emig.launcher.generation import (
    LAST_DEATH_KEY,
    GenerationError,
    NodeEntry,
    dead_key,
    publish_generation,
)
from lightning_emig.membership import death_watch
from lightning_emig.membership.death_watch import DeathWatch, DeathWatchHooks, PeerDeathNoticed
from lightning_emig.membership.failure import is_peer_failure


def _publish(store: dist.Store, nodes: dict[str, int]) -> int:
    entries = [NodeEntry(node_id=n, ranks=(r,), kept_workers=True) for n, r in nodes.items()]
    generation = publish_generation(store, nodes=entries, world_size=len(entries), master_addr="127.0.0.1",
                                    master_port=1, rendezvous_seconds=0.0)
    assert generation is not None
    return generation


def _mark_dead(store: dist.Store, node_id: str) -> None:
    """What an agent writes when its node's worker died (``_mark_dead`` in the agent)."""
    store.set(dead_key(node_id), json.dumps({"time": time.time()}))
    store.set(LAST_DEATH_KEY, json.dumps({"node_id": node_id, "time": time.time()}))


def test_the_death_watch_notices_a_peer_of_its_own_generation_marked_dead() -> None:
    store = dist.HashStore()
    first, second = _publish(store, {"a": 0, "b": 1}), _publish(store, {"a": 0, "c": 1})
    current = [first]
    watch = DeathWatch(lambda: current[0], node_id="a", client=store, poll_s=3600.0)  # polled by hand here
    try:
        watch.look()
        watch.raise_if_noticed()  # nobody died
        _mark_dead(store, "a")  # this node: its agent stops this worker anyway
        _mark_dead(store, "c")  # a node of another generation
        watch.look()
        watch.raise_if_noticed()
        _mark_dead(store, "b")
        watch.look()
        with pytest.raises(PeerDeathNoticed, match="node b of generation") as noticed:
            watch.raise_if_noticed()
        assert is_peer_failure(noticed.value)  # the fit ends as a failed collective ends it
        try:  # as torch's pipeline schedule wraps what a stage's forward raised
            raise RuntimeError("[Stage 0] failed to run forward: args: ...") from noticed.value
        except RuntimeError as wrapped:
            assert is_peer_failure(wrapped)
        try:  # an error of the recovery itself, raised while the death was handled, is none
            try:
                raise noticed.value
            except PeerDeathNoticed:
                raise RuntimeError("process 0 needs 48 bytes that no live process holds")  # noqa: B904 - as a recovery
        except RuntimeError as own:
            assert own.__context__ is noticed.value and not is_peer_failure(own)
        current[0] = second  # the survivors' generation: b is not in it, c is (and is marked)
        watch.raise_if_noticed()
        watch.look()
        with pytest.raises(PeerDeathNoticed, match="node c of generation"):
            watch.raise_if_noticed()
    finally:
        watch.stop()


def test_a_look_that_fails_halfway_is_made_again() -> None:
    store = dist.HashStore()
    _mark_dead(store, "b")  # marked before this process can read its generation (not published yet)
    watch = DeathWatch(lambda: 0, node_id="a", client=store, poll_s=3600.0)
    try:
        with pytest.raises(GenerationError, match="not published yet"):
            watch.look()
        assert _publish(store, {"a": 0, "b": 1}) == 0
        watch.look()
        with pytest.raises(PeerDeathNoticed):
            watch.raise_if_noticed()
    finally:
        watch.stop()


class _Counting(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        self.ran: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x.register_hook(lambda grad, i=i: self.ran.append(f"backward {i}"))
            self.ran.append(f"forward {i}")
        return x


def test_once_a_death_is_noticed_no_module_runs_forward_or_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    store = dist.HashStore()
    generation = _publish(store, {"a": 0, "b": 1})
    watch = DeathWatch(lambda: generation, node_id="a", client=store, poll_s=3600.0)
    monkeypatch.setattr(death_watch, "_watching", watch)
    model, hooks = _Counting(), DeathWatchHooks()
    hooks.on_train_start(None, model)  # type: ignore[arg-type]
    try:
        hooks.on_train_batch_start(None, model, None, 0)  # type: ignore[arg-type]
        loss = model(torch.ones(2, 4)).sum()  # nobody died: the whole forward runs
        assert model.ran == ["forward 0", "forward 1", "forward 2"]
        _mark_dead(store, "b")
        watch.look()
        with pytest.raises(PeerDeathNoticed):
            loss.backward()
        assert model.ran[3:] == [], "a layer's backward ran after the death was noticed"
        with pytest.raises(PeerDeathNoticed):
            model(torch.ones(2, 4))
        assert len(model.ran) == 3, "a layer ran forward after the death was noticed"
        # After the optimizer step's hook the state may be written already: no raise there (the survivors would
        # hold no consistent step); the next micro-batch raises again.
        hooks.on_before_optimizer_step(None, model, None)  # type: ignore[arg-type]
        model(torch.ones(2, 4))
        assert len(model.ran) == 6
        hooks.on_train_batch_start(None, model, None, 1)  # type: ignore[arg-type]
        with pytest.raises(PeerDeathNoticed):
            model(torch.ones(2, 4))
        hooks.on_train_end(None, model)  # type: ignore[arg-type]
        model(torch.ones(2, 4))  # the hooks are gone with the fit
        assert len(model.ran) == 9
    finally:
        watch.stop()


def test_a_death_noticed_ends_the_generations_collectives_unless_a_node_that_announced_its_departure_exited(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A frozen or vanished peer closes no socket: a collective waiting on it would wait for its timeout. So a death
    noticed shuts down the groups' connections of that generation (:mod:`lightning_emig.collective_sockets`, tested
    there with real processes) — but not for a preempted node's exit (its process leaves on purpose after its
    handoff), whose notice must not hide another node's death after it; a preempted node gone silent does count."""
    from lightning_emig.launcher.generation import leaving_key
    from lightning_emig.membership.exit_watch import endpoint_key, exited_key

    interrupted: list[int] = []
    monkeypatch.setattr(death_watch, "interrupt_group_sockets", lambda generation: interrupted.append(generation) or 3)
    store = dist.HashStore()
    first = _publish(store, {"a": 0, "b": 1, "c": 2})
    watch = DeathWatch(lambda: first, node_id="a", client=store, poll_s=3600.0)
    try:
        store.set(leaving_key("b"), json.dumps({"deadline": time.time() + 30}))
        _mark_dead(store, "b")
        watch.look()
        with pytest.raises(PeerDeathNoticed, match="node b of generation"):
            watch.raise_if_noticed()
        assert interrupted == []
        _mark_dead(store, "c")
        watch.look()
        assert interrupted == [first]
        watch.look()
        assert interrupted == [first]  # once
    finally:
        watch.stop()
    second = _publish(store, {"a": 0, "d": 1})
    store.set(leaving_key("d"), json.dumps({"deadline": time.time() + 30}))
    store.set(endpoint_key("d", 0), "127.0.0.1 5 100")
    store.set(exited_key("d", 0), json.dumps({"endpoint": "127.0.0.1 5 100", "time": time.time(), "by": "a",
                                              "generation": second, "how": "its host stopped answering"}))
    store.set(LAST_DEATH_KEY, json.dumps({"node_id": "d", "time": time.time(), "exited": True}))
    other = DeathWatch(lambda: second, node_id="a", client=store, poll_s=3600.0)
    try:
        other.look()
        assert interrupted == [first, second]
    finally:
        other.stop()


def test_a_dead_mark_from_before_the_generation_the_node_rejoined_is_history() -> None:
    """Node b was marked dead in an earlier generation and rejoined; its agent deletes the mark once in the new round,
    but the others' workers may start first: the mark does not make them take b for dead (a fresh worker would exit,
    and every node restart, for nothing). A mark written in the watched generation counts."""
    store = dist.HashStore()
    _publish(store, {"a": 0, "b": 1})
    generation = _publish(store, {"a": 0, "b": 1})
    watch = DeathWatch(lambda: generation, node_id="a", client=store, poll_s=3600.0)  # polled by hand here
    try:
        store.set(dead_key("b"), json.dumps({"time": time.time(), "generation": generation - 1}))
        store.set(LAST_DEATH_KEY, json.dumps({"node_id": "b", "time": time.time()}))
        watch.look()
        watch.raise_if_noticed()
        _mark_dead(store, "b")  # now, in the generation watched
        store.set(dead_key("b"), json.dumps({"time": time.time(), "generation": generation}))
        watch.look()
        with pytest.raises(PeerDeathNoticed, match="node b of generation"):
            watch.raise_if_noticed()
    finally:
        watch.stop()
