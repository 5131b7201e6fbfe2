"""Batch arithmetic: the one place where global batch = micro batch x accumulation x data parallel.

Invariants of a :class:`BatchPlan` (checked once, in ``__post_init__``):

* every size is a positive ``int``;
* ``global_batch_size == micro_batch_size * grad_accumulation * dp_degree`` exactly, so the global batch
  (and with it the data order and the loss curve) does not depend on how many data-parallel ranks there are.

When the data-parallel degree changes, only ``grad_accumulation`` changes; the global batch never does.
"""

from __future__ import annotations

from dataclasses import dataclass


class BatchPlanError(ValueError):
    """Batch sizes that cannot be combined into one global batch."""


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """How one optimizer step's global batch is split over data-parallel ranks and micro-batches.

    Example: ``BatchPlan(32, 4, 4).describe(256)`` is
    ``"global batch 32 = micro 4 x accum 2 x dp 4; 8192 tokens/step"``.
    """

    global_batch_size: int
    """Samples per optimizer step, summed over all data-parallel ranks; constant for the whole run."""
    micro_batch_size: int
    """Samples in one forward/backward pass on one rank."""
    dp_degree: int = 1
    """Number of data-parallel ranks (replicas x shards) that see different samples."""

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "micro_batch_size", "dp_degree"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise BatchPlanError(f"{name} must be an int, got {value!r}")
            if value <= 0:
                raise BatchPlanError(f"{name} must be positive, got {value}")
        per_pass = self.micro_batch_size * self.dp_degree
        if self.global_batch_size % per_pass:
            raise BatchPlanError(
                f"global batch {self.global_batch_size} is not divisible by micro batch {self.micro_batch_size}"
                f" x dp {self.dp_degree} = {per_pass}: change global_batch_size to a multiple of {per_pass}"
                f" (e.g. {_nearest_multiple(self.global_batch_size, per_pass)}), or {self._dp_hint()}"
            )

    def _dp_hint(self) -> str:
        degrees = feasible_dp_degrees(self.global_batch_size, self.micro_batch_size)
        if not degrees:
            return f"choose a micro_batch_size that divides {self.global_batch_size}"
        return f"with micro batch {self.micro_batch_size} choose dp_degree in {degrees}"

    @property
    def grad_accumulation(self) -> int:
        """Micro-batches each rank runs before one optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_degree)

    @property
    def samples_per_dp_rank(self) -> int:
        """Samples each data-parallel rank contributes to one optimizer step."""
        return self.global_batch_size // self.dp_degree

    def tokens_per_step(self, seq_len: int) -> int:
        """Tokens (predicted positions) consumed by one optimizer step over all ranks."""
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
            raise BatchPlanError(f"seq_len must be a positive int, got {seq_len!r}")
        return self.global_batch_size * seq_len

    def describe(self, seq_len: int | None = None) -> str:
        """One line for logs; tokens per step are included when ``seq_len`` is given."""
        line = (
            f"global batch {self.global_batch_size} = micro {self.micro_batch_size}"
            f" x accum {self.grad_accumulation} x dp {self.dp_degree}"
        )
        if seq_len is not None:
            line += f"; {self.tokens_per_step(seq_len)} tokens/step"
        return line

    def with_dp_degree(self, dp_degree: int) -> BatchPlan:
        """The same global and micro batch on another data-parallel degree (validated)."""
        return BatchPlan(self.global_batch_size, self.micro_batch_size, dp_degree)


def feasible_dp_degrees(global_batch_size: int, micro_batch_size: int) -> list[int]:
    """Data-parallel degrees that keep ``global_batch_size`` exact with this micro batch, ascending.

    The elastic layout picker must choose a dp degree from this list (or a smaller micro batch).
    """
    if global_batch_size <= 0 or micro_batch_size <= 0 or global_batch_size % micro_batch_size:
        return []
    micro_batches = global_batch_size // micro_batch_size
    return [d for d in range(1, micro_batches + 1) if micro_batches % d == 0]


def _nearest_multiple(value: int, factor: int) -> int:
    return max(factor, round(value / factor) * factor)
