"""Lightning adapter: the strategy that owns layout, mesh, batch plan, data position and checkpoints."""

from lightning_emig.strategy.elastic import ElasticMigrationStrategy
from lightning_emig.strategy.schedule import LayoutSchedule

__all__ = ["ElasticMigrationStrategy", "LayoutSchedule"]
