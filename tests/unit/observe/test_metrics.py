"""The object loops report to: sinks together, the context manager, non-finite values, summary."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from retrograd.observe import Metrics, names, peak_memory
from retrograd.observe.memory import describe, format_bytes


def events(export_dir) -> list[dict]:
    return [json.loads(line) for line in (export_dir / "metrics.jsonl").read_text().splitlines()]


def scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def test_exception_records_run_failed_and_propagates(
    tmp_path, run_info, plain_console, read_wandb_records
):
    with pytest.raises(ValueError, match="boom"):
        with Metrics(
            run_info,
            total_steps=10,
            tensorboard_dir=tmp_path / "tb",
            wandb_export_dir=tmp_path / "wb",
            console=plain_console,
        ) as metrics:
            metrics.step(1, 1, {names.TRAIN_LOSS: 2.0})
            raise ValueError("boom")
    assert events(tmp_path / "wb")[-1] == {"event": "run_failed", "message": "ValueError: boom"}
    assert metrics.closed and metrics.tensorboard._file.closed
    assert scalars(metrics.tensorboard.run_dir) == {names.TRAIN_LOSS: [(1, 2.0)]}
    assert "run failed: ValueError: boom" in plain_console.file.getvalue()
    (run_file,) = metrics.wandb.run_dir.glob("run-*.wandb")
    records = read_wandb_records(run_file)
    (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 1  # W&B shows the run as failed once synced


def test_interrupt_is_recorded_as_such(tmp_path, run_info, plain_console):
    with pytest.raises(KeyboardInterrupt):
        with Metrics(run_info, total_steps=1, wandb_export_dir=tmp_path, console=plain_console):
            raise KeyboardInterrupt
    assert events(tmp_path)[-1] == {"event": "run_failed", "message": "interrupted"}


def test_finish_is_once_and_wins_over_the_context_exit(tmp_path, run_info, plain_console):
    with Metrics(
        run_info, total_steps=2, wandb_export_dir=tmp_path, console=plain_console
    ) as metrics:
        metrics.step(2, 1, {names.TRAIN_LOSS: 1.0})
        metrics.finish({"checkpoints": "out/ckpt"})
        metrics.fail("too late")
    assert [e["event"] for e in events(tmp_path)] == ["run_started", "step", "run_finished"]
    assert plain_console.file.getvalue().count("run summary") == 1


def test_non_finite_values_reach_no_sink_but_the_terminal(tmp_path, run_info, plain_console):
    with Metrics(
        run_info,
        total_steps=2,
        tensorboard_dir=tmp_path / "tb",
        wandb_export_dir=tmp_path / "wb",
        console=plain_console,
    ) as metrics:
        metrics.step(1, 1, {names.TRAIN_LOSS: float("nan"), names.LEARNING_RATE: 1e-4})
        metrics.step(2, 1, {names.TRAIN_LOSS: float("-inf"), names.LEARNING_RATE: 1e-4})
        metrics.evaluation(2, {names.EVAL_LOSS: float("inf")})
    assert scalars(metrics.tensorboard.run_dir) == {
        names.LEARNING_RATE: [(1, pytest.approx(1e-4)), (2, pytest.approx(1e-4))]
    }
    logged = [
        v["name"] for e in events(tmp_path / "wb") if e["event"] == "step" for v in e["values"]
    ]
    assert logged == [names.LEARNING_RATE, names.LEARNING_RATE]
    text = plain_console.file.getvalue()
    assert "loss nan" in text and "loss -inf" in text and "eval/loss inf" in text
    assert "best eval" not in text  # an infinite loss is no best


def test_tokens_per_second_and_summary(tmp_path, run_info, plain_console, monkeypatch):
    now = [100.0]
    monkeypatch.setattr("retrograd.observe.metrics.monotonic", lambda: now[0])
    metrics = Metrics(
        run_info, total_steps=3, tensorboard_dir=tmp_path / "tb", console=plain_console
    )

    def at(seconds, report, *args, **kwargs):
        now[0] = seconds
        report(*args, **kwargs)

    at(102, metrics.step, 1, 1, {names.TRAIN_LOSS: 3.0}, tokens=1000)  # 2 s: 500 tok/s
    at(104, metrics.step, 2, 1, {names.TRAIN_LOSS: 2.0}, tokens=1000)
    at(110, metrics.evaluation, 2, {names.EVAL_LOSS: 1.9, names.EVAL_PERPLEXITY: 6.69})
    at(111, metrics.evaluation, 2, {names.EVAL_LOSS: 2.5, names.EVAL_PERPLEXITY: 12.2})
    at(113, metrics.step, 3, 1, {names.TRAIN_LOSS: 1.0}, tokens=4000)  # 2 s after evaluating
    rows = metrics.summary_rows({"checkpoints": "out/ckpt", "time": "caller's"})  # 113
    assert scalars(metrics.tensorboard.run_dir)[names.TOKENS_PER_SECOND] == [
        (1, 500.0),
        (2, 500.0),
        (3, 2000.0),
    ]
    assert rows["tokens/s"] == 1000.0  # 6000 tokens over 6 s of training; evaluations excluded
    assert rows["best eval/loss"] == 1.9 and rows["best eval/perplexity"] == 6.69
    assert rows["tensorboard"] == str(metrics.tensorboard.run_dir)
    assert rows["steps"] == "3/3" and rows["checkpoints"] == "out/ckpt"
    assert rows["time"] == "caller's"  # the caller's rows win
    assert re.fullmatch(r"[\d.]+ [KMG]iB RSS", rows["peak memory"])
    metrics.finish()


def test_rollout_loops_decide_improvement(run_info, plain_console):
    metrics = Metrics(run_info, total_steps=2, console=plain_console)
    metrics.evaluation(1, {"eval/mean_reward": 0.2}, improved=True)
    metrics.evaluation(2, {"eval/mean_reward": 0.1}, improved=False)
    assert metrics.best_eval == {"eval/mean_reward": 0.2}
    metrics.finish()


def test_peak_memory_is_the_kernels_high_water_mark():
    with open("/proc/self/status") as status:
        hwm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    peak = peak_memory()
    # Same counter read twice a moment apart (the kernel batches RSS updates per thread).
    assert abs(peak["max_rss"] - hwm_kib * 1024) < 16 * 2**20


def test_peak_memory_reports_cuda_once_used(monkeypatch):
    cuda = SimpleNamespace(
        is_available=lambda: True, is_initialized=lambda: True, max_memory_allocated=lambda: 3 << 30
    )
    monkeypatch.setitem(__import__("sys").modules, "torch", SimpleNamespace(cuda=cuda))
    peak = peak_memory()
    assert peak["cuda_max_allocated"] == 3 << 30
    assert describe(peak).endswith(", 3.00 GiB CUDA")
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.50 KiB"


def test_numpy_scalars_are_logged_as_floats(tmp_path, run_info, plain_console):
    import numpy as np

    with Metrics(
        run_info, total_steps=1, wandb_export_dir=tmp_path, console=plain_console
    ) as metrics:
        metrics.step(1, 1, {names.TRAIN_LOSS: np.float32(0.5), names.LEARNING_RATE: np.float64(1)})
    (step,) = [e for e in events(tmp_path) if e["event"] == "step"]
    assert step["values"] == [
        {"name": names.TRAIN_LOSS, "value": 0.5},
        {"name": names.LEARNING_RATE, "value": 1.0},
    ]
    assert "loss 0.5000" in plain_console.file.getvalue()
