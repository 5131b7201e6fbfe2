"""Admission into overlapping rounds (lightning_emig.membership.admission), on an in-memory control store.

The case from the field: two joins ten seconds apart. The agents publish generation 1 (A holds the state, B joins);
B's worker is still starting when C joins, and the agents publish generation 2, listing B's worker among the kept
ones. A must wait for both B and C, and B must form generation 2, not the generation 1 nobody forms.
"""

from __future__ import annotations

import json
import os
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_emig.launcher.generation import (
    LEFT_OUT_EXIT_CODE,
    NO_HOLDERS_EXIT_CODE,
    GenerationError,
    NodeEntry,
    agent_heartbeat_key,
    dead_key,
    holding_key,
    leaving_key,
    publish_generation,
    read_generation,
    ready_key,
)
from lightning_emig.launcher.heartbeat import HeartbeatWatch, forget_holders, holders_alive, mark_gone
from lightning_emig.membership.admission import (
    LeftOutError,
    NoHoldersError,
    PreemptedBeforeAdmissionError,
    active_generation,
    await_admission,
    commit_generation,
    joiners_ready,
)


def _publish(store: dist.Store, *nodes: tuple[str, bool]) -> int:
    entries = [NodeEntry(node_id=n, ranks=(r,), kept_workers=k) for r, (n, k) in enumerate(nodes)]
    generation = publish_generation(store, nodes=entries, world_size=len(entries), master_addr="127.0.0.1",
                                    master_port=1, rendezvous_seconds=0.0)
    assert generation is not None
    return generation


def _patient(store: dist.Store) -> HeartbeatWatch:
    """A watch that judges no holder gone (these tests are about the generations, not the heartbeats)."""
    return HeartbeatWatch(store, timeout_s=3600)


@pytest.fixture
def two_joins_apart() -> dist.Store:
    """Generation 0: A. Generation 1: A kept, B started. Generation 2: A and B kept (B still starting), C started."""
    store = dist.HashStore()
    _publish(store, ("a", False))
    commit_generation(store, 0)
    _publish(store, ("a", True), ("b", False))
    _publish(store, ("a", True), ("b", True), ("c", False))
    return store


def test_the_holders_wait_for_every_worker_that_is_not_theirs_whatever_its_entry_says(two_joins_apart) -> None:
    store = two_joins_apart
    holders, newest = read_generation(store, 0), read_generation(store, 2)
    store.set(ready_key("c", 0), "2")
    assert not joiners_ready(store, newest, holders)  # B is listed as kept, but A does not hold it: it is a joiner
    store.set(ready_key("b", 0), "1")
    assert joiners_ready(store, newest, holders)
    assert joiners_ready(store, newest, read_generation(store, 1))  # holders of 1 (A, B): only C joins


def test_a_joiner_forms_the_generation_the_holders_commit_to_not_the_one_it_was_started_into(two_joins_apart) -> None:
    store = two_joins_apart
    formed: list[int] = []
    waiter = threading.Thread(target=lambda: formed.append(
        await_admission(store, "b", 0, started_in=1, timeout_s=30, poll_s=0.01, holders=_patient(store))))
    waiter.start()
    while not store.check([ready_key("b", 0)]):  # B announces itself ready before it waits
        threading.Event().wait(0.01)
    assert waiter.is_alive()  # nothing committed past 0 yet: B waits
    commit_generation(store, 2)
    waiter.join(timeout=10)
    assert formed == [2]
    commit_generation(store, 1)  # the commitment only grows
    assert active_generation(store) == 2


def test_a_joiner_the_holders_went_on_without_is_left_out_and_its_agent_rejoins(two_joins_apart) -> None:
    store = two_joins_apart
    survivors = _publish(store, ("a", True))  # e.g. a drain published A's own generation after both rounds
    commit_generation(store, survivors)
    with pytest.raises(LeftOutError) as left_out:
        await_admission(store, "c", 0, started_in=2, timeout_s=30, poll_s=0.01, holders=_patient(store))
    assert left_out.value.code == LEFT_OUT_EXIT_CODE
    assert not store.check([ready_key("c", 0)])  # a process on its way out is not ready


