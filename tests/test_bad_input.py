"""Input that cannot work is refused at start, saying what to change; nothing is trained or overwritten.

(A global batch that no data-parallel degree of the allowed worlds divides: ``tests/test_elastic_fit.py``; a
DataLoader that cannot follow a change: ``tests/test_user_module.py``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn


@pytest.mark.parametrize("nnodes", ["0:2", "3:2", "0"])
def test_nnodes_that_cannot_hold_a_job_are_refused_with_an_example(nnodes: str, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    from lightning_emig.launcher.control_store import ENV_RDZV_ENDPOINT
    from lightning_emig.run import check_arguments

    monkeypatch.setenv(ENV_RDZV_ENDPOINT, "")  # check_arguments tells the agent (this process) the endpoint

    with pytest.raises(SystemExit, match=rf"--nnodes={nnodes} cannot work: MIN must be at least 1 .* MAX at least "
                                         "MIN, e.g. --nnodes=1:4"):
        check_arguments([f"--nnodes={nnodes}", "--nproc-per-node=1", "train.py"])
    check_arguments(["--nnodes=1:4", "--nproc-per-node=1", "train.py"])  # a workable one passes


def test_a_corpus_cache_directory_that_cannot_be_created_names_the_setting(tmp_path: Path) -> None:
    from lightning_emig.data.corpus import CorpusError, ensure_stdlib_corpus

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(CorpusError, match=r"cannot write the corpus cache in .*a-file/cache .*: set data.cache_dir "
                                          r"\(or \$LIGHTNING_EMIG_CACHE\)"):
        ensure_stdlib_corpus(cache_dir=blocker / "cache", max_bytes=64)
    assert blocker.read_text() == "not a directory"


class _Net(nn.Module):
    def __init__(self, width: int, extra: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.out = nn.Linear(width, 2)
        if extra:
            self.head = nn.Linear(2, 2)


def _save_sharded(module: nn.Module, path: Path) -> None:
    """As Lightning's sharded checkpoints hold it: the module's state_dict under ``state_dict``."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"state_dict": module.state_dict()}, checkpoint_id=str(path))


def test_a_checkpoint_written_by_another_model_is_refused_before_anything_loads(tmp_path: Path) -> None:
    from lightning_emig.strategy.resume import CheckpointMismatchError, check_checkpoint_matches

    path = tmp_path / "step000010.ckpt"
    _save_sharded(_Net(8), path)
    written = {p.name: p.read_bytes() for p in path.iterdir()}
    check_checkpoint_matches(path, _Net(8))  # its own model passes
    with pytest.raises(CheckpointMismatchError, match=r"written by another model \(3 tensor\(s\) differ: "
                                                      r"inp.weight: saved \[8, 4\], this model \[16, 4\];"):
        check_checkpoint_matches(path, _Net(16))
    with pytest.raises(CheckpointMismatchError, match=r"head.weight: not in the checkpoint"):
        check_checkpoint_matches(path, _Net(8, extra=True))
    lenient = _Net(8, extra=True)
    lenient.strict_loading = False  # as a LightningModule may set it: only shared tensors must agree
    check_checkpoint_matches(path, lenient)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == written  # nothing overwritten
