"""Direct model-state migration, from pure planning to the wire.

``boxes`` and ``geometry`` say which global box every rank of a layout holds (``stages`` which pipeline stage
owns a parameter); ``planner`` turns the old and new geometry plus the identity map (which process keeps which
rank) into each process's own copies, sends and receives; ``rank_order`` chooses how a new layout numbers its
processes so the most state stays in place; ``state`` names the training state as migratable
tensors; ``transfer`` runs a plan in bucketed point-to-point rounds; ``engine.migrate`` ties them together.
"""

from lightning_emig.migration.geometry import (
    GeometryError,
    Holding,
    LocalPiece,
    PlacementSpec,
    ShardBox,
    Source,
    TensorSharding,
    coordinate_to_rank,
    normalize_placement,
    rank_to_coordinate,
    shard_boxes,
    shard_holdings,
)
from lightning_emig.migration.identity import IdentityMap, PlanError, ProcessInfo
from lightning_emig.migration.planner import (
    LostFragment,
    PlanOptions,
    RankPlan,
    StateLostError,
    TensorMigration,
    Transfer,
    plan_all,
    plan_for_rank,
)
from lightning_emig.migration.stages import StageOwner, StageSplit, split_stages, stage_holding

__all__ = [
    "GeometryError",
    "Holding",
    "IdentityMap",
    "LocalPiece",
    "LostFragment",
    "PlacementSpec",
    "PlanError",
    "PlanOptions",
    "ProcessInfo",
    "RankPlan",
    "ShardBox",
    "StageOwner",
    "StageSplit",
    "Source",
    "StateLostError",
    "TensorMigration",
    "TensorSharding",
    "Transfer",
    "coordinate_to_rank",
    "normalize_placement",
    "plan_all",
    "plan_for_rank",
    "rank_to_coordinate",
    "shard_boxes",
    "shard_holdings",
    "split_stages",
    "stage_holding",
]
