"""Evaluate without training: loss and perplexity on assistant tokens (sft runs).

Without --adapter it measures the base model; with it, the base model and the adapter on the
same examples, side by side. --data defaults to [evaluation].data.

Scores in float32, whatever the device's fast dtype: the model's logits equal llama.cpp's on
the same weights and the loss is their log-softmax in float32 (docs/exactness.md). On a CPU
without bf16 instructions (AVX2) that is also the fast path: the bf16 path scored Gemma 3
270M 3.6-4.5x slower. On AMX, AVX512-BF16 or a GPU, bf16 would be faster; float32 is kept
there too. A non-finite loss stops with an error naming the example, never a nan in a table.

Example:
  retrograd bench run.toml --adapter out/adapter.gguf --limit 50
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from retrograd.cli.common import add_device_flag, add_model_flag
from retrograd.errors import ConfigError, RetrogradError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG.toml", help="the run file")
    p.add_argument("--data", metavar="FILE", help="examples to score (default: [evaluation].data)")
    p.add_argument("--adapter", metavar="ADAPTER.gguf", help="also score this LoRA adapter")
    p.add_argument("--limit", type=int, metavar="N", help="score the first N examples only")
    p.add_argument(
        "--format",
        choices=("auto", "text", "jsonl"),
        default=None,
        help="data format (default: [sft].data_format, else inferred)",
    )
    p.add_argument("--ctx", type=int, metavar="N", help="context length (default: [training].ctx)")
    add_model_flag(p, required=False)
    add_device_flag(p)
    p.set_defaults(device=None)


def run(args: argparse.Namespace) -> int:
    from retrograd.config import load_run

    cfg = load_run(args.config, model=args.model, device=args.device)
    if cfg.run.algorithm != "sft":
        raise ConfigError(
            f"{args.config}: bench for [run].algorithm = {cfg.run.algorithm!r} "
            "is not available in this version (sft is)"
        )
    data = args.data or (str(cfg.evaluation.data) if cfg.evaluation else None)
    if data is None:
        raise ConfigError(f"{args.config}: no data to bench: pass --data or set [evaluation].data")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit {args.limit}: must be at least 1")
    if args.ctx is not None and args.ctx < 2:
        raise ConfigError(f"--ctx {args.ctx}: must be at least 2")
    return bench_sft(cfg, data, args)


def load_float32(cfg):
    """The run's model with float32 compute, whatever the device's fast dtype: bench reports
    the numbers llama.cpp computes, not those of the 16-bit training path."""
    import torch

    import retrograd

    return retrograd.load(
        cfg.model.path, device=cfg.model.device, dtype=torch.float32, threads=cfg.training.threads
    )


def bench_sft(cfg, data: str, args) -> int:
    from retrograd.algorithms import context
    from retrograd.algorithms.evaluate import perplexity
    from retrograd.data.sft import infer_format, load_sft_data
    from retrograd.trainable.lora import apply_adapter_file

    con = Console()
    model = load_float32(cfg)
    con.print(f"model: {model.gguf.path.name}; {model.report.describe()}")
    fmt = args.format or cfg.sft.data_format
    chat_fmt = None
    if infer_format(Path(data), fmt) == "jsonl":
        chat_fmt = context.chat_format(model, cfg.sft.template_variables)
    ds = load_sft_data(data, model.tokenizer, args.ctx or cfg.training.ctx, fmt, chat_fmt)
    n = min(len(ds.examples), args.limit or len(ds.examples))
    con.print(f"data: {ds.describe()}; scoring {n}")
    table = Table(title="sft bench (assistant tokens, float32)", title_justify="left")
    for col in ("model", "loss", "perplexity", "tokens", "seconds"):
        table.add_column(col, justify="left" if col == "model" else "right")
    adapters = apply_adapter_file(model.decoder, args.adapter) if args.adapter else {}
    rows = [("base", False)] + ([(args.adapter, True)] if args.adapter else [])
    for label, enabled in rows:
        for lo in adapters.values():
            lo.enabled = enabled
        t = time.perf_counter()
        loss, count = score(model.decoder, ds, n, f"adapter {label}" if enabled else "base model")
        table.add_row(
            str(label),
            f"{loss:.4f}",
            f"{perplexity(loss):.2f}",
            str(count),
            f"{time.perf_counter() - t:.1f}",
        )
    con.print(table)
    return 0


def score(decoder, ds, n: int, who: str) -> tuple[float, int]:
    """(mean NLL, trained tokens) of the first n examples; an error at a non-finite one."""
    from retrograd.algorithms.evaluate import example_nlls

    total, count = 0.0, 0
    for e in example_nlls(decoder, ds, limit=n):
        if not math.isfinite(e.nll):
            raise RetrogradError(
                f"{e.where}: the loss of the {who} is not finite ({e.nll}) over {e.tokens} "
                "tokens; bench reports no number (does the model or adapter hold a non-finite "
                "weight?)"
            )
        total += e.nll
        count += e.tokens
    return total / count, count