def test_a_joiner_whose_node_is_preempted_before_admission_exits_0(two_joins_apart) -> None:
    """It holds nothing to hand off: waiting on would run its node's grace period out (exit 1 for the node)."""
    store = two_joins_apart
    store.set(leaving_key("c"), '{"deadline": 0}')
    with pytest.raises(PreemptedBeforeAdmissionError) as left:
        await_admission(store, "c", 0, started_in=2, timeout_s=30, poll_s=0.01, holders=_patient(store))
    assert left.value.code == 0
    assert not store.check([ready_key("c", 0)])
    commit_generation(store, 2)  # admitted before it saw the notice: it forms the generation (and hands off later)
    assert await_admission(store, "c", 0, started_in=2, timeout_s=30, poll_s=0.01, holders=_patient(store)) == 2


def test_a_joiner_that_is_never_admitted_says_what_it_waited_for(two_joins_apart) -> None:
    with pytest.raises(GenerationError, match="started into generation 2, ready, and no generation including this "
                                              r"worker .* within 0s \(latest they committed to: 0\)"):
        await_admission(two_joins_apart, "c", 0, started_in=2, timeout_s=0.2, poll_s=0.01,
                        holders=_patient(two_joins_apart))


def test_a_joiner_with_no_holder_left_exits_for_a_restart_from_the_checkpoint(two_joins_apart) -> None:
    """Every worker of the generation the holders committed to stopped beating ``holds/``: nobody is left to admit
    the joiner, whose agent then restarts the job from its newest checkpoint (the etcd hang of issue 34)."""
    store, now = two_joins_apart, [0.0]
    watch = HeartbeatWatch(store, timeout_s=5, clock=lambda: now[0])
    store.set(holding_key("a", 0), "1.0")  # A, the holder of committed generation 0, beat once
    assert holders_alive(store, watch)
    now[0] = 4.0
    assert holders_alive(store, watch)  # not stale yet
    store.set(holding_key("a", 0), "2.0")  # and beats again: alive however long it has been
    now[0] = 8.0
    assert holders_alive(store, watch)
    store.set(holding_key("c", 0), "1.0")  # a fresh worker's ``holds/`` of another node keeps nobody alive
    now[0] = 13.5
    assert not holders_alive(store, watch)
    with pytest.raises(NoHoldersError) as gone:
        await_admission(store, "c", 0, started_in=2, timeout_s=30, poll_s=0.01, holders=watch)
    assert gone.value.code == NO_HOLDERS_EXIT_CODE
    assert not store.check([ready_key("c", 0)])
    commit_generation(store, 1)  # the holders had formed generation 1 (A, B): both beat
    store.set(holding_key("a", 0), "3.0")
    store.set(holding_key("b", 0), "1.0")
    assert holders_alive(store, watch)
    now[0] = 19.0  # both stopped at once: each is judged from its first read, not from when the other went stale
    assert not holders_alive(store, watch)


def test_a_worker_that_has_not_held_yet_counts_while_its_agent_beats() -> None:
    """A generation that starts from a checkpoint: its workers hold nothing while they start up (imports, the group),
    which may take longer than the heartbeat timeout. They count as holders-to-be while their node's agent beats and
    has not marked them dead; the keys of the processes before them are forgotten when the generation is published."""
    store, now = dist.HashStore(), [0.0]
    generation = _publish(store, ("a", False), ("b", False))
    store.set(holding_key("a", 0), "1.0")  # what A's previous process held: gone with it
    forget_holders(store, read_generation(store, generation).members)
    commit_generation(store, generation)
    watch = HeartbeatWatch(store, timeout_s=5, clock=lambda: now[0])
    store.set(agent_heartbeat_key("a"), "1.0")
    store.set(agent_heartbeat_key("b"), "1.0")
    assert holders_alive(store, watch)
    now[0] = 6.0  # both agents stopped beating: nobody is starting anything
    assert not holders_alive(store, watch)
    store.set(agent_heartbeat_key("a"), "2.0")
    assert holders_alive(store, watch)  # A's agent beats again (it was slow), its worker is starting
    store.set(dead_key("a"), "{}")
    assert not holders_alive(store, watch)  # ... until A's agent saw its worker die


