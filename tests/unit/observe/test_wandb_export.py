"""Offline W&B export: wandb's own run directory (read back with wandb's protobufs and checked
with `wandb sync --dry-run`), plus formats.md's run.json and metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from retrograd.errors import ConfigError
from retrograd.observe import Metrics, names
from retrograd.observe.wandb_export import WandbExport


def history(records) -> dict[int, dict[str, float]]:
    """{step: {key: value}} from the history records, wandb's own `_step`, `_runtime`... left out."""
    rows: dict[int, dict[str, float]] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = rows.setdefault(record.history.step.num, {})
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    row[key] = json.loads(item.value_json)
    return rows


def test_offline_run_has_config_and_history(tmp_path, run_info, read_wandb_records):
    export = WandbExport(tmp_path, run_info, project="retrograd-tests")
    assert export.run_dir.parent == tmp_path / "wandb"
    assert export.run_dir.name.startswith("offline-run-")
    export.step(1, 1, {names.TRAIN_LOSS: 2.5, names.LEARNING_RATE: 1e-4})
    export.step(2, 1, {names.TRAIN_LOSS: 2.0, names.LEARNING_RATE: 2e-4})
    export.step(2, 1, {names.EVAL_LOSS: 1.75})  # evaluation merges into the step it follows
    export.finish(2)

    (run_file,) = export.run_dir.glob("run-*.wandb")
    records = read_wandb_records(run_file)
    kinds = [r.WhichOneof("record_type") for r in records]
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "retrograd-tests"
    config = {u.key: json.loads(u.value_json) for u in run.config.update if u.key != "_wandb"}
    assert config == run_info.to_dict()
    assert history(records) == {
        1: {names.TRAIN_LOSS: 2.5, names.LEARNING_RATE: 1e-4},
        2: {names.TRAIN_LOSS: 2.0, names.LEARNING_RATE: 2e-4, names.EVAL_LOSS: 1.75},
    }
    (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 0
    assert "output_raw" not in kinds  # console="off": wandb never wrapped our terminal


def test_wandb_sync_finds_the_run(tmp_path, run_info):
    export = WandbExport(tmp_path, run_info)
    export.step(1, 1, {names.TRAIN_LOSS: 1.0})
    export.finish(1)
    wandb_cli = Path(sys.executable).with_name("wandb")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    result = subprocess.run(
        [str(wandb_cli), "sync", "--dry-run", str(export.run_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    output = result.stdout + result.stderr
    assert "Would sync 1 run" in output, output
    assert export.run_dir.name in output


def test_run_json_and_metrics_jsonl(tmp_path, run_info, plain_console):
    export_dir = tmp_path / "export"
    with Metrics(
        run_info, total_steps=3, wandb_export_dir=export_dir, console=plain_console
    ) as metrics:
        metrics.step(1, 1, {names.TRAIN_LOSS: 2.0, names.LEARNING_RATE: 1e-4})
        metrics.step(2, 1, {names.TRAIN_LOSS: float("nan"), names.LEARNING_RATE: 1e-4})
        metrics.evaluation(2, {names.EVAL_LOSS: 1.5, names.EVAL_PERPLEXITY: float("inf")})
        metrics.step(3, 2, {names.TRAIN_LOSS: 1.0, names.TOKENS_PER_SECOND: 640.0})

    assert json.loads((export_dir / "run.json").read_text()) == {
        "algorithm": "sft",
        "model": "models/tiny.gguf",
        "train_data": "data/train.jsonl",
        "eval_data": "data/eval.jsonl",
        "epochs": 2,
        "learning_rate": 2e-5,
        "scheduler": "cosine",
        "warmup_steps": 10,
    }
    events = [json.loads(line) for line in (export_dir / "metrics.jsonl").read_text().splitlines()]
    assert events == [
        {"event": "run_started", "metadata": run_info.to_dict()},
        {
            "event": "step",
            "epoch": 1,
            "global_step": 1,
            "values": [
                {"name": names.TRAIN_LOSS, "value": 2.0},
                {"name": names.LEARNING_RATE, "value": 1e-4},
            ],
        },
        # The NaN loss and the infinite perplexity are omitted; the rest of their events stay.
        {
            "event": "step",
            "epoch": 1,
            "global_step": 2,
            "values": [{"name": names.LEARNING_RATE, "value": 1e-4}],
        },
        {
            "event": "step",
            "epoch": 1,
            "global_step": 2,
            "values": [{"name": names.EVAL_LOSS, "value": 1.5}],
        },
        {
            "event": "step",
            "epoch": 2,
            "global_step": 3,
            "values": [
                {"name": names.TRAIN_LOSS, "value": 1.0},
                {"name": names.TOKENS_PER_SECOND, "value": 640.0},
            ],
        },
        {"event": "run_finished", "global_step": 3},
    ]


def test_missing_wandb_is_a_config_error_and_writes_nothing(tmp_path, run_info, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` sees when not installed
    export_dir = tmp_path / "export"
    with pytest.raises(ConfigError) as error:
        Metrics(
            run_info,
            total_steps=1,
            wandb_export_dir=export_dir,
            tensorboard_dir=tmp_path / "tb",
        )
    assert str(error.value) == (
        "[metrics].wandb_export_dir needs the wandb package: pip install 'retrograd[wandb]'"
    )
    assert not export_dir.exists() and not (tmp_path / "tb").exists()
