"""Which samples each data-parallel rank reads, keyed on one number: the global sample offset.

The sampler is pure (no ``torch.distributed``, no process state beyond one integer) and defines the data order
of a run independently of how many ranks read it. Invariants:

* epoch ``e`` is ``torch.randperm(num_samples)`` drawn from a generator seeded with ``mix_seed(seed, e)``
  (``0 .. num_samples - 1`` in order with ``shuffle=False``), or with ``seed + e`` under ``torch_order=True``: the
  order torch's ``DistributedSampler`` draws, so a user's loader that Lightning gave one keeps Lightning's order
  (each optimizer step takes the same samples as under Lightning's own strategies);
* an epoch has ``steps_per_epoch = num_samples // global_batch_size`` optimizer steps; the
  ``num_samples % global_batch_size`` samples at the end of each epoch's permutation are *dropped* (a
  different set each epoch), so a global batch never spans two epochs;
* the only position state is ``offset``: samples consumed by completed optimizer steps, across epochs, always
  a multiple of ``global_batch_size``. The global batch starting at ``offset`` is
  ``permutation(offset // samples_per_epoch)[offset % samples_per_epoch :][:global_batch_size]``;
* data-parallel rank ``r`` of ``dp`` reads the contiguous slice ``[r*G/dp, (r+1)*G/dp)`` of that global batch
  (under ``torch_order``: positions ``r, r + dp, r + 2 dp, ...``, as ``DistributedSampler`` deals them, so each
  micro-batch holds the samples it holds under Lightning), split in order into micro-batches. Hence for ANY dp
  degree the ranks' micro-batches of one step partition that step's global batch exactly, and changing dp at a step
  boundary loses and repeats nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_emig.data.batching import BatchPlan

_MASK64 = (1 << 64) - 1
_STATE_KEYS = ("offset", "seed", "num_samples", "global_batch_size")


class SamplerStateError(ValueError):
    """A sampler position or saved state that does not fit this sampler."""


def mix_seed(*values: int) -> int:
    """A 63-bit seed from several integers (splitmix64 chaining): nearby inputs give unrelated seeds.

    Stable across Python and torch versions (no ``hash()``), and small enough for ``Generator.manual_seed``.
    """
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = ((state ^ (value & _MASK64)) + 0x9E3779B97F4A7C15) & _MASK64
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state >> 1


class GlobalOffsetSampler:
    """Seeded per-epoch permutations, cut into global batches, addressed by global sample offset.

    Example::

        sampler = GlobalOffsetSampler(num_samples=1000, global_batch_size=32, seed=0)
        micro_batches = sampler.indices_for_step(sampler.offset, dp_degree=4, dp_rank=1, micro_batch_size=4)
        # ... after the optimizer step:
        sampler.advance()
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int = 0, *, shuffle: bool = True,
                 torch_order: bool = False) -> None:
        for name, value in (("num_samples", num_samples), ("global_batch_size", global_batch_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SamplerStateError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise SamplerStateError(f"seed must be an int, got {seed!r}")
        if num_samples < global_batch_size:
            raise SamplerStateError(
                f"num_samples {num_samples} is smaller than one global batch {global_batch_size}: an epoch"
                " would have no steps; use a larger dataset or a smaller global_batch_size"
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        """False: every epoch is ``0 .. num_samples - 1`` in order (a ``DataLoader`` without ``shuffle``)."""
        self.torch_order = torch_order
        """Epoch ``e``'s permutation is seeded with ``seed + e``, as ``DistributedSampler`` seeds it."""
        self.steps_per_epoch = num_samples // global_batch_size
        self._offset = 0
        # One epoch's permutation is reused by every step of that epoch.
        self._cached_epoch: int | None = None
        self._cached_permutation: torch.Tensor | None = None

    # ------------------------------------------------------------------ position
    @property
    def offset(self) -> int:
        """Samples consumed by completed optimizer steps since the start of the run."""
        return self._offset

    @property
    def samples_per_epoch(self) -> int:
        """Samples actually used per epoch (``num_samples`` minus the dropped tail)."""
        return self.steps_per_epoch * self.global_batch_size

    @property
    def dropped_per_epoch(self) -> int:
        """Samples at the end of each epoch's permutation that fill no global batch and are skipped."""
        return self.num_samples - self.samples_per_epoch

    @property
    def step(self) -> int:
        """Completed optimizer steps (the global step the committed offset corresponds to)."""
        return self._offset // self.global_batch_size

    def epoch_of(self, offset: int | None = None) -> int:
        """Epoch that the global batch starting at ``offset`` (default: the current one) belongs to."""
        return self._check_offset(self._offset if offset is None else offset) // self.samples_per_epoch

    def advance(self, steps: int = 1) -> int:
        """Record ``steps`` completed optimizer steps; returns the new offset."""
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise SamplerStateError(f"steps must be a non-negative int, got {steps!r}")
        self._offset += steps * self.global_batch_size
        return self._offset

    def seek(self, offset: int) -> None:
        """Set the position directly, e.g. to ``step * global_batch_size`` from a restored step counter."""
        self._offset = self._check_offset(offset)

    # ------------------------------------------------------------------ indices
    def permutation(self, epoch: int) -> torch.Tensor:
        """The full sample order of ``epoch`` (including the dropped tail); do not modify it."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise SamplerStateError(f"epoch must be a non-negative int, got {epoch!r}")
        if self._cached_epoch != epoch:
            if self.shuffle:
                seed = self.seed + epoch if self.torch_order else mix_seed(self.seed, epoch)
                generator = torch.Generator().manual_seed(seed)
                self._cached_permutation = torch.randperm(self.num_samples, generator=generator)
            else:
                self._cached_permutation = torch.arange(self.num_samples)
            self._cached_epoch = epoch
        assert self._cached_permutation is not None
        return self._cached_permutation

    def global_batch(self, offset: int) -> list[int]:
        """The ``global_batch_size`` dataset indices of the optimizer step starting at ``offset``."""
        offset = self._check_offset(offset)
        epoch, within = divmod(offset, self.samples_per_epoch)
        return self.permutation(epoch)[within : within + self.global_batch_size].tolist()

    def indices_for_step(
        self, offset: int, dp_degree: int, dp_rank: int, micro_batch_size: int
    ) -> list[list[int]]:
        """The micro-batches, in accumulation order, that ``dp_rank`` processes for the step at ``offset``.

        Raises:
            BatchPlanError: if ``global_batch_size`` is not ``micro_batch_size x accumulation x dp_degree``.
            SamplerStateError: if ``dp_rank`` is outside ``[0, dp_degree)`` or ``offset`` is not a step start.
        """
        plan = BatchPlan(self.global_batch_size, micro_batch_size, dp_degree)
        if not isinstance(dp_rank, int) or isinstance(dp_rank, bool) or not 0 <= dp_rank < dp_degree:
            raise SamplerStateError(f"dp_rank must be an int in [0, {dp_degree}), got {dp_rank!r}")
        share = plan.samples_per_dp_rank
        batch = self.global_batch(offset)
        # DistributedSampler deals its order out round-robin (rank r reads r, r + dp, ...): the same micro-batches.
        mine = batch[dp_rank::dp_degree] if self.torch_order else batch[dp_rank * share : (dp_rank + 1) * share]
        return [mine[k : k + micro_batch_size] for k in range(0, share, micro_batch_size)]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, int]:
        """Position plus the arguments that define the order, so a mismatched resume is caught."""
        return {
            "offset": self._offset,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the offset; refuses state saved for another data order (dataset size, batch or seed)."""
        missing = [k for k in _STATE_KEYS if k not in state]
        unknown = sorted(set(state) - set(_STATE_KEYS))
        if missing or unknown:
            raise SamplerStateError(f"sampler state has missing keys {missing} / unknown keys {unknown}")
        for key in ("num_samples", "global_batch_size", "seed"):
            if state[key] != getattr(self, key):
                raise SamplerStateError(
                    f"sampler state was saved with {key}={state[key]} but this sampler has {key}="
                    f"{getattr(self, key)}: resuming would change which samples form each step. Construct"
                    f" GlobalOffsetSampler(num_samples={state['num_samples']},"
                    f" global_batch_size={state['global_batch_size']}, seed={state['seed']}) to resume this run"
                )
        self._offset = self._check_offset(state["offset"])

    def _check_offset(self, offset: int) -> int:
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise SamplerStateError(f"offset must be a non-negative int, got {offset!r}")
        if offset % self.global_batch_size:
            raise SamplerStateError(
                f"offset {offset} is not a step boundary: it must be a multiple of the global batch"
                f" {self.global_batch_size} (offsets count samples of completed optimizer steps)"
            )
        return offset

    def __repr__(self) -> str:
        return (
            f"GlobalOffsetSampler(num_samples={self.num_samples}, global_batch_size={self.global_batch_size},"
            f" seed={self.seed}, offset={self._offset})"
        )
