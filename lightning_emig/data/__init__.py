"""Data that survives data-parallel changes: no sample is lost or seen twice when dp changes at a step boundary.

* :mod:`~lightning_emig.data.batching` -- ``BatchPlan``: global batch = micro x accumulation x dp (the only place
  this arithmetic lives);
* :mod:`~lightning_emig.data.sampler` -- ``GlobalOffsetSampler``: the data order, addressed by one global sample
  offset, sliced per dp rank for any dp degree;
* :mod:`~lightning_emig.data.stream` -- ``MicroBatchStream``: one rank's micro-batches from the committed offset;
* :mod:`~lightning_emig.data.workers` -- ``WorkerSettings`` / ``MicroBatchReader``: a stream's micro-batches read by
  torch's ``DataLoader``, in order, in worker processes or in this one (a user's loader's settings);
* :mod:`~lightning_emig.data.datasets` / :mod:`~lightning_emig.data.corpus` -- index-deterministic datasets and an
  offline byte corpus (the Python standard library's sources).

Nothing here touches ``torch.distributed``: the caller says which dp rank of which dp degree this process is.
"""

from lightning_emig.data.batching import BatchPlan, BatchPlanError, feasible_dp_degrees
from lightning_emig.data.corpus import CorpusError, default_cache_dir, ensure_stdlib_corpus, load_byte_corpus
from lightning_emig.data.datasets import ByteCorpusDataset, SyntheticDataset
from lightning_emig.data.sampler import GlobalOffsetSampler, SamplerStateError, mix_seed
from lightning_emig.data.stream import MicroBatchStream, StaleIteratorError
from lightning_emig.data.workers import WorkerSettings

__all__ = [
    "BatchPlan",
    "BatchPlanError",
    "ByteCorpusDataset",
    "CorpusError",
    "GlobalOffsetSampler",
    "MicroBatchStream",
    "SamplerStateError",
    "StaleIteratorError",
    "SyntheticDataset",
    "WorkerSettings",
    "default_cache_dir",
    "ensure_stdlib_corpus",
    "feasible_dp_degrees",
    "load_byte_corpus",
    "mix_seed",
]
