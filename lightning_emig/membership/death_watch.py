"""Notice a peer's death as soon as its agent does, not at this process's next collective.

A collective with a dead peer fails at once on gloo (its sockets close), but only when a survivor gets to one. Until
then it computes on: a replica under HSDP runs a whole forward alone, and with gradient accumulation whole
micro-batches (their gradients are reduced only with the last one) — seconds of work the recovery throws away, since
it restores the last step boundary. The agent of a node whose worker died marks it dead within its monitor interval
(``dead/<node_id>``, and ``last_death`` naming it: :mod:`~lightning_emig.launcher.agent`). So every worker under
``lightning-emig-run`` runs a :class:`DeathWatch`:

* a thread reads ``last_death`` every :data:`POLL_S` (one key however many nodes the job has, through a control-store
  client of its own); when it names a new death, or the process moved to another generation, it reads the ``dead/``
  marks of the other nodes of the generation the process trains in;
* once one is marked, :class:`DeathWatchHooks` (installed on the LightningModule's modules at every fit) raise
  :class:`PeerDeathNoticed` in the training thread from the next module it runs forward, or backward, through. The fit
  ends as the failed collective would have ended it, and the same recovery follows
  (:mod:`~lightning_emig.membership.failure`), a few milliseconds of compute after the mark instead of up to a step.

The hooks raise only between a micro-batch's start (``on_train_batch_start``) and the optimizer step's hook
(``on_before_optimizer_step``): in the training step's forward and backward, which only read the state. Never after
the optimizer wrote the state and before the next boundary captured it (a callback's forward at the batch's end, a
closure an optimizer evaluates again after updating), where the survivors would hold no consistent step and roll
back; nor in validation. There, it is noticed as before: by a collective's error.

Where no agent is left to mark the death (the whole node gone), the same thread also watches one peer's process
(:mod:`~lightning_emig.membership.exit_watch`): the process exits, the watcher marks it and writes ``last_death``, and
every death watch of its generation notices it as it would an agent's mark; so are a host that stops answering on
that connection and a process whose heartbeat stops (a frozen one).

A survivor already blocked inside a collective runs no hook. On gloo, a death noticed also ends every collective of
the generation (:func:`~lightning_emig.collective_sockets.interrupt_group_sockets`): a frozen or vanished peer closes
no socket, and the collective waiting on it would otherwise end only at its timeout. Not for the exit of a node that
announced its departure (a preempted node's process exits once its state was handed over, and the survivors may still
use the old groups); its silence does end them.
A process that is still forming its groups as a generation starts fresh (the job's first start, or a restart from a
checkpoint: nobody in it holds live state) can be blocked where nothing ends: gloo connecting to the dead peer until
the group's timeout. A death noticed then ends the process at once with
:data:`~lightning_emig.launcher.generation.NO_HOLDERS_EXIT_CODE`, as a joiner that finds no holder exits: its agent
restarts the node's workers without spending a restart, and so do the others', from the newest checkpoint.
Outside ``lightning-emig-run``, and on torchrun's restart path (its agents mark nothing), the thread sees no mark.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_emig.collective_sockets import interrupt_group_sockets
from lightning_emig.launcher.generation import (
    ENV_NODE_ID,
    LAST_DEATH_KEY,
    NO_HOLDERS_EXIT_CODE,
    control_client_from_env,
    leaving_key,
    node_host,
    read_dead_mark,
    read_generation,
)
from lightning_emig.launcher.heartbeat import mark_gone
from lightning_emig.membership.exit_watch import (
    ExitListener,
    ExitWatch,
    gone_how,
    member_exited,
    seen_exiting,
)
from lightning_emig.membership.settings import FailureSettings

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.utils.hooks import RemovableHandle

log = logging.getLogger(__name__)

POLL_S = 0.1
"""How often the thread reads ``last_death``: the longest a survivor computes on after a peer's agent marked it."""


class PeerDeathNoticed(dist.DistError):
    """A peer of this process's generation died (its agent marked its node dead): raised in the training thread, as
    the collective with that peer would raise, so that :func:`~lightning_emig.membership.failure.is_peer_failure`
    takes it for one."""


