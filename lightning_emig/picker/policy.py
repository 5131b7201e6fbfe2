"""The picker as training asks it: one layout for each world the job reaches, from the ``elastic.picker`` settings.

Training runs every process (a device left idle would need a worker outside the mesh: not built yet), keeps the
configured micro batch (the data stream's unit) and its precision and activation checkpointing, so
:meth:`LayoutPicker.pick` fixes those and searches the rest:
degrees, node boundaries, memory, estimated step time, and migration bytes from the layout the state is in now.

Every rank of a generation must run the same layout: the strategy lets the new generation's rank 0 decide and sends
its answer to every rank (see ``ElasticMigrationStrategy.setup_environment``); a drain or a rebuild decides among the
survivors, who all know the old layout, and the next fit keeps that decision.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_emig.picker.constraints import PickerConstraints, PickerError
from lightning_emig.picker.search import PickResult, pick_layout
from lightning_emig.picker.throughput import HardwareProfile, load_profile

if TYPE_CHECKING:
    from lightning_emig.layout import HybridLayout
    from lightning_emig.models.llama import LlamaConfig

#: Keys of ``elastic.picker`` that are not constraints.
POLICY_KEYS = ("enabled", "profile")


@dataclass(frozen=True, slots=True)
class LayoutPicker:
    """The model's shapes, the constraints and the hardware; :meth:`pick` answers for one world."""

    model: LlamaConfig
    seq_len: int
    constraints: PickerConstraints = field(default_factory=PickerConstraints)
    profile: HardwareProfile = field(default_factory=HardwareProfile)

    def pick(self, world: int, *, global_batch_size: int, micro_batch_size: int,
             current: HybridLayout | None = None) -> PickResult:
        """The layout for ``world`` processes, all of them used, at ``micro_batch_size`` (raises
        :class:`~lightning_emig.picker.NoFeasibleLayoutError` naming why each candidate was rejected)."""
        constraints = dataclasses.replace(self.constraints, micro_batch_sizes=(micro_batch_size,),
                                          idle_devices_allowed=False)
        return pick_layout(world, self.model, global_batch_size=global_batch_size, seq_len=self.seq_len,
                           constraints=constraints, profile=self.profile, current=current)

    def check_runs_as(self, *, pipeline_schedule: str, defer_grad_sync: str) -> None:
        """Refuse a strategy that would run otherwise than this picker plans for (its estimates would be wrong)."""
        if self.constraints.pipeline_schedule != pipeline_schedule:
            raise ValueError(f"the layout picker plans for the {self.constraints.pipeline_schedule!r} schedule but "
                             f"the strategy runs {pipeline_schedule!r}: give both the same pipeline_schedule")
        if self.constraints.defer_grad_sync != defer_grad_sync:
            raise ValueError(f"the layout picker plans for defer_grad_sync={self.constraints.defer_grad_sync!r} but "
                             f"the strategy runs {defer_grad_sync!r}: give both the same defer_grad_sync")

    def may_stage(self) -> bool:
        """A layout it picks may have pipeline stages."""
        return self.constraints.allow_pp

    @classmethod
    def from_section(cls, section: Mapping[str, Any], *, model: LlamaConfig, seq_len: int,
                     mixed_precision: str = "fp32", activation_checkpointing: bool = False,
                     local_world_size: int = 1, pipeline_schedule: str = "gpipe",
                     defer_grad_sync: str = "replicas") -> LayoutPicker | None:
        """From the ``elastic.picker`` section (a plain mapping); None when it is not enabled. A setting that cannot
        work is a :class:`PickerError` naming it, raised here, at start. ``local_world_size``: processes per node,
        the default ``devices_per_node``."""
        if not section.get("enabled", False):
            return None
        values = {k: v for k, v in section.items() if k not in POLICY_KEYS}
        if values.get("devices_per_node") is None:
            values["devices_per_node"] = local_world_size
        # What training runs with (``model.compute_dtype``, ``model.activation_checkpointing``), not a search.
        values["mixed_precision"] = mixed_precision
        values["activation_checkpointing"] = activation_checkpointing
        values["pipeline_schedule"] = pipeline_schedule
        values["defer_grad_sync"] = defer_grad_sync
        constraints = PickerConstraints.from_mapping(values)
        constraints.check_model(model, seq_len=seq_len)
        profile_path = section.get("profile")
        try:
            profile = load_profile(profile_path) if profile_path else HardwareProfile()
        except (OSError, ValueError) as error:
            raise PickerError(f"elastic.picker.profile: {error}") from None
        return cls(model=model, seq_len=seq_len, constraints=constraints, profile=profile)
