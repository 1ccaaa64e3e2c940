"""Evaluate without training: the base model, and an adapter beside it, on the same examples.

What it measures follows [run].algorithm (BENCHES):
  sft          loss and perplexity on assistant tokens
  ppo, grpo    the reward distribution of sampled answers (one per prompt; --answers N)
  distill      KL to the teacher, top-1 agreement and perplexity (loads the teacher)
  agent_grpo   not supported (its held-out evaluation runs inside `train`)
  preference   not supported (a run with [evaluation] reports its preference accuracy)

Without --adapter it measures the base model; with it, the base model and the adapter on the
same examples, side by side. --data defaults to [evaluation].data. For ppo and grpo, each
prompt is answered as the run samples ([ppo.sampling] or [grpo.sampling], fixed seeds: the
base model and the adapter answer with the same random numbers), once or --answers N times,
and scored by the run's reward program; the table gives mean, its standard error over the
prompts, standard deviation, quartiles and the share of answers above 0. Answer 0 to each
prompt is the one a training run's held-out evaluation samples (the same seed; on a bf16 path
the wider batch of --answers rounds differently and can change a rare one), answer k comes
from its own fixed seed. More answers give a steadier mean: 32 prompts answered once measure
a policy that is right 95% of the time to about +-0.04.

Scores in float32, whatever the device's fast dtype: the model's logits equal llama.cpp's on
the same weights and the loss is their log-softmax in float32 (docs/exactness.md). On a CPU
without bf16 instructions (AVX2) that is also the fast path: the bf16 path scored Gemma 3
270M 3.6-4.5x slower. On AMX, AVX512-BF16 or a GPU, bf16 would be faster; float32 is kept
there too. A non-finite loss stops with an error naming the example, never a nan in a table.

Example:
  retrograd bench run.toml --adapter out/adapter.gguf --limit 50
  retrograd bench grpo.toml --adapter out/grpo.gguf --answers 8
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
from retrograd.text import newline_split

# [run].algorithm -> what bench measures of it; the other algorithms are refused
BENCHES = {
    "sft": "loss",
    "ppo": "rewards",
    "grpo": "rewards",
    "distill": "KL to the teacher",
}
MAX_ANSWERS = 256  # --answers: as [grpo].group_size


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
    p.add_argument(
        "--answers",
        type=int,
        metavar="N",
        help=f"ppo, grpo: sampled answers to each prompt, 1 to {MAX_ANSWERS} (default 1: the "
        "one a training run's evaluation samples); more give a steadier mean",
    )
    add_model_flag(p, required=False)
    add_device_flag(p)
    p.set_defaults(device=None)


def run(args: argparse.Namespace) -> int:
    from retrograd.config import load_run

    cfg = load_run(args.config, model=args.model, device=args.device)
    if cfg.run.algorithm not in BENCHES:
        raise ConfigError(
            f"{args.config}: bench for [run].algorithm = {cfg.run.algorithm!r} "
            f"is not available in this version ({', '.join(BENCHES)} are)"
        )
    data = args.data or (str(cfg.evaluation.data) if cfg.evaluation else None)
    if data is None and cfg.run.algorithm == "distill" and cfg.distill.mode == "topk_offline":
        data = str(cfg.distill.data)  # offline runs have no [evaluation]: the corpus itself
    if data is None:
        raise ConfigError(f"{args.config}: no data to bench: pass --data or set [evaluation].data")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit {args.limit}: must be at least 1")
    if args.ctx is not None and args.ctx < 2:
        raise ConfigError(f"--ctx {args.ctx}: must be at least 2")
    if args.answers is not None:
        if cfg.run.algorithm not in ("ppo", "grpo"):
            raise ConfigError(
                f"--answers: samples answers for ppo and grpo runs; a {cfg.run.algorithm} "
                "run's bench scores the data's own tokens"
            )
        if not 1 <= args.answers <= MAX_ANSWERS:
            raise ConfigError(f"--answers {args.answers}: must be 1 to {MAX_ANSWERS}")
    if cfg.run.algorithm in ("ppo", "grpo", "distill"):
        if args.format not in (None, "auto", "jsonl"):
            raise ConfigError(f"--format {args.format}: {cfg.run.algorithm} data is chat JSONL")
    if cfg.run.algorithm in ("ppo", "grpo"):
        return bench_rewards(cfg, data, args)
    if cfg.run.algorithm == "distill":
        return bench_distill(cfg, data, args)
    return bench_sft(cfg, data, args)


def bench_rewards(cfg, data: str, args) -> int:
    """The reward distribution of sampled answers (--answers to each prompt, default one),
    base model and adapter, with the mean's standard error over the prompts."""
    import numpy as np

    from retrograd.algorithms import context
    from retrograd.algorithms.evaluate import held_out_rewards
    from retrograd.data.prompts import read_prompts, render_prompts
    from retrograd.rewards.program import reward_program
    from retrograd.sampling import Sampler
    from retrograd.sampling.engine import run_settings
    from retrograd.trainable.lora import apply_adapter_file

    con = Console()
    algorithm = cfg.run.algorithm
    g, ctx = getattr(cfg, algorithm), args.ctx or cfg.training.ctx
    lines = read_prompts(data, "--data" if args.data else "[evaluation].data")
    model = context.load_model(cfg)
    con.print(f"model: {model.gguf.path.name}; {model.report.describe()}")
    for line in model.report.lines():  # the compute plan
        con.print(line, markup=False)
    prompts = render_prompts(lines, context.chat_format(model), ctx)[: args.limit]
    con.print(f"prompts: {lines.path.name}, answering {len(prompts)}")
    sampler = Sampler(model.decoder, model.tokenizer, max_len=ctx, **run_settings(cfg.training))
    adapters = apply_adapter_file(model.decoder, args.adapter) if args.adapter else {}
    k = args.answers or 1
    each = "one sampled answer" if k == 1 else f"{k} sampled answers"
    table = Table(title=f"{algorithm} bench ({each} per prompt)", title_justify="left")
    for col in (
        "model",
        "mean",
        "± se",
        "std",
        "min",
        "25%",
        "median",
        "75%",
        "max",
        "> 0",
        "tokens",
        "seconds",
    ):
        table.add_column(col, justify="left" if col == "model" else "right")
    with reward_program(g, f"[{algorithm}]") as program:
        for label, enabled in [("base", False)] + ([(args.adapter, True)] if args.adapter else []):
            for lo in adapters.values():
                lo.enabled = enabled
            t = time.perf_counter()
            rewards, answers = held_out_rewards(
                sampler, program, prompts, g.sampling, answers_per_prompt=k
            )
            r = np.array(rewards)
            q = np.quantile(r, [0.25, 0.5, 0.75])
            table.add_row(
                str(label),
                f"{r.mean():.4f}",
                standard_error(r.reshape(len(prompts), k)),
                f"{r.std():.4f}",
                f"{r.min():.3f}",
                *(f"{v:.3f}" for v in q),
                f"{r.max():.3f}",
                f"{(r > 0).mean():.0%}",
                str(sum(len(a.ids) for a in answers)),
                f"{time.perf_counter() - t:.1f}",
            )
    con.print(table)
    return 0


