"""A save cut short at any point leaves the previous checkpoint whole and nothing taken for complete."""

from __future__ import annotations

import os
import shutil

import pytest

from retrograd.checkpoint import (
    CheckpointError,
    codec,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    store,
)
from tests.unit.checkpoint.sample_state import make_state

BEST = "best"


class Crash(Exception):
    pass


def crash(*args, **kwargs):
    raise Crash


@pytest.mark.parametrize("where", ["_write_optimizer", "_write_artifacts", "_manifest"])
def test_crash_while_writing_keeps_the_old_checkpoint(tmp_path, monkeypatch, where):
    save_checkpoint(tmp_path, BEST, make_state(1))
    monkeypatch.setattr(codec, where, crash)
    with pytest.raises(Crash):
        save_checkpoint(tmp_path, BEST, make_state(2))
    with pytest.raises(Crash):
        save_checkpoint(tmp_path, "step-000000000002", make_state(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.gguf", "best.state"]
    assert load_checkpoint(tmp_path / "best.state").global_step == 1
    assert latest_checkpoint(tmp_path) == tmp_path / "best.state"


def test_crash_between_the_two_renames_leaves_a_usable_backup(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, BEST, make_state(1))
    renames = []

    def rename_once(src, dst):
        if renames:
            raise Crash  # the new directory never lands
        renames.append((src, dst))
        os.replace(src, dst)

    monkeypatch.setattr(store.os, "rename", rename_once)
    with pytest.raises(Crash):
        save_checkpoint(tmp_path, BEST, make_state(2))
    monkeypatch.undo()
    assert not (tmp_path / "best.state").exists() and (tmp_path / ".best.backup").is_dir()
    assert load_checkpoint(tmp_path / "best.state").global_step == 1
    assert latest_checkpoint(tmp_path) == tmp_path / "best.state"
    [info] = list_checkpoints(tmp_path)
    assert info.complete and info.global_step == 1
    save_checkpoint(tmp_path, BEST, make_state(3))  # lands, then drops the backup
    assert not (tmp_path / ".best.backup").exists()
    assert load_checkpoint(tmp_path / "best.gguf").global_step == 3


def test_stale_backup_beside_a_complete_state_is_ignored_then_removed(tmp_path):
    save_checkpoint(tmp_path, BEST, make_state(1))
    shutil.copytree(tmp_path / "best.state", tmp_path / ".best.backup")
    save_checkpoint(tmp_path, BEST, make_state(2))
    assert load_checkpoint(tmp_path / "best.state").global_step == 2
    assert not (tmp_path / ".best.backup").exists()


def test_leftover_temporaries_are_ignored_and_swept(tmp_path):
    save_checkpoint(tmp_path, "step-000000000001", make_state(1))
    dead = 2**22 + 12345  # above pid_max's default: no such process
    # A finished-looking temporary (manifest included) is still not a checkpoint.
    shutil.copytree(
        tmp_path / "step-000000000001.state", tmp_path / f".step-000000000009.tmp-{dead}-0"
    )
    (tmp_path / f".step-000000000009.gguf.tmp-{dead}-3").write_bytes(b"GGUF half")
    assert [c.id for c in list_checkpoints(tmp_path)] == ["step-000000000001"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000000000001.state"
    save_checkpoint(tmp_path, "step-000000000002", make_state(2))
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_temporaries_of_a_live_writer_are_left_alone(tmp_path):
    live = tmp_path / f".best.tmp-{os.getppid()}-0"
    live.mkdir()
    save_checkpoint(tmp_path, BEST, make_state(1))
    assert live.is_dir()


def test_incomplete_state_directory_is_refused_and_not_latest(tmp_path):
    save_checkpoint(tmp_path, "step-000000000001", make_state(1))
    path = save_checkpoint(tmp_path, "step-000000000002", make_state(2))
    (path / "manifest.msgpack").unlink()
    with pytest.raises(CheckpointError, match="incomplete checkpoint .no manifest.msgpack"):
        load_checkpoint(path)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000000000001.state"
    info = {c.id: c for c in list_checkpoints(tmp_path)}
    assert not info["step-000000000002"].complete and info["step-000000000001"].complete


def test_incomplete_state_with_a_good_backup_uses_the_backup_until_replaced(tmp_path):
    path = save_checkpoint(tmp_path, BEST, make_state(1))
    shutil.copytree(path, tmp_path / ".best.backup")
    (path / "manifest.msgpack").unlink()
    assert load_checkpoint(path).global_step == 1
    save_checkpoint(tmp_path, BEST, make_state(2))
    assert load_checkpoint(path).global_step == 2 and not (tmp_path / ".best.backup").exists()


def test_failed_sibling_export_leaves_the_checkpoint_and_no_temporary(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "write_lora_adapter", crash)
    with pytest.raises(Crash):
        save_checkpoint(tmp_path, BEST, make_state(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.state"]
    assert load_checkpoint(tmp_path / "best.state").global_step == 1
