"""Every field of a checkpoint comes back as it went in; damaged or foreign ones are refused."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import msgpack
import numpy as np
import pytest

from retrograd.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from retrograd.checkpoint.codec import pack
from retrograd.checkpoint.layout import read_manifest
from retrograd.gguf import GGUFFile
from tests.unit.checkpoint.sample_state import make_state

STATE_FILES = {
    "adapter.gguf",
    "trainable.gguf",
    "optimizer-state.bin",
    "manifest.msgpack",
    "progress.msgpack",
    "scheduler.msgpack",
    "optimizer.msgpack",
    "rng.msgpack",
    "dataset.msgpack",
    "artifacts/critic.bin",
}


def assert_same(a, b):
    """Field by field, arrays bit for bit, tuples and lists alike (msgpack has only lists)."""
    if dataclasses.is_dataclass(a):
        assert type(a) is type(b)
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert type(a) is type(b) and a == b, (a, b)


def test_every_field_round_trips(tmp_path):
    state = make_state(100)
    path = save_checkpoint(tmp_path, "step-000000000100", state)
    assert path == tmp_path / "step-000000000100.state"
    files = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
    assert files == STATE_FILES
    assert_same(state, load_checkpoint(path))
    assert_same(state, load_checkpoint(tmp_path / "step-000000000100.gguf"))  # the sibling


def test_records_are_named_msgpack_fields(tmp_path):
    path = save_checkpoint(tmp_path, "best", make_state(7))
    manifest = msgpack.unpackb((path / "manifest.msgpack").read_bytes())
    assert manifest["format_version"] == 1 and manifest["checkpoint_id"] == "best"
    assert manifest["global_step"] == 7 and manifest["resume_boundary"] == {"epoch": 2, "update": 0}
    assert set(manifest["files"]) == STATE_FILES - {"manifest.msgpack"}
    opt = msgpack.unpackb((path / "optimizer.msgpack").read_bytes())
    scope, owner, slot, dtype, shape, offset, n_bytes = opt["slots"][2]
    assert (owner, slot, dtype, shape, offset, n_bytes) == (
        "blk.0.attn_q.weight.lora_b",
        "exp_avg_sq",
        "bf16",
        [48, 4],
        516,
        384,
    )
    assert opt["state_bytes"] == (path / "optimizer-state.bin").stat().st_size == 964
    sched = msgpack.unpackb((path / "scheduler.msgpack").read_bytes())
    assert set(sched) == {
        "kind",
        "step",
        "total_steps",
        "learning_rate",
        "warmup_steps",
        "last_learning_rate",
    }


@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_adapter_inside_is_f32_and_the_export_in_its_dtype(tmp_path, dtype):
    state = make_state(3, adapter_dtype=dtype)
    path = save_checkpoint(tmp_path, "step-000000000003", state)
    inner = GGUFFile(path / "adapter.gguf")
    export = GGUFFile(tmp_path / "step-000000000003.gguf")
    assert inner.tensor("blk.0.attn_q.weight.lora_a").type_name == "F32"
    assert export.tensor("blk.0.attn_q.weight.lora_a").type_name == dtype.upper()
    assert export.get("general.type") == "adapter" and export.get("adapter.lora.alpha") == 8.0
    if dtype == "f32":
        assert export.path.read_bytes() == inner.path.read_bytes()


def test_without_adapter_or_export_nothing_beside(tmp_path):
    state = dataclasses.replace(make_state(5), adapter=None, trainable=None, artifacts={})
    path = save_checkpoint(tmp_path, "step-000000000005", state)
    assert not (path / "adapter.gguf").exists() and not (path / "trainable.gguf").exists()
    assert not (tmp_path / "step-000000000005.gguf").exists()
    loaded = load_checkpoint(path)
    assert loaded.adapter is None and loaded.trainable is None and loaded.artifacts == {}
    save_checkpoint(tmp_path, "best", make_state(6))
    assert (tmp_path / "best.gguf").is_file()
    save_checkpoint(tmp_path, "best", make_state(7), export_adapter=False)
    assert not (tmp_path / "best.gguf").exists()  # a stale export is not left beside it


def test_damaged_files_are_refused(tmp_path):
    path = save_checkpoint(tmp_path, "best", make_state(1))
    data = bytearray((path / "optimizer-state.bin").read_bytes())
    data[10] ^= 0xFF
    (path / "optimizer-state.bin").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="differs from the manifest"):
        load_checkpoint(path)
    load_checkpoint(path, verify=False)  # sizes still agree
    (path / "rng.msgpack").write_bytes(b"short")
    with pytest.raises(CheckpointError, match="wrong size"):
        load_checkpoint(path, verify=False)


def test_other_format_version_is_refused(tmp_path):
    path = save_checkpoint(tmp_path, "best", make_state(1))
    manifest = msgpack.unpackb((path / "manifest.msgpack").read_bytes())
    (path / "manifest.msgpack").write_bytes(pack(manifest | {"format_version": 2}))
    with pytest.raises(CheckpointError, match="format version 2"):
        load_checkpoint(path)


@pytest.mark.parametrize(
    "checkpoint_id, step, message",
    [
        ("step-100", 100, "12 digits"),
        ("last", 1, "or best"),
        ("step-000000000099", 100, "at global step 100"),
    ],
)
def test_bad_ids_are_refused(tmp_path, checkpoint_id, step, message):
    with pytest.raises(CheckpointError, match=message):
        save_checkpoint(tmp_path, checkpoint_id, make_state(step))
    assert list(tmp_path.iterdir()) == []


def test_bad_paths_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "step-000000000001.state")
    with pytest.raises(CheckpointError, match="expected a .state"):
        load_checkpoint(tmp_path / "model.bin")


def _rewrite(path, name, change):
    """The record `name` changed; the manifest's size and sha256 of it follow."""
    record = msgpack.unpackb((path / name).read_bytes(), strict_map_key=False)
    (path / name).write_bytes(data := pack(change(record)))
    if name != "manifest.msgpack":
        entry = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        _rewrite(path, "manifest.msgpack", lambda m: m | {"files": m["files"] | {name: entry}})