class DeathWatch:
    """The thread of one process (see the module); ``generation`` says, whenever asked, which generation it trains in."""

    def __init__(self, generation: Callable[[], int], *, node_id: str | None = None, client: Any = None,
                 poll_s: float = POLL_S, exits: bool = False, local_rank: int | None = None,
                 settings: FailureSettings | None = None, starting_fresh: Callable[[], bool] | None = None) -> None:
        """``exits``: also listen, and watch the member after this one, for a process that exits, a host that stops
        answering or a heartbeat that stops, by ``settings``' timeouts (:mod:`~lightning_emig.membership.exit_watch`);
        this process is worker ``local_rank`` of ``node_id``. ``starting_fresh`` says whether the process still forms
        the groups of a generation that started fresh (a death then ends it: see the module)."""
        self._generation = generation
        self._starting_fresh = starting_fresh
        self._node_id = node_id or os.environ[ENV_NODE_ID]
        self._client = client if client is not None else control_client_from_env(timeout_s=10.0)
        self._poll_s = poll_s
        self._local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
        self._listener: ExitListener | None = None
        self._exits: ExitWatch | None = None
        if exits:
            self._listener = ExitListener(self._client, self._node_id, self._local_rank, node_host(self._node_id))
            settings = settings or FailureSettings()
            self._exits = ExitWatch(self._client, self._node_id, self._local_rank,
                                    heartbeat_interval_s=settings.heartbeat_interval_s,
                                    heartbeat_timeout_s=settings.heartbeat_timeout_s,
                                    unreachable_timeout_s=settings.unreachable_timeout_s)
        self._noticed: dict[int, str] = {}
        """Generation -> what was noticed (written by the thread, read by the training thread: one dict store)."""
        self._interrupted: set[int] = set()
        """Generations whose collectives were ended (nothing more to look for in them)."""
        self._others: dict[int, list[tuple[str, int]]] = {}
        self._looked_at: tuple[bytes | None, int] | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightning-emig-death-watch", daemon=True)
        self._thread.start()

    def raise_if_noticed(self) -> None:
        """Raise :class:`PeerDeathNoticed` when a peer of the current generation was marked dead (the hooks call this,
        on every module's forward: nothing but an empty dict's test until a death was noticed)."""
        if not self._noticed:
            return
        noticed = self._noticed.get(self._generation())
        if noticed is not None:
            raise PeerDeathNoticed(noticed)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=15.0)
        for closing in (self._exits, self._listener):
            if closing is not None:
                closing.close()

    def _run(self) -> None:
        while not self._stopped.wait(self._poll_s):
            for poll in (self.watch_exits, self.look):  # one failing leaves the other's poll alone
                try:
                    poll()
                except Exception:  # noqa: BLE001 - the store may be gone at the very end of the job
                    log.debug("death watch: reading the control store failed", exc_info=True)

    def watch_exits(self) -> None:
        """One poll of the exit watch (the thread's; public for tests); nothing when it is off."""
        if self._listener is None or self._exits is None:
            return
        self._listener.accept_pending()
        generation = self._generation()
        self._listener.entered(generation)
        exited = self._exits.poll(generation, lambda: read_generation(self._client, generation))
        if exited is not None:
            log.error("death watch: %s", exited)

    def look(self) -> None:
        """One poll (the thread's; public for tests)."""
        generation = self._generation()
        if generation < 0 or generation in self._interrupted:
            return
        client = self._client
        last = client.get(LAST_DEATH_KEY) if client.check([LAST_DEATH_KEY]) else None
        if last is None or (last, generation) == self._looked_at:
            return
        for node_id, local_ranks in self._other_nodes(generation):
            death = _death_of(client, node_id, local_ranks, generation)
            if death is None:
                continue
            if generation not in self._noticed:
                self._noticed[generation] = (f"node {node_id} of generation {generation} {death.how} (before any "
                                             "collective failed here)")
                log.error("death watch: %s", self._noticed[generation])
                if self._starting_fresh is not None and self._starting_fresh():
                    _exit_holding_nothing(client, self._node_id, self._local_rank, generation)
            # A preempted node's process exits once its state was handed over, and the survivors may still use the old
            # groups (a checkpoint being written): its exit ends nothing. Its silence (frozen, its host gone) does.
            if death.silent or not client.check([leaving_key(node_id)]):
                self._interrupt(generation, node_id)
                return
        self._looked_at = (last, generation)  # only once looked at: a poll that failed halfway is made again

    def _interrupt(self, generation: int, node_id: str) -> None:
        """End every collective of ``generation``: one may wait on the dead node, and a frozen process or a host gone
        never closes its sockets."""
        shut = interrupt_group_sockets(generation)
        self._interrupted.add(generation)
        if shut:
            log.error("death watch: shut down %d connection(s) of generation %d's process groups: a collective "
                      "waiting on node %s ends now", shut, generation, node_id)

    def _other_nodes(self, generation: int) -> list[tuple[str, int]]:
        """The other nodes of ``generation``: (node id, how many workers)."""
        if generation not in self._others:
            nodes = read_generation(self._client, generation).nodes
            self._others[generation] = [(node.node_id, len(node.ranks)) for node in nodes
                                        if node.node_id != self._node_id]
        return self._others[generation]


