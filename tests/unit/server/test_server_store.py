"""The state directory read back (store.py): what a run.json must say to be loaded."""

from __future__ import annotations

import json

import pytest

from retrograd.server.store import RunRecord, RunStore


@pytest.mark.parametrize("claimed", ["..", "run_other", "run_1/../../x", ""])
def test_a_run_record_is_loaded_only_under_its_own_id(tmp_path, claimed):
    # the id in run.json names the folder every later write and DELETE touches: a record
    # claiming ".." made DELETE /v1/runs/%2e%2e remove the state directory's parent
    good = RunRecord(
        id="run_1", name=None, status="completed", algorithm="sft", model="m", created_at=0
    )
    (tmp_path / "run_1").mkdir()
    (tmp_path / "run_1" / "run.json").write_text(json.dumps(good.to_json()))
    (tmp_path / "run_2").mkdir()
    (tmp_path / "run_2" / "run.json").write_text(json.dumps(good.to_json() | {"id": claimed}))
    store = RunStore(tmp_path)
    store.load()
    assert list(store.runs) == ["run_1"]


def test_only_a_datasets_own_id_names_a_dataset(tmp_path):
    # a string starting "ds_" in a run document is looked up as a dataset: "ds_<id>/../../x"
    # read x/dataset.json wherever x was (a list there was a 500 TypeError)
    from retrograd.server.datasets import Datasets

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "dataset.json").write_text("[]")
    datasets = Datasets(tmp_path / "datasets", 1 << 20, 1 << 30)
    (tmp_path / "datasets").mkdir()
    view, _ = datasets.add(b"hello\n", "text/plain", "auto", None)
    assert datasets.view(view["id"]) == view
    assert datasets.view(view["id"] + "/../../x") is None  # was [], then a 500
    assert datasets.view("ds_" + "0" * 64) is None


def test_a_runs_record_is_readable_by_the_servers_user_alone(tmp_path):
    # run.json holds what the catalogue resolved for the run's process: an MCP server's or an
    # environment's headers and env (their keys), which the listings and views hide
    store = RunStore(tmp_path)
    record = RunRecord(
        id="run_1", name=None, status="queued", algorithm="sft", model="m", created_at=0
    )
    store.add(record)
    store.transition(record, "running")
    assert (tmp_path / "run_1" / "run.json").stat().st_mode & 0o077 == 0