def test_a_worker_its_agent_replaced_is_gone_at_once_and_a_joiner_that_never_held_keeps_nothing_alive() -> None:
    store = dist.HashStore()
    watch = HeartbeatWatch(store, timeout_s=3600)  # nothing goes stale here: only the marks decide
    _publish(store, ("a", False))
    generation = _publish(store, ("a", True), ("b", False))  # live: A holds, B was admitted
    commit_generation(store, generation)
    store.set(holding_key("a", 0), "1.0")
    store.set(agent_heartbeat_key("b"), "1.0")
    assert holders_alive(store, watch)
    mark_gone(store, "a", range(1))  # A's agent saw its worker fail (or replaced it): gone, no timeout to wait
    assert not holders_alive(store, watch)  # B, admitted but never holding, keeps nothing alive


def test_the_agent_rejoins_only_when_every_failed_worker_was_left_out() -> None:
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from lightning_emig.launcher.agent import _joiner_exit

    def failed(*codes: int) -> RunResult:
        failures = {}
        for rank, code in enumerate(codes):
            failure = ProcessFailure.__new__(ProcessFailure)
            failure.exitcode = code
            failures[rank] = failure
        return RunResult(state=WorkerState.FAILED, failures=failures)

    assert _joiner_exit(failed(LEFT_OUT_EXIT_CODE, LEFT_OUT_EXIT_CODE)) == LEFT_OUT_EXIT_CODE
    assert _joiner_exit(failed(LEFT_OUT_EXIT_CODE, 1)) is None
    assert _joiner_exit(failed(-9)) is None
    assert _joiner_exit(failed(NO_HOLDERS_EXIT_CODE, LEFT_OUT_EXIT_CODE)) == NO_HOLDERS_EXIT_CODE  # nobody admits
    assert _joiner_exit(failed(NO_HOLDERS_EXIT_CODE, 1)) is None
    assert _joiner_exit(RunResult(state=WorkerState.FAILED)) is None


def test_a_failed_node_sees_the_survivors_go_on_without_it_even_past_an_overlapping_round() -> None:
    """Chaos seed 3: B's worker dies in generation 0 (A and B); A recovers into generation 1 of its own (committed)
    while B's agent, in an overlapping rendezvous round, publishes generation 2 listing its dead worker as kept.
    Nobody forms 2, and nobody publishes another unless B comes back: B's agent must rejoin now, not wait."""
    from lightning_emig.launcher.generation import generation_going_on_without

    store = dist.HashStore()
    _publish(store, ("a", False), ("b", False))
    commit_generation(store, 0)
    assert generation_going_on_without(store, "b") is None  # the survivors have not recovered yet
    _publish(store, ("a", True))
    commit_generation(store, 1)
    assert generation_going_on_without(store, "b") == 1
    _publish(store, ("a", True), ("b", True))  # B's round, not committed by the holders
    assert generation_going_on_without(store, "b") == 1
    assert generation_going_on_without(store, "a") is None


def test_the_survivors_generation_is_published_with_the_store_its_rank_0_already_hosts() -> None:
    """No free-port race: the port published is one the publisher bound before publishing, and forming the group
    uses that very store."""
    from lightning_emig.membership.group import form_generation_group
    from lightning_emig.membership.preempt import publish_survivors

    store = dist.HashStore()
    _publish(store, ("a", False), ("b", False))
    generation = publish_survivors(store, read_generation(store, 0), {0: 0}, "127.0.0.1", timedelta(seconds=10))
    assert generation is not None and active_generation(store) == generation
    info = read_generation(store, generation)
    with pytest.raises(Exception):  # noqa: B017, PT011 - the port is taken: by our own hosted store
        dist.TCPStore(info.master_addr, info.master_port, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=2))
    form_generation_group(info, 0, "gloo", timedelta(seconds=10))
    try:
        assert dist.get_world_size() == 1
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_generation_that_nobody_forms_fails_naming_what_was_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_emig.membership.group import enter_generation, generation_env
    from lightning_emig.testing.distributed import free_port

    info = read_generation(_store_with(("a", False), ("b", False), port=free_port()), 0)
    _restore_after_test(monkeypatch, generation_env(info, "b", 0))  # entering rewrites torchrun's variables
    with pytest.raises(GenerationError, match=r"rank 1 could not form generation 0's process group \(world 2, store "
                                              r"127.0.0.1:\d+, timeout 1s\)"):
        enter_generation(info, "b", 0, "gloo", timedelta(seconds=1))
    assert not dist.is_initialized()


