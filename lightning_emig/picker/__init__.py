"""The layout picker: which hybrid layout to run on the devices the job has now, and why.

Pure planning: nothing here but ``calibrate`` (a measurement tool, imported by name only) touches
``torch.distributed``, so the choice is tested exhaustively without processes.
``constraints`` holds what the user allows, ``shapes`` the model's parameters as plain shapes, ``memory`` the peak
bytes per device, ``throughput`` the step time under a :class:`HardwareProfile`, ``migration_cost`` the bytes a
change moves (through the migration planner's geometry), ``candidates`` one layout's checks and estimates,
``search`` the choice and ``report`` its explanation and table.

Invariants:

* deterministic: the same inputs give the same :class:`PickResult` on every rank;
* a chosen layout divides the model, keeps ``global batch == micro x accumulation x dp`` exactly (the global batch
  never changes), meets the constraints and fits the usable device memory;
* a device is left idle only when every layout using it is slower (beyond ``tie_tolerance``) or none can run,
  and the explanation says which;
* every rejected candidate carries the reason; an explicit ``table`` entry overrides the search;
* ``pp > 1`` is considered only with ``allow_pp`` (the model must be one that can be cut into stages), with the
  stages of the project's one split rule, the schedule's bubble and in-flight activations (``pipeline_schedule``).
"""

from lightning_emig.picker.candidates import Candidate
from lightning_emig.picker.constraints import PickerConstraints, PickerError
from lightning_emig.picker.memory import MemoryEstimate, estimate_memory
from lightning_emig.picker.migration_cost import estimate_migration_bytes
from lightning_emig.picker.search import NoFeasibleLayoutError, PickResult, pick_layout
from lightning_emig.picker.throughput import (
    HardwareProfile,
    StepEstimate,
    estimate_step_time,
    load_profile,
    save_profile,
)

__all__ = [
    "Candidate",
    "HardwareProfile",
    "MemoryEstimate",
    "NoFeasibleLayoutError",
    "PickResult",
    "PickerConstraints",
    "PickerError",
    "StepEstimate",
    "estimate_memory",
    "estimate_migration_bytes",
    "estimate_step_time",
    "load_profile",
    "pick_layout",
    "save_profile",
]
