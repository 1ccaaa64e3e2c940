"""Build one training step and list the operations the device cannot run.

Runs a forward and backward pass through fresh LoRA adapters on the chosen targets with a
16-token batch, recording the device of every operation. Operations that run elsewhere fall
back to the CPU and slow every step; operations the device refuses break training.
--strict exits with status 1 if there are any. The same check runs when training starts.

Example:
  retrograd preflight --model model.gguf --targets q,k,v --device gpu --strict
"""

from __future__ import annotations

import argparse

from rich.console import Console

from retrograd.cli.common import add_device_flag, add_model_flag


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flag(p)
    p.add_argument(
        "--targets",
        default="auto",
        metavar="LIST",
        help="comma-separated LoRA targets: aliases (q,k,v,o,ffn_gate,ffn_up,ffn_down), "
        "tensor patterns (blk.*.attn_q.weight) or auto (default)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit with status 1 if any operation falls back or fails",
    )
    add_device_flag(p)


def run(args: argparse.Namespace) -> int:
    from retrograd.model.model import load
    from retrograd.trainable.preflight import preflight

    con = Console()
    model = load(args.model, device=args.device)
    con.print(f"model: {model.gguf.path.name} ({model.config.name}); {model.report.describe()}")
    for line in model.report.lines():  # the compute plan
        con.print(line, markup=False)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    report = preflight(model.decoder, targets)
    con.print(
        f"LoRA on {len(report.targets)} linears ({', '.join(sorted({t.split('.')[-1] for t in report.targets}))}); "
        f"{report.n_ops} operations in {report.seconds:.2f} s, loss {report.loss:.3f}"
    )
    for op, n in sorted(report.fallbacks.items()):
        con.print(
            f"[yellow]fallback[/]: {op} ran with tensors off {report.device.type} ({n} calls)"
        )
    for op, err in sorted(report.failures.items()):
        con.print(f"[red]unsupported[/]: {op}: {err}")
    if not report.problems:
        con.print(f"[green]ok[/]: every operation ran on {report.device.type}")
        return 0
    return 1 if args.strict else 0