def _store_with(*nodes: tuple[str, bool], port: int) -> dist.Store:
    store = dist.HashStore()
    entries = [NodeEntry(node_id=n, ranks=(r,), kept_workers=k) for r, (n, k) in enumerate(nodes)]
    publish_generation(store, nodes=entries, world_size=len(entries), master_addr="127.0.0.1", master_port=port,
                       rendezvous_seconds=0.0)
    return store


@pytest.mark.parametrize("c_is", ["ready", "starting", "dead", "silent", "slow"])
def test_a_joiner_that_died_while_starting_does_not_hold_the_others_back(c_is: str) -> None:
    """Holders: A (generation 0). Generation 1 brings B (ready) and C. C ready: go into 1. C starting (its agent beats):
    wait. C dead (its agent marked it, or its agent's heartbeat stopped), or C slow past the holders' patience: the
    holders publish their own generation with B, committed, and go into it; C is left out and rejoins."""
    from lightning_emig.launcher.generation import agent_heartbeat_key, dead_key
    from lightning_emig.launcher.heartbeat import HeartbeatWatch
    from lightning_emig.membership.admission import generation_to_join

    store = dist.HashStore()
    _publish(store, ("a", False))
    commit_generation(store, 0)
    _publish(store, ("a", True), ("b", False), ("c", False))
    store.set(ready_key("b", 0), "1")
    clock = [0.0]
    watch = HeartbeatWatch(store, timeout_s=5.0, clock=lambda: clock[0])
    store.set(agent_heartbeat_key("c"), "beat 0")

    def later(seconds: float) -> None:  # our clock moves on; B's agent beats meanwhile
        clock[0] = seconds
        store.set(agent_heartbeat_key("b"), f"beat {seconds}")

    if c_is == "ready":
        store.set(ready_key("c", 0), "1")
    elif c_is == "dead":
        store.set(dead_key("c"), "{}")

    def ask() -> int | None:
        return generation_to_join(store, 0, watch, host="127.0.0.1", timeout=timedelta(seconds=10),
                                  give_up_on_starting=c_is == "slow")

    first = ask()
    if c_is == "silent":  # C's agent wrote its heartbeat once and stopped: dead once 5 s of our clock pass
        assert first is None
        later(6.0)
        first = ask()
    elif c_is == "starting":  # C's agent beats on: never given up on
        for beat in range(1, 4):
            later(6.0 * beat)
            store.set(agent_heartbeat_key("c"), f"beat {beat}")
            assert ask() is None
        return
    if c_is == "ready":
        assert first == 1
        return
    assert first == 2 and active_generation(store) == 2
    info = read_generation(store, 2)
    assert [(n.node_id, n.ranks, n.kept_workers) for n in info.nodes] == [("a", (0,), True), ("b", (1,), True)]