def standard_error(rewards) -> str:
    """The standard error of the mean reward over prompts (rows: a prompt's answers): the
    spread of the prompts' means over the square root of their number; "-" for one prompt."""
    means = rewards.mean(axis=1)
    if len(means) < 2:
        return "-"
    return f"{means.std(ddof=1) / math.sqrt(len(means)):.4f}"


def bench_distill(cfg, data: str, args) -> int:
    """KL to the teacher, top-1 agreement and perplexity on the data's assistant tokens, for
    the base model, the adapter and the teacher itself. A file of prompts (last turn a user
    message: an on-policy run's [evaluation].data) is answered by the teacher first, sampled
    as [distill.sampling] says with seeds fixed per line, and the models compared on those
    answers."""
    from retrograd.algorithms import context
    from retrograd.algorithms.evaluate import perplexity, teacher_agreement
    from retrograd.model.model import load
    from retrograd.trainable.lora import apply_adapter_file

    con = Console()
    ctx = args.ctx or cfg.training.ctx
    model = load_float32(cfg)
    con.print(f"model: {model.gguf.path.name}; {model.report.describe()}")
    teacher = load(
        cfg.distill.teacher_path,
        device=cfg.model.device,
        dtype=model.dtype,
        threads=cfg.training.threads,
    )
    context.check_same_tokenizer(model, teacher, "[distill].teacher_path")
    con.print(f"teacher: {teacher.gguf.path.name}")
    chat = context.chat_format(model)
    ds = _distill_data(cfg, data, args, chat, teacher, ctx)
    n = min(len(ds.examples), args.limit or len(ds.examples))
    con.print(f"data: {ds.describe()}; scoring {n}")
    table = Table(
        title="distill bench (assistant tokens, float32): KL = KL(teacher ‖ model), reverse = "
        "KL(model ‖ teacher), nats per token; top-1 = the two most likely tokens agree",
        title_justify="left",
    )
    cols = ("model", "KL", "reverse", "top-1", "perplexity")
    for col in (*cols, "tokens", "seconds"):
        table.add_column(col, justify="left" if col == "model" else "right")
    adapters = apply_adapter_file(model.decoder, args.adapter) if args.adapter else {}
    rows = [("base", False)] + ([(args.adapter, True)] if args.adapter else [])
    for label, enabled in rows:
        for lo in adapters.values():
            lo.enabled = enabled
        t = time.perf_counter()
        a = teacher_agreement(model.decoder, teacher.decoder, ds, n)
        _add_agreement(table, Path(label).name, a, perplexity, time.perf_counter() - t)
    t = time.perf_counter()
    a = teacher_agreement(teacher.decoder, teacher.decoder, ds, n)
    _add_agreement(table, "teacher", a, perplexity, time.perf_counter() - t)
    con.print(table)
    return 0


