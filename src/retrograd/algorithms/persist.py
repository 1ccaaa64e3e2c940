"""What a loop leaves behind: metrics, checkpoints, resume and the final output.

The SFT loop (and later loops) call these functions at fixed points; this module maps them to
observe/ (progress, TensorBoard, W&B), checkpoint/ (.state directories) and gguf/ (the adapter
export). It knows the run file's sections, not the training math.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrograd import __version__
from retrograd.gguf.lora_export import write_lora_adapter
from retrograd.observe import Metrics, RunInfo, names


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint must match to be resumed by this run."""

    model_path: Path
    data_fingerprint: str
    algorithm: str
    trajectory_signature: str

    @classmethod
    def of(cls, cfg, model, train, plan) -> RunIdentity:
        t = cfg.training
        trajectory = {  # settings that change which steps happen and what they compute
            "ctx": t.ctx,
            "micro_batch": t.micro_batch,
            "gradient_accumulation": t.gradient_accumulation,
            "epochs": t.epochs,
            "lr": t.lr,
            "lr_scheduler": t.lr_scheduler,
            "warmup_steps": t.warmup_steps,
            "optimizer": t.optimizer,
            "weight_decay": t.weight_decay,
            "max_grad_norm": t.max_grad_norm,
            "shuffle": cfg.sft.shuffle,
            "template_variables": cfg.sft.template_variables,
            "plan": plan.as_dict(),
            "seed": cfg.lora.seed if cfg.lora else None,
        }
        sig = hashlib.sha256(
            json.dumps(trajectory, sort_keys=True, default=str).encode()
        ).hexdigest()
        return cls(Path(cfg.model.path), train.fingerprint, cfg.run.algorithm, sig)


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
        self.plan_lines = plan.describe()
        if self.quiet:
            return
        con = self.console
        con.print(f"model: {model.gguf.path.name} ({model.config.name}); {model.report.describe()}")
        con.print(f"data: {train.describe()}")
        if held is not None:
            con.print(f"evaluation: {held.describe()}")
        for line in self.plan_lines:
            con.print(line)
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

    def resumed(self, state, global_step: int) -> None:
        if self.metrics is not None:
            self.console.print(f"resumed from {state.path} at step {global_step}")
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


def adapter_arrays(adapters) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {
        f"{base}.weight": (
            lo.lora_a.detach().float().cpu().numpy(),
            lo.lora_b.detach().float().cpu().numpy(),
        )
        for base, lo in adapters.items()
    }


def export_output(cfg, model, plan, adapters) -> Path:
    """[output] kind adapter: a llama.cpp LoRA GGUF, written atomically."""
    out = Path(cfg.output.path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_lora_adapter(
        out,
        architecture=model.config.name,
        tensors=adapter_arrays(adapters),
        alpha=plan.alpha,
        dtype=plan.dtype,
        name=f"{model.gguf.get('general.name', 'model')} LoRA ({__version__})",
    )


# -- checkpoints (wired to retrograd.checkpoint) -------------------------------------------


def find_resume(cfg, resume):
    return None


def restore(state, run, named, optimizer):
    raise NotImplementedError


def maybe_checkpoint(cfg, run, pos, named, optimizer, plan, patience, sinks) -> None:
    return None


def save_best(cfg, run, pos, named, optimizer, plan, patience, sinks) -> None:
    return None