def _exit_holding_nothing(client: Any, node_id: str, local_rank: int, generation: int) -> None:
    """End this process, which forms the groups of ``generation`` as it starts fresh: a peer is dead, and a gloo
    connection to it would wait for the group's timeout (see the module). It marks itself gone first: its agent may be
    in a rendezvous round, not watching its workers, while the dead node's agent waits for every member that could
    still hold the state (one never having held looks still starting up)."""
    with contextlib.suppress(Exception):  # the store may be gone too: the exit matters, not the mark
        mark_gone(client, node_id, range(local_rank, local_rank + 1))
    log.error("death watch: generation %d lost a member while this process formed its groups, and nobody in it holds "
              "live state: exiting (code %d) so that every node restarts its workers from the newest complete "
              "checkpoint", generation, NO_HOLDERS_EXIT_CODE)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(NO_HOLDERS_EXIT_CODE)  # the training thread is blocked inside torch: no exception reaches it


@dataclass(frozen=True)
class _Death:
    how: str
    """For the log: how the node is known dead."""
    silent: bool
    """Its process was found gone without closing anything (frozen, its host gone), not seen to exit."""


def _death_of(client: Any, node_id: str, local_ranks: int, generation: int) -> _Death | None:
    """How a node is known dead — its agent's mark, or a worker's process seen gone — or None. A mark its agent
    wrote in a generation before ``generation`` is history: the node is in ``generation``, so it rejoined since (its
    agent deletes the mark then, but another agent's workers may start first)."""
    mark = read_dead_mark(client, node_id)
    if mark is not None and int(mark.get("generation", generation)) >= generation:
        marked = mark.get("time")
        after = "" if marked is None else f", noticed {max(0.0, time.time() - float(marked)):.2f}s after its mark"
        return _Death(f"was marked dead by its agent (a worker of it died{after})", silent=False)
    for local_rank in range(local_ranks):
        exited = member_exited(client, node_id, local_rank, generation)
        if exited is not None:
            after = f", noticed {max(0.0, time.time() - float(exited['time'])):.2f}s after"
            seen = f"seen by node {exited['by']}{after}"
            return _Death(f"lost worker {local_rank}: its process {gone_how(exited)} ({seen})",
                          silent=not seen_exiting(exited))
    return None


_watching: DeathWatch | None = None


def start_death_watch(generation: Callable[[], int], settings: FailureSettings, *, exits: bool = True,
                      starting_fresh: Callable[[], bool] | None = None) -> DeathWatch:
    """This process's death watch (idempotent: later calls return the running one); stopped and joined at exit, as
    the heartbeat is (a daemon thread inside a store call at finalization aborts the process). ``exits``:
    ``elastic.watch_exits``; ``starting_fresh``: see :class:`DeathWatch`."""
    global _watching
    if _watching is None:
        _watching = DeathWatch(generation, exits=exits, settings=settings, starting_fresh=starting_fresh)
        atexit.register(_watching.stop)
    return _watching


class DeathWatchHooks(Callback):
    """At every fit, hooks on the LightningModule's modules that hold parameters: before each forward, and as each
    one's output gradient is computed in backward, this process's watch raises if a peer was marked dead (see the
    module); nothing where no watch runs. Removed when the fit ends; the modules a change drops take theirs along."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []
        self._armed = False
        """Between a micro-batch's start and the optimizer step's hook (see the module)."""

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove()
        if _watching is None:
            return
        watch = _watching

        def check() -> None:
            if self._armed:
                watch.raise_if_noticed()

        def before_forward(_module: torch.nn.Module, _args: Any) -> None:
            check()

        def after_forward(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.grad_fn is not None:  # not a leaf: its hooks go with it
                output.register_hook(lambda _grad: check())

        for module in pl_module.modules():
            if next(module.parameters(recurse=False), None) is not None:
                self._handles.append(module.register_forward_pre_hook(before_forward))
                self._handles.append(module.register_forward_hook(after_forward))

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
                             ) -> None:
        self._armed = True

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._armed = False

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._armed = False

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove()

    def _remove(self) -> None:
        self._armed = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
