"""What a loop leaves behind: metrics, checkpoints, resume and the final output.

The SFT loop (and later loops) call these functions at fixed points; this module maps them to
observe/ (progress, TensorBoard, W&B), checkpoint/ (.state directories) and gguf/ (the adapter
export). It knows the run file's sections, not the training math.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from retrograd import __version__
from retrograd.algorithms.outputs import rescue_paths
from retrograd.checkpoint import (
    AdapterState,
    CheckpointState,
    DatasetPosition,
    Identity,
    ModelIdentity,
    Progress,
    SchedulerState,
    check_resume,
    latest_checkpoint,
    load_checkpoint,
    model_identity,
    save_checkpoint,
    settings_signature,
    step_id,
)
from retrograd.checkpoint.optim import optimizer_state, restore_optimizer
from retrograd.checkpoint.rng import capture_rng, restore_rng
from retrograd.errors import CheckpointError, ConfigError, TrainingError
from retrograd.gguf.lora_export import write_lora_adapter
from retrograd.observe import Metrics, RunInfo, names
from retrograd.optim import base_lr, lr_at
from retrograd.trainable.plan import trained_parameters

if TYPE_CHECKING:
    from retrograd.algorithms.sft import Position


WINDOW = "window-kv.msgpack"  # artifact: the keys and values of a window cut by a checkpoint


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint must match to be resumed by this run, and how to describe the run."""

    architecture: str
    model: ModelIdentity
    data_fingerprint: str
    algorithm: str
    trajectory: dict  # settings that change which steps happen and what they compute

    @classmethod
    def of(cls, cfg, architecture: str, train, held, plan) -> RunIdentity:
        t = cfg.training
        trajectory = {
            "ctx": t.ctx,
            "micro_batch": t.micro_batch,
            "gradient_accumulation": t.gradient_accumulation,
            "epochs": t.epochs,
            "lr": t.lr,
            "base_lr": base_lr(t, cfg.optimizer),
            "lr_scheduler": t.lr_scheduler,
            "warmup_steps": t.warmup_steps,
            "optimizer": t.optimizer,
            "weight_decay": t.weight_decay,
            "max_grad_norm": t.max_grad_norm,
            "shuffle": cfg.sft.shuffle,
            "template_variables": dict(cfg.sft.template_variables),
            "lora": {
                "rank": plan.rank,
                "alpha": plan.alpha,
                "seed": cfg.lora.seed,
                "targets": [p.name for p in plan.trained],
            },
        }
        data = settings_signature(
            {"train": train.fingerprint, "eval": held.fingerprint if held is not None else None}
        )
        return cls(
            architecture,
            model_identity(cfg.model.path),
            data,
            cfg.run.algorithm,
            json.loads(json.dumps(trajectory, default=str)),
        )


class Sinks:
    """The run's metrics: terminal progress always, TensorBoard and W&B when configured."""

    def __init__(self, quiet: bool = False, console=None):
        self.quiet = quiet
        self.console = console
        self.metrics: Metrics | None = None

    @classmethod
    def quiet(cls) -> Sinks:
        return cls(quiet=True)

    def start(self, cfg, model, train, held, plan, total_steps: int, initial_step: int = 0) -> None:
        """Print what the run is about to do and open the metric sinks."""
        self.plan_lines = plan.describe()
        if self.quiet:
            return
        con = self.console
        con.print(f"model: {model.gguf.path.name} ({model.config.name}); {model.report.describe()}")
        con.print(f"data: {train.describe()}")
        if held is not None:
            con.print(f"evaluation: {held.describe()}")
        for line in self.plan_lines:
            con.print(line, markup=False)  # "[lora].targets" is text, not rich markup
        m = cfg.metrics
        info = RunInfo(
            cfg.run.algorithm,
            str(cfg.model.path),
            str(cfg.sft.data),
            str(cfg.evaluation.data) if cfg.evaluation else None,
            cfg.training.epochs,
            cfg.training.lr,
            cfg.training.lr_scheduler,
            cfg.training.warmup_steps,
        )
        self.metrics = Metrics(
            info,
            total_steps=total_steps,
            console=con,
            tensorboard_dir=m.tensorboard_dir if m else None,
            wandb_export_dir=m.wandb_export_dir if m else None,
            initial_step=initial_step,
        )

    def resumed(self, source: str, global_step: int) -> None:
        if self.metrics is not None:
            self.console.print(f"resumed from {source} at step {global_step}")
            self.metrics.global_step = global_step
            self.metrics.progress.global_step = global_step

    def step(
        self, global_step: int, epoch: int, loss: float, lr: float, tokens: int, seconds: float
    ) -> None:
        if self.metrics is not None:
            self.metrics.step(
                global_step, epoch, {names.TRAIN_LOSS: loss, names.LEARNING_RATE: lr}, tokens=tokens
            )

    def evaluation(
        self, epoch: int, global_step: int, loss: float, ppl: float, improved: bool, patience
    ) -> None:
        if self.metrics is not None:
            self.metrics.evaluation(
                global_step, {names.EVAL_LOSS: loss, names.EVAL_PERPLEXITY: ppl}, improved=improved
            )

    def checkpoint(self, path: Path, global_step: int) -> None:
        if self.metrics is not None:
            self.metrics.checkpoint(path, global_step)

    def finish(self, result, model) -> None:
        if self.metrics is not None:
            self.metrics.finish(
                {
                    "adapter": str(result.output),
                    "epochs": result.epochs_done,
                    "stopped early": "yes (patience)" if result.stopped_early else "no",
                }
            )

    def fail(self, message: str) -> None:
        if self.metrics is not None:
            self.metrics.fail(message)