def test_holders_whose_new_generation_cannot_form_go_on_in_one_of_their_own(monkeypatch: pytest.MonkeyPatch
                                                                             ) -> None:
    """Generation 1 (A holding the state, joiner B) cannot form (B died as it formed). A, the one holder, recovers
    among the holders: nobody of them died, so it publishes and forms its own generation — A only, at its old rank,
    committed — and goes on with its handoff, unchanged, there."""
    from types import SimpleNamespace

    from lightning_emig.launcher.generation import GenerationError, worker_env
    from lightning_emig.layout import HybridLayout
    from lightning_emig.membership.failure import recover_from_failure
    from lightning_emig.membership.group import generation_env
    from lightning_emig.membership.handoff import LiveHandoff
    from lightning_emig.membership.settings import FailureSettings

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    for key, value in {**worker_env(node_id="127.0.0.1_1", control_address=f"127.0.0.1:{server.port}",
                                    prefix="lightning_emig/r/", generation=0, join_live=False),
                       "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    control = dist.PrefixStore("lightning_emig/r/", server)
    _publish(control, ("127.0.0.1_1", False))
    _publish(control, ("127.0.0.1_1", True), ("127.0.0.2_2", False))
    commit_generation(control, 1)
    _restore_after_test(monkeypatch, [k for k in generation_env(read_generation(control, 1), "127.0.0.1_1", 0)
                                      if k != "LOCAL_RANK"])  # entering a generation rewrites them
    handoff = LiveHandoff(generation=1, holders=(("127.0.0.1_1", 0),), old_layout=HybridLayout(), old_world=1,
                          old_rank=0, state=None, metadata={}, last_step_wall=0.0)
    worker = SimpleNamespace(  # what recover_from_failure reads of a training process (membership.settings)
        failure_settings=FailureSettings(failure_timeout_s=10), timeout=timedelta(seconds=10), reached_step=5,
        process_group_backend="gloo", release_process_groups=lambda: None)
    outcome = recover_from_failure(worker, GenerationError("generation 1: B died"), "127.0.0.1_1", 0,  # type: ignore[arg-type]
                                   held=handoff)
    try:
        assert outcome is handoff and handoff.generation == 2 and handoff.old_rank == 0
        assert active_generation(control) == 2 and dist.get_world_size() == 1
        info = read_generation(control, 2)
        assert [(n.node_id, n.ranks, n.kept_workers) for n in info.nodes] == [("127.0.0.1_1", (0,), True)]
        assert info.master_addr == "127.0.0.1"  # the holder's host: it hosts the store
        assert os.environ["RANK"] == "0" and os.environ["WORLD_SIZE"] == "1"
    finally:
        dist.destroy_process_group()


def test_holders_recover_again_when_one_of_them_dies_before_their_generation_forms(monkeypatch: pytest.MonkeyPatch
                                                                                  ) -> None:
    """Holders A and B; the change to generation 1 failed. Both report, nobody is dead: they publish their own
    generation — and B dies before it forms. A times out forming it and recovers again: B is dead now, and A (whose
    handoff holds no consistent state here) rolls back, alone, in a third generation."""
    from types import SimpleNamespace

    from lightning_emig.launcher.generation import dead_key, worker_env
    from lightning_emig.layout import HybridLayout
    from lightning_emig.membership.failure import Rollback, recover_from_failure, report_key
    from lightning_emig.membership.group import generation_env
    from lightning_emig.membership.handoff import LiveHandoff
    from lightning_emig.membership.settings import FailureSettings

    a, b = "127.0.0.1_1", "127.0.0.2_2"
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    for key, value in {**worker_env(node_id=a, control_address=f"127.0.0.1:{server.port}", prefix="lightning_emig/r/",
                                    generation=0, join_live=False), "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    control = dist.PrefixStore("lightning_emig/r/", server)
    _publish(control, (a, False), (b, False))
    _publish(control, (a, True), (b, True), ("127.0.0.3_3", False))
    _restore_after_test(monkeypatch, [k for k in generation_env(read_generation(control, 1), a, 0)
                                      if k != "LOCAL_RANK"])
    control.set(report_key("failure/1/holders", 1), json.dumps(
        {"node_id": b, "local_rank": 0, "step": -1, "consistent": False, "reached": 5}))
    handoff = LiveHandoff(generation=1, holders=((a, 0), (b, 0)), old_layout=HybridLayout(dp_shard=2), old_world=2,
                          old_rank=0, state=None, metadata={}, last_step_wall=0.0)
    worker = SimpleNamespace(
        failure_settings=FailureSettings(failure_timeout_s=10, heartbeat_timeout_s=60), timeout=timedelta(seconds=3),
        reached_step=5, process_group_backend="gloo", release_process_groups=lambda: None,
        elastic_settings=SimpleNamespace(layout_for_world=lambda world, current=None: (HybridLayout(dp_shard=world), None)))
    b_dies = threading.Timer(1.0, lambda: control.set(dead_key(b), "{}"))  # its agent marks it, as it forms
    b_dies.start()
    try:
        outcome = recover_from_failure(worker, GenerationError("generation 1: C died"), a, 0,  # type: ignore[arg-type]
                                       held=handoff)
        assert isinstance(outcome, Rollback) and outcome.dead_nodes == [b], outcome
        assert outcome.generation == 3 and dist.get_world_size() == 1
        assert [n.node_id for n in read_generation(control, 2).nodes] == [a, b]  # the one B died before forming
    finally:
        b_dies.cancel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _restore_after_test(monkeypatch: pytest.MonkeyPatch, keys: object) -> None:
    """These variables are absent during the test and as they were before it afterwards (a bare ``delenv`` of an
    absent variable records nothing: what the test then sets would leak into later tests)."""
    for key in keys:  # type: ignore[attr-defined]
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
