"""What a loop leaves behind: metrics, checkpoints, resume and the final output.

Every loop (sft, preference, grpo, ppo, distill, agent_grpo) calls these functions at fixed
points with its own records: a `Mark` says where the loop stands (what a checkpoint keeps of
its position), a trajectory dict what of its section changes the steps, a values dict its
metrics. This module maps them to
observe/ (progress, TensorBoard, W&B), checkpoint/ (.state directories) and gguf/ (the adapter
export). It reads the shared sections ([training], [lora], [checkpoint], [metrics], [output]),
never an algorithm's own section, and knows no training math.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

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
from retrograd.checkpoint.ranks import WORLD_SIZE, check_world, restore_state, save_state
from retrograd.checkpoint.rng import capture_rng, restore_rng
from retrograd.distributed import world
from retrograd.errors import ConfigError, TrainingError
from retrograd.gguf import RawTensor
from retrograd.gguf.lora_export import write_lora_adapter
from retrograd.gguf.model_export import bf16_tensor, write_model, write_trainable
from retrograd.observe import Metrics, RunInfo
from retrograd.optim import base_lr, lr_at
from retrograd.trainable.plan import Trained
from retrograd.version import __version__

_log = logging.getLogger(__name__)


@dataclass
class Mark:
    """What a checkpoint keeps of a loop's position: its step, the resume boundary (epoch or
    update), where it reads its data, loop-specific counters, and artifacts (callables giving
    bytes, called only when a checkpoint is written)."""

    global_step: int
    epoch: int = 0
    update: int = 0
    dataset: DatasetPosition = field(default_factory=lambda: DatasetPosition(0, 0))
    extra: dict = field(default_factory=dict)
    artifacts: dict[str, Callable[[], bytes]] = field(default_factory=dict)


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint must match to be resumed by this run, and how to describe the run."""

    architecture: str
    model: ModelIdentity
    data_fingerprint: str
    algorithm: str
    trajectory: dict  # settings that change which steps happen and what they compute

    @classmethod
    def of(cls, cfg, architecture: str, data: dict, plan, algorithm_settings: dict) -> RunIdentity:
        """data: {role: fingerprint} of the files read; algorithm_settings: the loop's own
        settings that change its steps (its section's keys)."""
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
            **algorithm_settings,
            **plan.signature(),
        }
        tables = cfg.optimizer
        section = getattr(tables, t.optimizer, None) if tables is not None else None
        if section is not None:  # [optimizer.muon] or [optimizer.gefen]: e.g. gefen's variant
            trajectory[t.optimizer] = section.model_dump()
        if world().active:  # a checkpoint resumes with the world size that saved it
            trajectory[WORLD_SIZE] = world().size
        return cls(
            architecture,
            model_identity(cfg.model.path),
            settings_signature(data),
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

    def start(
        self,
        cfg,
        model,
        plan,
        total_steps: int,
        *,
        data: tuple[Path, str],
        held: tuple[Path, str] | None = None,
        iterations: int,
        initial_step: int = 0,
        unit: str = "step",
        initial_position: int | None = None,
    ) -> None:
        """Print what the run is about to do and open the metric sinks. data, held: (path,
        one-line description) of the training and evaluation files; iterations: epochs or
        updates; total_steps counts `unit` (optimizer steps, or the loop's updates, from
        `initial_position` on resume)."""
        self.plan_lines = plan.describe()
        if self.quiet:
            return
        con = self.console
        con.print(f"model: {model.gguf.path.name} ({model.config.name}); {model.report.describe()}")
        for line in model.report.lines():  # the compute plan
            con.print(line, markup=False)
        con.print(f"data: {data[1]}", markup=False)
        if held is not None:
            con.print(f"evaluation: {held[1]}", markup=False)
        for line in self.plan_lines:
            con.print(line, markup=False)  # "[lora].targets" is text, not rich markup
        m = cfg.metrics
        info = RunInfo(
            cfg.run.algorithm,
            str(cfg.model.path),
            str(data[0]),
            str(held[0]) if held else None,
            iterations,
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
            unit=unit,
            initial_position=initial_position,
        )

    def resumed(self, source: str, global_step: int) -> None:
        if self.metrics is not None:
            self.console.print(f"resumed from {source} at step {global_step}")
            self.metrics.global_step = global_step

    def step(
        self,
        global_step: int,
        epoch: int,
        values: dict[str, float],
        tokens: int,
        seconds: float,
        position: int | None = None,
    ) -> None:
        """One optimizer step's metrics, by their names (observe/names.py); `position` in
        the progress unit when it is not the step."""
        if self.metrics is not None:
            self.metrics.step(global_step, epoch, values, tokens=tokens, position=position)

    def note(self, message: str) -> None:
        """A line on the terminal (and the log) about a long phase outside the steps."""
        _log.info("%s", message)
        if self.metrics is not None:
            self.console.print(message, markup=False, highlight=False)

    def warn(self, message: str) -> None:
        """A warning the run goes on after: on stderr's log, and on the terminal."""
        _log.warning("%s", message)
        if self.metrics is not None:
            self.console.print(f"warning: {message}", markup=False, style="yellow")

    def evaluation(self, global_step: int, values: dict[str, float], improved: bool) -> None:
        if self.metrics is not None:
            self.metrics.evaluation(global_step, values, improved=improved)

    def checkpoint(self, path: Path, global_step: int) -> None:
        if self.metrics is not None:
            self.metrics.checkpoint(path, global_step)

    def finish(self, summary: dict[str, object]) -> None:
        """The end-of-run summary lines, {label: value}."""
        if self.metrics is not None:
            self.metrics.finish(summary)

    def fail(self, message: str) -> None:
        if self.metrics is not None:
            self.metrics.fail(message)

    def checkpoint_requested(self) -> bool:
        """Whether a checkpoint is wanted at this boundary though none is due (the run
        server's sinks say so when a client asks for one)."""
        return False

    def checkpoint_section(self, cfg):
        """The [checkpoint] the run follows now: the file's, or what a client changed it to
        during the run (the run server's sinks)."""
        return cfg.checkpoint

    def boundary(self, cfg, measure: Callable[[], dict | None]):
        """The loop's boundary, after an update's (or a step's) report: the run server's
        sinks act there on what a client asked meanwhile (pause, checkpoint, stop, questions
        answered with the weights as they are; `measure()` is the loop's own evaluation
        without patience, {field: value}, or None without evaluation data). -> the config the
        run follows from here on: `cfg`, or `cfg` with the keys a client changed."""
        return cfg


def boundary(sinks: Sinks, cfg, patience, measure: Callable[[], dict | None]):
    """Every loop's one hook (Sinks.boundary) -> (cfg, rate): the config the run follows from
    here on and the base rate its schedule scales. A changed [training].lr replaces the base:
    the schedule goes on from the same step (a warm-up keeps warming up toward the new rate, a
    decay keeps decaying from it); a changed [evaluation].patience is the limit from now on."""
    cfg = sinks.boundary(cfg, measure)
    if cfg.evaluation is not None:
        patience.patience = cfg.evaluation.patience
    return cfg, base_lr(cfg.training, cfg.optimizer)


def adapter_arrays(named) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{base tensor name: (A, B)} float32 arrays from trained (name, parameter) pairs (base
    tensors among them are skipped)."""
    halves: dict[str, dict[str, np.ndarray]] = {}
    for name, param in named:
        base, half = name.rsplit(".", 1)  # blk.0.attn_q.weight, lora_a
        if half in ("lora_a", "lora_b"):
            halves.setdefault(base, {})[half] = _whole(param).float().cpu().numpy()
    return {base: (h["lora_a"], h["lora_b"]) for base, h in halves.items()}


def base_arrays(trained: Trained) -> dict[str, np.ndarray | RawTensor]:
    """The trained base tensors in their storage types, as the GGUF writer takes them."""
    out: dict[str, np.ndarray | RawTensor] = {}
    for t in trained.base:
        stored = t.stored()
        if stored.dtype == torch.bfloat16:
            out[t.name] = bf16_tensor(stored.view(torch.int16).numpy())
        else:
            out[t.name] = stored.numpy()
    return out


def _as_trained(adapters) -> Trained:
    """Loops that train adapters alone pass their {name: LoRA}; the others a Trained."""
    return adapters if isinstance(adapters, Trained) else Trained(adapters, [])


def export_output(cfg, model, plan, adapters, path: Path | None = None) -> Path:
    """The result, written atomically as [output].kind says (or to `path`): adapter, a
    llama.cpp LoRA GGUF; trainable, the trained tensors (and a hybrid run's adapter); model,
    the whole GGUF with its trained tensors."""
    out = Path(path or cfg.output.path)
    out.parent.mkdir(parents=True, exist_ok=True)
    trained = _as_trained(adapters)
    title = f"{model.gguf.get('general.name', 'model')}"
    kind = cfg.output.kind or "adapter"
    if kind == "model":
        return write_model(
            model.gguf.path, out, base_arrays(trained), name=f"{title} ({plan.mode}, {__version__})"
        )
    factors = adapter_arrays(trained.named())
    if kind == "adapter":
        return write_lora_adapter(
            out,
            architecture=model.config.name,
            tensors=factors,
            alpha=plan.alpha,
            dtype=plan.dtype,
            name=f"{title} LoRA ({__version__})",
        )
    tensors: dict[str, np.ndarray | RawTensor] = base_arrays(trained)
    lora_np = np.float32 if plan.dtype == "f32" else np.float16
    for base, (a, b) in factors.items():
        tensors[f"{base}.lora_a"], tensors[f"{base}.lora_b"] = a.astype(lora_np), b.astype(lora_np)
    meta = {
        "general.name": f"{title} {plan.mode} ({__version__})",
        "retrograd.trainable.mode": plan.mode,
        "retrograd.base_model": model.gguf.path.name,
    }
    if factors:
        meta["adapter.lora.alpha"] = float(plan.alpha)
    return write_trainable(out, architecture=model.config.name, tensors=tensors, metadata=meta)


def export_or_keep(
    cfg, model, run_file, run, mark: Mark, named, optimizer, plan, adapters, patience, total
) -> Path:
    """The final export; when it fails, the trained adapter is kept (a checkpoint, else a file
    beside the run file or in the temporary folder) and the error says where."""
    if not world().main:
        return Path(cfg.output.path)  # rank 0 writes the output
    try:
        return export_output(cfg, model, plan, adapters)
    except Exception as e:  # any failure: the training must not be lost with it
        error = e
    kept = _keep(cfg, model, run_file, run, mark, named, optimizer, plan, adapters, patience, total)
    where = f"kept in {kept}" if kept is not None else "could not be kept anywhere either"
    raise TrainingError(
        f"[output].path = {cfg.output.path}: the {cfg.output.kind or 'adapter'} could not be written "
        f"({type(error).__name__}: {error}); the trained result was {where}"
    ) from error


def _keep(cfg, model, run_file, run, mark, named, optimizer, plan, adapters, patience, total):
    if cfg.checkpoint is not None and not world().active:  # ranks write checkpoints together
        try:
            state = _state(cfg, run, mark, named, optimizer, plan, patience, total)
            directory = cfg.checkpoint.directory
            save_checkpoint(directory, step_id(mark.global_step), state)
            return Path(directory) / f"{step_id(mark.global_step)}.gguf"
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
) -> CheckpointState:
    """Put adapters, optimizer, RNGs and patience back, after checking the checkpoint belongs
    to this run; the loop reads its position from the returned state (dataset, progress,
    artifacts)."""
    state, source = found
    check_world(state, source)
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
    base = state.trainable or {}
    with torch.no_grad():
        for name, param in named if not world().active else ():  # ranks: from dcp/ below
            stem, half = name.rsplit(".", 1)
            if half in ("lora_a", "lora_b"):
                a, b = tensors[stem]
                value = a if half == "lora_a" else b
            else:
                value = base[name]  # a trained base tensor (f32, or its f16 values)
            param.copy_(torch.from_numpy(np.ascontiguousarray(value)).to(param.dtype))
    restore_optimizer(optimizer, [n for n, _ in named], state.optimizer)
    restore_rng(state.rng)
    if world().active:
        restore_state(state, source, named, optimizer)
    patience.best = (
        state.progress.best_metric if state.progress.best_metric is not None else patience.best
    )
    patience.stale = state.progress.stale_evaluations
    return state


def cfg_kind(run: RunIdentity) -> str:
    return str(run.trajectory["optimizer"])


def _state(
    cfg, run: RunIdentity, mark: Mark, named, optimizer, plan, patience, total: int
) -> CheckpointState:
    t = cfg.training
    rate = base_lr(t, cfg.optimizer)
    lr = lr_at(max(0, mark.global_step - 1), total, rate, t.lr_scheduler, t.warmup_steps)
    tensors = adapter_arrays(named)
    base = {n: _checkpoint_array(p) for n, p in named if not n.endswith((".lora_a", ".lora_b"))}
    best = patience.best if patience.best != float("inf") else None
    return CheckpointState(
        architecture=run.architecture,
        progress=Progress(
            mark.global_step, mark.epoch, mark.update, best, patience.stale, dict(mark.extra)
        ),
        identity=Identity(
            run.model.signature,
            run.model.bytes,
            run.model.fingerprint,
            run.data_fingerprint,
            run.algorithm,
            # the rate the run follows now: a served run's [training].lr may change mid-run
            {**run.trajectory, "lr": t.lr, "base_lr": rate},
            __version__,
        ),
        scheduler=SchedulerState(t.lr_scheduler, mark.global_step, total, rate, t.warmup_steps, lr),
        optimizer=optimizer_state(
            optimizer,
            [n for n, _ in named],
            kind=t.optimizer,
            hyper={"lr": t.lr, "weight_decay": t.weight_decay, "max_grad_norm": t.max_grad_norm},
            slots=not world().active,  # a distributed checkpoint's slots are in its dcp/
        ),
        rng=capture_rng(seeds={"lora": plan.seed}),
        dataset=mark.dataset,
        adapter=AdapterState(plan.rank, plan.alpha, plan.dtype, tensors) if plan.rank else None,
        trainable=base or None,
        trainable_plan=plan.as_dict(),
        artifacts={name: make() for name, make in mark.artifacts.items()},
    )


def _checkpoint_array(param: torch.Tensor) -> np.ndarray:
    """A trained base tensor as a checkpoint keeps it, exactly: f32 or f16 as it is, bf16
    widened to f32 (bf16 -> f32 -> bf16 loses nothing)."""
    p = _whole(param).cpu()
    return p.numpy() if p.dtype in (torch.float32, torch.float16) else p.float().numpy()


def checkpoint_due(cfg, before: int, after: int, section=None) -> bool:
    """Whether a `steps` checkpoint falls in optimizer steps (before, after]: a loop that
    makes several steps between two points where it can stop checks them at once. `section`
    replaces cfg.checkpoint (Sinks.checkpoint_section)."""
    ck = cfg.checkpoint if section is None else section
    if ck is None or ck.mode not in ("steps", "steps_and_best_eval"):
        return False
    return after // ck.every_steps > before // ck.every_steps


def maybe_checkpoint(
    cfg, run, mark: Mark, named, optimizer, plan, patience, total, sinks, before=None
) -> None:
    """A `steps` checkpoint when one is due at mark.global_step (or anywhere after `before`),
    or when the sinks ask for one."""
    before = mark.global_step - 1 if before is None else before
    ck = sinks.checkpoint_section(cfg)
    requested = ck is not None and sinks.checkpoint_requested()
    if not (checkpoint_due(cfg, before, mark.global_step, ck) or requested):
        return
    state = _state(cfg, run, mark, named, optimizer, plan, patience, total)
    path = _save(ck.directory, step_id(mark.global_step), state, named, optimizer)
    sinks.checkpoint(path, mark.global_step)


def save_best(cfg, run, mark: Mark, named, optimizer, plan, patience, total, sinks) -> None:
    ck = sinks.checkpoint_section(cfg)
    if ck is None or ck.mode not in ("best_eval", "steps_and_best_eval"):
        return
    state = _state(cfg, run, mark, named, optimizer, plan, patience, total)
    path = _save(ck.directory, "best", state, named, optimizer)
    sinks.checkpoint(path, mark.global_step)


def _save(directory, checkpoint_id: str, state: CheckpointState, named, optimizer) -> Path:
    """One process writes the checkpoint; several ranks write it together (distributed/)."""
    if world().active:
        return save_state(directory, checkpoint_id, state, named, optimizer)
    return save_checkpoint(directory, checkpoint_id, state)


def _whole(param: torch.Tensor) -> torch.Tensor:
    """A trained tensor's full value, detached: fsdp2's shards gathered (every rank calls)."""
    p = param.detach()
    return p.full_tensor() if hasattr(p, "full_tensor") else p
