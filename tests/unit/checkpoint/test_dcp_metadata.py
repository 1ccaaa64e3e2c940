"""dcp/.metadata of a distributed checkpoint is a pickle that torch loads with pickle.load: a
checkpoint from someone else must not run code on resume. Only what torch.distributed.checkpoint
writes there is unpickled (ranks.check_metadata), before torch reads it."""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch

from retrograd.checkpoint.layout import CheckpointError
from retrograd.checkpoint.ranks import DCP_DIR, METADATA, check_metadata, restore_state


@pytest.fixture
def saved(tmp_path):
    """A real dcp/ folder as the loops write it: trained tensors and optimizer slots."""
    import torch.distributed.checkpoint as dcp

    tensors = {
        "trained/a": torch.randn(3, 4),
        "trained/b": torch.randn(2, dtype=torch.bfloat16),
        "optimizer/a/exp_avg": torch.zeros(3, 4),
        "optimizer/a/step": torch.tensor(3.0),
    }
    folder = tmp_path / "ckpt.state" / DCP_DIR
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp warns that no process group is set up
        dcp.save(tensors, checkpoint_id=str(folder))
    return folder


class _Run:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_the_metadata_torch_writes_passes(saved):
    check_metadata(saved / METADATA, "ckpt")


@pytest.mark.parametrize(
    "payload",
    [
        lambda marker: pickle.dumps(_Run(marker)),
        lambda marker: pickle.dumps(_Run(marker), protocol=0),
        # a real class's module, a name that is not one of its classes
        lambda marker: (
            b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x05torch\x8c\x04load\x93."
        ),
        lambda marker: b"not a pickle",
    ],
)
def test_a_hostile_metadata_is_refused_before_torch_unpickles_it(saved, tmp_path, payload):
    marker = tmp_path / "ran"
    (saved / METADATA).write_bytes(payload(marker))
    with pytest.raises(CheckpointError, match=r"dcp/.metadata is not a checkpoint's metadata"):
        restore_state(None, str(saved.parent), named=[], optimizer=None)  # type: ignore[arg-type]
    assert not marker.exists()


def test_a_metadata_that_is_a_link_is_refused(saved, tmp_path):
    target = tmp_path / "elsewhere"
    (saved / METADATA).rename(target)
    (saved / METADATA).symlink_to(target)
    with pytest.raises(CheckpointError, match=r"dcp/.metadata is not a file"):
        check_metadata(saved / METADATA, "ckpt")
