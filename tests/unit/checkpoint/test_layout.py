"""Which checkpoint resume picks, and what a listing says about each."""

from __future__ import annotations

import pytest

from retrograd.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    save_checkpoint,
    step_id,
)
from retrograd.checkpoint.layout import check_id
from tests.unit.checkpoint.sample_state import make_state


def test_latest_is_the_highest_complete_step_else_best(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None
    save_checkpoint(tmp_path, "best", make_state(50))
    assert latest_checkpoint(tmp_path) == tmp_path / "best.state"
    for step in (9, 100, 10):  # written out of order: the step, not the time, decides
        save_checkpoint(tmp_path, step_id(step), make_state(step))
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000000000100.state"
    (tmp_path / "step-000000000100.state" / "manifest.msgpack").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000000000010.state"


def test_listing_newest_first_with_sizes_and_exports(tmp_path):
    save_checkpoint(tmp_path, "best", make_state(7))
    save_checkpoint(tmp_path, step_id(5), make_state(5), export_adapter=False)
    save_checkpoint(tmp_path, step_id(12), make_state(12))
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "step-1.state").mkdir()  # not an id we write
    infos = list_checkpoints(tmp_path)
    assert [(c.id, c.kind, c.global_step) for c in infos] == [
        ("step-000000000012", "step", 12),
        ("step-000000000005", "step", 5),
        ("best", "best", 7),
    ]
    top = infos[0]
    assert top.complete and top.path == tmp_path / "step-000000000012.state"
    assert top.adapter == tmp_path / "step-000000000012.gguf" and infos[1].adapter is None
    on_disk = sum(f.stat().st_size for f in top.path.rglob("*") if f.is_file())
    assert top.bytes == on_disk > 1000
    assert top.written_at is not None and top.written_at >= infos[2].written_at


@pytest.mark.parametrize(
    ("manifest", "step", "written_at", "complete"),
    [
        (b"\xc1 not msgpack", 7, None, False),  # unreadable: listed as incomplete
        ({"global_step": "7", "written_at": "noon"}, 7, None, True),  # wrong types: ignored
        ({"global_step": True, "written_at": float("nan")}, 7, None, True),
        ({"global_step": -3, "written_at": 1e300}, 7, None, True),  # 1e300 s overflowed iso()
        ({"global_step": 9, "written_at": 1.7e9}, 9, 1.7e9, True),
    ],
)
def test_one_odd_checkpoint_does_not_fail_the_listing(
    tmp_path, manifest, step, written_at, complete
):
    """The run server lists every run's checkpoints from these: a damaged or crafted manifest
    is shown as what can be read of it, and the others are listed as before."""
    import msgpack

    save_checkpoint(tmp_path, step_id(5), make_state(5))
    odd = save_checkpoint(tmp_path, step_id(7), make_state(7))
    data = manifest if isinstance(manifest, bytes) else msgpack.packb(manifest)
    (odd / "manifest.msgpack").write_bytes(data)
    (odd / "loop").symlink_to(odd)  # a link back: not followed when sizing
    infos = {c.id: c for c in list_checkpoints(tmp_path)}
    info = infos[step_id(7)]
    assert (info.global_step, info.written_at, info.complete) == (step, written_at, complete)
    assert infos[step_id(5)].complete and infos[step_id(5)].global_step == 5


def test_ids():
    assert step_id(100) == "step-000000000100" and check_id(step_id(100)) == 100
    assert check_id("best") is None
    for bad in ("step-1", "best.state", "step-0000000001000", ""):
        with pytest.raises(CheckpointError):
            check_id(bad)
