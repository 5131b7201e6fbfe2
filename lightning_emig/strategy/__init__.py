"""Lightning adapter: the strategy that owns layout, mesh, batch plan, data position and checkpoints."""

from lightning_emig.strategy.elastic import ElasticMigrationStrategy

__all__ = ["ElasticMigrationStrategy"]
