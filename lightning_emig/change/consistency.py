"""The consistency guard in Lightning's hooks: a fit never trains on state its ranks do not all hold.

:class:`ConsistencyGuard` (added by the strategy to every fit) proves one state (:mod:`lightning_emig.consistency`):

* when every fit starts, after its state arrived (a first start, a live join or handoff, a rebuild from replicas, a
  rollback, a checkpoint load): the ranks agree on step, data offset, generation and layout, replicas agree; and when
  the state came from a checkpoint or a handoff whose save hooks recorded a proof, the digest, step and data offset
  equal that proof's (a checkpoint written by another world, or a migration into another layout, included). A fit of
  one process with no such proof takes none: it would check nothing. The facts and the buffers are proven at once
  (the change's ``prove`` phase); the parameters and the optimizer state, which the first step's forward and
  backward only read, are summed on a thread meanwhile and the proof completed before its optimizer step writes them;
* around a live layout change inside a fit (``strategy.reconfigure``): the state after it equals the state before;
* every ``consistency_every_n_steps`` optimizer steps (0: only at the moments above);
* whenever Lightning saves a checkpoint (and a live handoff is captured): the proof is saved with it, under
  :data:`~lightning_emig.consistency.PROOF_KEY`. A handoff's is begun in its save hooks and completed by
  :func:`~lightning_emig.consistency.settle_handoff_proof` (a drain sums it during the transfer); a handoff whose
  old world broke first carries none.

A failed proof raises :class:`~lightning_emig.consistency.InconsistentStateError` on every rank: the fit stops loudly
instead of training on. Under ``lightning-emig-run`` the job then rolls back to the newest complete checkpoint whose
state proves (:mod:`lightning_emig.strategy.elastic_fit`); elsewhere the error ends ``fit``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_emig.change.boundary import at_step_boundary
from lightning_emig.consistency import (
    PROOF_KEY,
    InconsistentStateError,
    ProofInFlight,
    StateProof,
    begin_proof,
    check_same_state,
)
from lightning_emig.membership.handoff import LIVE_CHECKPOINT
from lightning_emig.migration.state import training_state

log = logging.getLogger(__name__)

HANDOFF_SAVE_KEY = "lightning_emig_live_handoff"
"""Set in what a live handoff's save hooks see as the checkpoint: its proof is begun there and completed by
:func:`~lightning_emig.consistency.settle_handoff_proof` once the state has moved (the old state is only read until
then)."""


def prove(trainer: pl.Trainer, when: str) -> StateProof:
    """The proof of the state the fit holds now (a collective of the fit's world)."""
    return begin_proof_of(trainer, when).result()


def begin_proof_of(trainer: pl.Trainer, when: str, read_only: Callable[[str], bool] | None = None) -> ProofInFlight:
    """:func:`prove` begun (:func:`~lightning_emig.consistency.begin_proof`): the tensors ``read_only`` accepts are
    summed on a thread until ``result()``."""
    strategy: Any = trainer.strategy
    streams = strategy.data_streams
    return begin_proof(
        training_state(trainer.lightning_module, trainer.optimizers[0] if trainer.optimizers else None),
        strategy.layout, rank=trainer.global_rank, step=trainer.global_step,
        data_offset=streams[0].offset if streams else -1, generation=strategy.generation,
        device=strategy.root_device, when=when, read_only=read_only, timeout_s=strategy.timeout.total_seconds(),
    )


def _until_the_optimizer_step(key: str) -> bool:
    """Parameters and optimizer state: the forward and backward only read them, the optimizer step writes them. A
    buffer the forward may write (BatchNorm's running statistics)."""
    return not key.startswith("buffer/")


def _all_tensors(key: str) -> bool:
    return True


class ConsistencyGuard(Callback):
    """See the module docstring; ``every_n_steps`` comes from the strategy's ``consistency_every_n_steps``."""

    def __init__(self) -> None:
        self._expected: tuple[StateProof, str] | None = None
        self._at_start: tuple[ProofInFlight, tuple[StateProof, str] | None] | None = None
        self._handed: tuple[dict[str, Any], ProofInFlight] | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._expected = None  # a proof loaded by an earlier fit that never started training is no one's now
        self._handed = None  # an earlier fit's handoff: its proof was completed or dropped

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(PROOF_KEY)
        if isinstance(saved, ProofInFlight):  # a handoff whose old world broke before its proof was complete
            saved.abandon()
            checkpoint.pop(PROOF_KEY)
            saved = None
        if saved is not None:
            self._expected = StateProof.from_dict(saved), _source(trainer)

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        self._settle_the_start(trainer)
        if checkpoint.get(HANDOFF_SAVE_KEY):
            # The fit trains no more: nothing writes the state while it moves; the digest is summed meanwhile.
            in_flight = begin_proof_of(trainer, "as the live state was handed over", read_only=_all_tensors)
            checkpoint[PROOF_KEY] = in_flight
            self._handed = checkpoint, in_flight
            return
        if _handing_over(trainer):
            # A save Lightning asks for after the handoff was captured: the strategy skips it, and a drain may already
            # have released the old optimizer's storage. The handoff's own proof was taken before (run_save_hooks).
            return
        checkpoint[PROOF_KEY] = prove(trainer, "as a checkpoint was saved").as_dict()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        expected, self._expected = self._expected, None
        if expected is None and trainer.world_size == 1:
            return  # no peer, no replica, nothing to compare with: the proof would check nothing
        started = time.perf_counter()
        # The digest of parameters and optimizer state is summed while the first step's forward and backward run, and
        # checked before its optimizer step writes them (on_before_optimizer_step): the state is never trained on
        # before it is proven, and the change's pause does not wait for the digest.
        self._at_start = begin_proof_of(trainer, "when the fit started", read_only=_until_the_optimizer_step), expected
        # Before the first step, after the state arrived: a change's own phase, not its first step's excess.
        set_apart = getattr(trainer.strategy, "set_apart_from_first_step", None)
        if set_apart is not None:
            set_apart("prove", time.perf_counter() - started)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        self._settle_the_start(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        every = getattr(trainer.strategy, "consistency_every_n_steps", 0)
        if every and trainer.global_step % every == 0 and at_step_boundary(trainer) and not _handing_over(trainer):
            prove(trainer, "at the periodic check")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._settle_the_start(trainer)  # a fit that ran no optimizer step (it resumed at max_steps)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # No collective now (the world may be broken): the threads stop reading the state before anyone frees it, and
        # a handoff's proof that cannot be completed is dropped (its recovery has nothing to compare with).
        if self._at_start is not None:
            self._at_start[0].abandon()
            self._at_start = None
        if self._handed is not None:
            checkpoint, in_flight = self._handed
            in_flight.abandon()
            if checkpoint.get(PROOF_KEY) is in_flight:
                checkpoint.pop(PROOF_KEY)
            self._handed = None

    def _settle_the_start(self, trainer: pl.Trainer) -> None:
        """Complete the proof begun when the fit started (every rank at the same hook) and compare it."""
        if self._at_start is None:
            return
        in_flight, expected = self._at_start
        self._at_start = None
        try:
            proof = in_flight.result()  # replicas that differ fail here, before any comparison with the saved proof
            if expected is not None:
                check_same_state(expected[0], proof, what=expected[1])
        except InconsistentStateError as error:
            # Whatever the proof found, the restore of this checkpoint failed it: the rollback never takes it again.
            if trainer.ckpt_path not in (None, LIVE_CHECKPOINT):
                error.checkpoint = str(trainer.ckpt_path)
            raise
        if expected is not None:
            note = getattr(trainer.strategy, "note_state_proven", None)
            if note is not None:  # the change's event says what was proven
                note(proof.digest)
            if trainer.global_rank == 0:
                log.info("state at step %d proven equal to %s: digest %#018x", proof.step, expected[1], proof.digest)


def _handing_over(trainer: pl.Trainer) -> bool:
    """A live handoff is pending (set alike on every rank): this fit trains no more."""
    return getattr(trainer.strategy, "pending_handoff", None) is not None


def _source(trainer: pl.Trainer) -> str:
    if trainer.ckpt_path == LIVE_CHECKPOINT:
        return "the live change (the state handed over)"
    return "the checkpoint's restore"