HOSTILE_MANIFESTS = [
    ("a list", lambda m: [1, 2]),
    ("no files", lambda m: {k: v for k, v in m.items() if k != "files"}),
    ("files a list", lambda m: m | {"files": [1]}),
    ("no architecture", lambda m: {k: v for k, v in m.items() if k != "architecture"}),
    ("an artifact out of its folder", lambda m: m | {"artifacts": ["../../manifest.msgpack"]}),
    ("a file out of the folder", lambda m: m | {"files": {"../outside": {"bytes": 1}}}),
    ("an absolute file", lambda m: m | {"files": {"/etc/hostname": {"bytes": 1}}}),
    # every file read must be one the manifest vouches for (size, sha256)
    (
        "an adapter out of the folder",
        lambda m: m | {"adapter": m["adapter"] | {"file": "../x.gguf"}},
    ),
    ("an absolute adapter", lambda m: m | {"adapter": m["adapter"] | {"file": "/etc/hostname"}}),
    ("an unlisted record", lambda m: m | {"files": _without(m["files"], "progress.msgpack")}),
    ("an unlisted optimizer", lambda m: m | {"files": _without(m["files"], "optimizer-state.bin")}),
    ("an unlisted artifact", lambda m: m | {"files": _without(m["files"], "artifacts/critic.bin")}),
]


def _without(files: dict, name: str) -> dict:
    assert name in files, name
    return {k: v for k, v in files.items() if k != name}


@pytest.mark.parametrize(
    ("what", "change"), HOSTILE_MANIFESTS, ids=[h[0] for h in HOSTILE_MANIFESTS]
)
def test_a_hostile_manifest_is_a_checkpoint_error_naming_it(tmp_path, what, change):
    # a checkpoint someone handed over, or one a bug or a disk damaged: a clear refusal, never
    # a KeyError out of a resume, nor a file read from outside the checkpoint
    path = save_checkpoint(tmp_path, "best", make_state(1))
    _rewrite(path, "manifest.msgpack", change)
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(path, verify=False)
    assert str(path) in str(refused.value)


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("optimizer-state.bin", "/dev/zero"),  # endless: read, it would fill the memory
        ("artifacts/critic.bin", "secret"),  # a file of the host's, loaded as an artifact
        ("artifacts", "elsewhere"),  # a folder on the way
    ],
)
def test_a_checkpoint_file_that_is_a_link_is_refused(tmp_path, name, target):
    """A checkpoint may come from anyone: its files are its own, never links out of it."""
    path = save_checkpoint(tmp_path / "run", "best", make_state(1))
    outside = tmp_path / target if not target.startswith("/") else Path(target)
    if target == "elsewhere":
        (path / name).rename(outside)
    elif target == "secret":
        outside.write_bytes((path / name).read_bytes())  # the same bytes: size and sha match
        (path / name).unlink()
    else:
        (path / name).unlink()
    (path / name).symlink_to(outside)
    for verify in (True, False):
        with pytest.raises(CheckpointError, match=r"is a link|outside the checkpoint") as refused:
            load_checkpoint(path, verify=verify)
        assert str(path) in str(refused.value)


def test_a_manifest_that_is_a_link_or_not_a_file_is_refused(tmp_path):
    path = save_checkpoint(tmp_path, "best", make_state(1))
    (path / "manifest.msgpack").unlink()
    (path / "manifest.msgpack").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint"):
        load_checkpoint(path)  # never read: it is not a file
    with pytest.raises(CheckpointError, match=r"unreadable manifest \(not a regular file\)"):
        read_manifest(path)


def test_a_hostile_record_is_a_checkpoint_error_naming_it(tmp_path):
    path = save_checkpoint(tmp_path, "best", make_state(1))
    _rewrite(path, "progress.msgpack", lambda r: r | {"surprise": 1})
    with pytest.raises(
        CheckpointError, match=r"malformed checkpoint: progress\.msgpack: TypeError"
    ):
        load_checkpoint(path)
    _rewrite(path, "progress.msgpack", lambda r: [r])
    with pytest.raises(CheckpointError, match=r"progress\.msgpack: TypeError: not a map"):
        load_checkpoint(path)


def test_an_optimizer_slot_claiming_a_size_it_lacks_is_refused(tmp_path):
    # a shape whose element count wraps 64 bits to the bytes it names, a negative offset
    path = save_checkpoint(tmp_path, "best", make_state(1))
    record = msgpack.unpackb((path / "optimizer.msgpack").read_bytes(), strict_map_key=False)
    scope, owner, slot, dtype, shape, offset, n_bytes = record["slots"][0]
    assert (dtype, shape, n_bytes) == ("f32", [4, 32], 512)
    for bad in ([(1 << 62) + 32, 4], shape):  # (2^64 + 128) x 4 bytes: 512 in 64 bits
        at = -n_bytes if bad is shape else offset
        slots = [[scope, owner, slot, dtype, bad, at, n_bytes], *record["slots"][1:]]
        _rewrite(path, "optimizer.msgpack", lambda r, slots=slots: r | {"slots": slots})
        with pytest.raises(CheckpointError, match=r"optimizer"):
            load_checkpoint(path)