def adapter_arrays(named) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{base tensor name: (A, B)} float32 arrays from trained (name, parameter) pairs."""
    halves: dict[str, dict[str, np.ndarray]] = {}
    for name, param in named:
        base, half = name.rsplit(".", 1)  # blk.0.attn_q.weight, lora_a
        halves.setdefault(base, {})[half] = param.detach().float().cpu().numpy()
    return {base: (h["lora_a"], h["lora_b"]) for base, h in halves.items()}


def export_output(cfg, model, plan, adapters, path: Path | None = None) -> Path:
    """[output] kind adapter (or `path`): a llama.cpp LoRA GGUF, written atomically."""
    out = Path(path or cfg.output.path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_lora_adapter(
        out,
        architecture=model.config.name,
        tensors=adapter_arrays(trained_parameters(adapters)),
        alpha=plan.alpha,
        dtype=plan.dtype,
        name=f"{model.gguf.get('general.name', 'model')} LoRA ({__version__})",
    )


def export_or_keep(
    cfg, model, run_file, run, pos, named, optimizer, plan, adapters, patience, total
) -> Path:
    """The final export; when it fails, the trained adapter is kept (a checkpoint, else a file
    beside the run file or in the temporary folder) and the error says where."""
    try:
        return export_output(cfg, model, plan, adapters)
    except Exception as e:  # any failure: the training must not be lost with it
        error = e
    kept = _keep(cfg, model, run_file, run, pos, named, optimizer, plan, adapters, patience, total)
    where = f"kept in {kept}" if kept is not None else "could not be kept anywhere either"
    raise TrainingError(
        f"[output].path = {cfg.output.path}: the adapter could not be written "
        f"({type(error).__name__}: {error}); the trained result was {where}"
    ) from error


def _keep(cfg, model, run_file, run, pos, named, optimizer, plan, adapters, patience, total):
    if cfg.checkpoint is not None:
        try:
            state = _state(cfg, run, pos, named, optimizer, plan, patience, total)
            directory = cfg.checkpoint.directory
            save_checkpoint(directory, step_id(pos.global_step), state)
            return Path(directory) / f"{step_id(pos.global_step)}.gguf"
        except Exception:
            pass
    for place in rescue_paths(Path(cfg.output.path), run_file):
        try:
            return export_output(cfg, model, plan, adapters, path=place)
        except Exception:
            continue
    return None


# -- checkpoints ---------------------------------------------------------------------------


def find_resume(cfg, resume) -> tuple[CheckpointState, str] | None:
    """The checkpoint `train --resume [path]` or [checkpoint].resume_from names, loaded."""
    ck = cfg.checkpoint
    target = resume if resume not in (None, False) else (ck.resume_from if ck else None)
    if target is None:
        return None
    if target is True:
        if ck is None:
            raise ConfigError("--resume without a path needs [checkpoint].directory")
        latest = latest_checkpoint(ck.directory)
        if latest is None:
            raise ConfigError(f"--resume: no complete checkpoint in {ck.directory}")
        target = latest
    return load_checkpoint(target), str(target)


def restore(
    found: tuple[CheckpointState, str], run: RunIdentity, named, optimizer, patience
) -> tuple[Position, bytes | None]:
    """Put adapters, optimizer, RNGs and patience back; the position to continue from and,
    inside a window, its saved keys and values (step.window_bytes)."""
    from retrograd.algorithms.sft import Position

    state, source = found
    if state.optimizer.kind != cfg_kind(run):
        raise ConfigError(
            f"cannot resume from {source}: the optimizer changed "
            f"({state.optimizer.kind} in the checkpoint, {cfg_kind(run)} now)"
        )
    check_resume(
        state,
        model_fingerprint=run.model.fingerprint,
        data_fingerprint=run.data_fingerprint,
        algorithm=run.algorithm,
        trajectory_settings=run.trajectory,
        source=source,
    )
    tensors = state.adapter.tensors if state.adapter else {}
    with torch.no_grad():
        for name, param in named:
            base, half = name.rsplit(".", 1)
            a, b = tensors[base]
            param.copy_(torch.from_numpy(np.ascontiguousarray(a if half == "lora_a" else b)))
    restore_optimizer(optimizer, [n for n, _ in named], state.optimizer)
    restore_rng(state.rng)
    patience.best = (
        state.progress.best_metric if state.progress.best_metric is not None else patience.best
    )
    patience.stale = state.progress.stale_evaluations
    ds = state.dataset
    pos = Position(ds.epoch, ds.index, int(ds.extra.get("group", 0)), state.global_step)
    window = state.artifacts.get(WINDOW)
    if pos.group and window is None:
        raise CheckpointError(
            f"cannot resume from {source}: it stops inside a window but holds no window cache "
            "(written by an earlier version); resume from a checkpoint between examples"
        )
    return pos, window


def cfg_kind(run: RunIdentity) -> str:
    return str(run.trajectory["optimizer"])


def _state(
    cfg, run: RunIdentity, pos, named, optimizer, plan, patience, total: int, window=None
) -> CheckpointState:
    t = cfg.training
    rate = base_lr(t, cfg.optimizer)
    lr = lr_at(max(0, pos.global_step - 1), total, rate, t.lr_scheduler, t.warmup_steps)
    tensors = adapter_arrays(named)
    best = patience.best if patience.best != float("inf") else None
    return CheckpointState(
        architecture=run.architecture,
        progress=Progress(pos.global_step, pos.epoch, 0, best, patience.stale),
        identity=Identity(
            run.model.signature,
            run.model.bytes,
            run.model.fingerprint,
            run.data_fingerprint,
            run.algorithm,
            run.trajectory,
            __version__,
        ),
        scheduler=SchedulerState(t.lr_scheduler, pos.global_step, total, rate, t.warmup_steps, lr),
        optimizer=optimizer_state(
            optimizer,
            [n for n, _ in named],
            kind=t.optimizer,
            hyper={"lr": t.lr, "weight_decay": t.weight_decay, "max_grad_norm": t.max_grad_norm},
        ),
        rng=capture_rng(seeds={"lora": cfg.lora.seed}),
        dataset=DatasetPosition(pos.epoch, pos.index, {"group": pos.group}),
        adapter=AdapterState(plan.rank, plan.alpha, plan.dtype, tensors),
        trainable_plan=plan.as_dict(),
        artifacts={WINDOW: window()} if window is not None else {},
    )


def maybe_checkpoint(
    cfg, run, pos, named, optimizer, plan, patience, total, sinks, window=None
) -> None:
    """A `steps` checkpoint when one is due. `window`: a callable giving the current window's
    cache bytes when the position is inside a window (called only when a checkpoint is due)."""
    ck = cfg.checkpoint
    if (
        ck is None
        or ck.mode not in ("steps", "steps_and_best_eval")
        or pos.global_step % ck.every_steps
    ):
        return
    path = save_checkpoint(
        ck.directory,
        step_id(pos.global_step),
        _state(cfg, run, pos, named, optimizer, plan, patience, total, window),
    )
    sinks.checkpoint(path, pos.global_step)


def save_best(cfg, run, pos, named, optimizer, plan, patience, total, sinks) -> None:
    ck = cfg.checkpoint
    if ck is None or ck.mode not in ("best_eval", "steps_and_best_eval"):
        return
    path = save_checkpoint(
        ck.directory, "best", _state(cfg, run, pos, named, optimizer, plan, patience, total)
    )
    sinks.checkpoint(path, pos.global_step)
