"""Direct model-state migration: shard geometry and the point-to-point transfer planner.

``geometry`` says which global box every rank of a layout holds; ``planner`` turns the old and new geometry plus
the identity map (which process keeps which rank) into each process's own copies, sends and receives.
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
    stage_layer_ranges,
    stage_of,
)
from lightning_emig.migration.planner import (
    IdentityMap,
    LostFragment,
    PlanError,
    PlanOptions,
    ProcessInfo,
    RankAssignment,
    RankPlan,
    StateLostError,
    TensorMigration,
    Transfer,
    assign_new_ranks,
    plan_all,
    plan_for_rank,
)

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
    "RankAssignment",
    "RankPlan",
    "ShardBox",
    "Source",
    "StateLostError",
    "TensorMigration",
    "TensorSharding",
    "Transfer",
    "assign_new_ranks",
    "coordinate_to_rank",
    "normalize_placement",
    "plan_all",
    "plan_for_rank",
    "rank_to_coordinate",
    "shard_boxes",
    "shard_holdings",
    "stage_layer_ranges",
    "stage_of",
]