def _add_agreement(table, label: str, a, perplexity, seconds: float) -> None:
    if not all(math.isfinite(v) for v in (a.kl, a.reverse_kl, a.nll)):
        raise RetrogradError(
            f"{label}: a non-finite score (KL {a.kl}, NLL {a.nll}); bench reports no number "
            "(does the model or adapter hold a non-finite weight?)"
        )
    table.add_row(
        label,
        f"{a.kl:.4f}",
        f"{a.reverse_kl:.4f}",
        f"{a.top1:.1%}",
        f"{perplexity(a.nll):.2f}",
        str(a.tokens),
        f"{seconds:.1f}",
    )


def _distill_data(cfg, data: str, args, chat, teacher, ctx: int):
    """The examples to compare on: the chat file as SFT reads it, or, for a file of prompts,
    each prompt with the teacher's sampled answer."""
    from retrograd import nesting
    from retrograd.algorithms.distill import EVALUATE
    from retrograd.data.prompts import read_prompts, render_prompts
    from retrograd.data.sft import Example, SFTDataset, load_sft_data
    from retrograd.errors import DataError
    from retrograd.sampling import Sampler
    from retrograd.sampling.params import SampleRequest, SamplingParams
    from retrograd.seeds import derive_seed

    path = Path(data)
    try:
        first = next(
            line for line in newline_split(path.read_text(encoding="utf-8")) if line.strip()
        )
        messages = nesting.loads(first).get("messages") or [{}]  # too deep: a ValueError
        prompts_only = messages[-1].get("role") != "assistant"
    except (OSError, StopIteration, ValueError, AttributeError, TypeError):
        prompts_only = False  # load_sft_data says what is wrong
    if not prompts_only:
        return load_sft_data(path, chat.tokenizer, ctx, "jsonl", chat)
    where = "--data" if args.data else "[evaluation].data"
    lines = read_prompts(path, where)
    prompts = render_prompts(lines, chat, ctx)[: args.limit]
    if cfg.distill.mode == "on_policy":
        s = cfg.distill.sampling
        params, seed = SamplingParams(s.temperature, s.top_p, s.max_new_tokens), s.seed
    else:
        params, seed = SamplingParams(1.0, 1.0, 128), 0
    sampler = Sampler(teacher.decoder, teacher.tokenizer, fast=False, max_len=ctx)
    requests = [
        SampleRequest(p.ids, params, seeds=(derive_seed(seed, EVALUATE, 0, i),))
        for i, p in enumerate(prompts)
    ]
    examples = []
    for p, [a] in zip(prompts, sampler.generate(requests), strict=True):
        ids = tuple(p.ids) + tuple(a.ids)
        if a.ids:
            mask = (0,) * len(p.ids) + (1,) * len(a.ids)
            examples.append(Example(ids[:ctx], mask[:ctx], p.key))
    if not examples:
        raise DataError(f"{where} = {path}: the teacher answered no prompt with a token")
    digest = lines.fingerprint
    return SFTDataset(path, "jsonl", tuple(examples), digest, len(prompts), 0, 0)


def load_float32(cfg):
    """The run's model with float32 compute, whatever the device's fast dtype: bench reports
    the numbers llama.cpp computes, not those of the 16-bit training path."""
    import torch

    from retrograd.model.model import load

    return load(
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
