"""A run's result, written as [output].kind says, and kept elsewhere when that write fails.

adapter: a llama.cpp LoRA GGUF; trainable: the trained tensors (and a hybrid run's adapter);
model: the whole GGUF with its trained tensors. Rank 0 writes; the training is never lost with
a failed write: a checkpoint of the run's state, else a file beside the run file or in the
temporary folder, and the error says where. Knows no loop and no algorithm.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from retrograd.checkpoint.layout import step_id
from retrograd.checkpoint.outputs import rescue_paths
from retrograd.checkpoint.run import adapter_arrays
from retrograd.checkpoint.state import CheckpointState
from retrograd.checkpoint.store import save_checkpoint
from retrograd.distributed import world
from retrograd.errors import TrainingError
from retrograd.gguf import RawTensor
from retrograd.gguf.lora_export import write_lora_adapter
from retrograd.gguf.model_export import bf16_tensor, write_model, write_trainable
from retrograd.trainable.plan import Trained
from retrograd.version import __version__


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


def export_output(cfg, model, plan, trained: Trained, path: Path | None = None) -> Path:
    """The result, written atomically as [output].kind says (or to `path`)."""
    out = Path(path or cfg.output.path)
    out.parent.mkdir(parents=True, exist_ok=True)
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
    cfg,
    model,
    plan,
    trained: Trained,
    run_file,
    state: Callable[[], CheckpointState],
    global_step: int,
) -> Path:
    """The final export; when it fails, the trained result is kept (a checkpoint of
    `state()` at `global_step`, else a file beside the run file or in the temporary folder)
    and the error says where."""
    if not world().main:
        return Path(cfg.output.path)  # rank 0 writes the output
    try:
        return export_output(cfg, model, plan, trained)
    except Exception as e:  # any failure: the training must not be lost with it
        error = e
    kept = _keep(cfg, model, plan, trained, run_file, state, global_step)
    where = f"kept in {kept}" if kept is not None else "could not be kept anywhere either"
    raise TrainingError(
        f"[output].path = {cfg.output.path}: the {cfg.output.kind or 'adapter'} could not be written "
        f"({type(error).__name__}: {error}); the trained result was {where}"
    ) from error


def _keep(cfg, model, plan, trained, run_file, state, global_step: int) -> Path | None:
    if cfg.checkpoint is not None and not world().active:  # ranks write checkpoints together
        try:
            directory = cfg.checkpoint.directory
            save_checkpoint(directory, step_id(global_step), state())
            return Path(directory) / f"{step_id(global_step)}.gguf"
        except Exception:
            pass
    for place in rescue_paths(Path(cfg.output.path), run_file):
        try:
            return export_output(cfg, model, plan, trained, path=place)
        except Exception:
            continue
    return None
