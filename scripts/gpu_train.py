"""The training parts of `make gpu-check`: SFT, GRPO and DPO steps, the memory knobs, two ranks
under torchrun, and bench/scale.py at 8B.

Each function takes the driver's Setting and returns an Outcome (scripts/gpu_check.py), in a
process of its own. Run files come from tests/factories/run_files.py on the examples' data
(examples/demo, examples/grpo, examples/preference); training computes in bf16
(RETRO_DTYPE=bfloat16) on the Setting's device. Nothing here knows budgets or verdict lines.
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from retrograd.observe.sinks import Sinks
from scripts.gpu_check import REPO, Findings, judged, skipped

EXAMPLES = REPO / "examples"
LN2 = math.log(2.0)
DPO_FIRST_BOUND = 1e-2  # |first DPO loss - ln 2|: policy and reference are the same weights
GAP_BOUND = 0.5  # mean |sampler - trainer| log-probability of GRPO's answers, bf16 both
KNOB_LOSS_BOUND = 2e-2  # first loss of a memory knob against the baseline's, relative
ADAPTER_MOVES = 1e-3  # the least a trained adapter must move llama.cpp's logits
# GRPO's reward (retrograd-reward/1, docs/rewards.md): the share of "e" in the answer, which
# differs between any model's answers, so every group has advantages and every update steps
REWARD = r"""
import json, sys
for line in sys.stdin:
    req = json.loads(line)
    if "protocol" in req or "_retrograd_batch_end" in req:
        print(json.dumps(req), flush=True)
        continue
    text = req["completion"]
    reply = {"reward": text.count("e") / max(1, len(text))}
    reply.update((k, req[k]) for k in ("_retrograd_batch", "_retrograd_index"))
    print(json.dumps(reply), flush=True)
"""


class Recorder(Sinks):
    """Quiet sinks that keep each optimizer step's metrics."""

    def __init__(self):
        super().__init__(quiet=True)
        self.steps: list[dict] = []

    def step(self, global_step, epoch, values, tokens, seconds, position=None) -> None:
        self.steps.append({**values, "epoch": epoch, "step": global_step})


def run_device(setting) -> str:
    return "gpu" if setting.device == "cuda" else "cpu"


def bf16() -> None:
    os.environ["RETRO_DTYPE"] = "bfloat16"


def first_lines(path: Path, n: int) -> str:
    return "\n".join(path.read_text().splitlines()[:n]) + "\n"


def sft_run(work: Path, setting, *, device=None, resident=False, steps=4, epochs=1, training=None):
    """An SFT run file in `work` on the pirate examples: `steps` conversations, one window of
    128 tokens a step."""
    from tests.factories.run_files import write_run_file

    work.mkdir(parents=True, exist_ok=True)
    (work / "train.jsonl").write_text(first_lines(EXAMPLES / "demo" / "pirate-train.jsonl", steps))
    t = {"lr": 2e-3, "epochs": epochs, "ctx": 128, "micro_batch": 128}
    t.update(training or {})
    if resident:
        t["require_gpu_resident"] = True
    tables = {"training": t, "sft": {"data": "train.jsonl", "shuffle": False}}
    return write_run_file(
        work, "sft", Path(setting.model), tables, device=device or run_device(setting)
    )


def epoch_means(losses: list[float], epochs: list[int]) -> tuple[float, float]:
    firsts = [x for x, e in zip(losses, epochs, strict=True) if e == min(epochs)]
    lasts = [x for x, e in zip(losses, epochs, strict=True) if e == max(epochs)]
    return sum(firsts) / len(firsts), sum(lasts) / len(lasts)


def losses_checked(f: Findings, losses: list[float], what: str) -> bool:
    """Whether the run stepped with finite losses (a problem otherwise)."""
    f.figures["losses"] = losses
    if not losses:
        f.problems.append(f"{what}: no step ran")
    elif not all(math.isfinite(x) for x in losses):
        f.problems.append(f"{what}: a loss is not finite: {losses}")
    return not f.problems


# -- SFT, GRPO, DPO ----------------------------------------------------------------------------


def train_in(loop, run: Path, sinks=None):
    """loop(cfg) of the run file, from its folder -> (its result, seconds)."""
    from retrograd.config import load_run

    cfg = load_run(run)
    os.chdir(run.parent)
    t0 = time.perf_counter()
    result = loop(cfg, sinks=sinks)
    return result, time.perf_counter() - t0


def falling(f: Findings, losses, epochs) -> None:
    """The mean loss of the last epoch below the first's (the same examples each epoch)."""
    first, last = epoch_means(losses, epochs)
    f.figures["epoch_means"] = [first, last]
    f.notes.append(f"mean loss epoch 1 {first:.4f} -> epoch {max(epochs) + 1} {last:.4f}")
    if not last < first:
        f.problems.append("the loss did not fall over the epochs")


def sft(setting):
    from retrograd.algorithms.sft import run_sft
    from retrograd.observe import names

    bf16()
    epochs = 2 if setting.quick else 3
    rec = Recorder()
    run = sft_run(Path(setting.work), setting, steps=4, epochs=epochs)
    result, seconds = train_in(run_sft, run, rec)
    losses = [s[names.TRAIN_LOSS] for s in rec.steps]
    f = Findings()
    f.notes.append(f"{len(losses)} steps in {seconds:.1f} s")
    if losses_checked(f, losses, "sft"):
        falling(f, losses, [s["epoch"] for s in rec.steps])
    adapter_check(f, setting, result.output, must_move=True)
    return f.outcome()


def grpo(setting):
    from retrograd.algorithms.grpo import run_grpo
    from retrograd.observe import names
    from tests.factories.run_files import write_run_file

    bf16()
    work = Path(setting.work)
    (work / "prompts.jsonl").write_text(first_lines(EXAMPLES / "grpo" / "plurals.jsonl", 4))
    (work / "reward.py").write_text(REWARD)
    updates = 2 if setting.quick else 3
    g = {"prompts": "prompts.jsonl", "reward_command": [sys.executable, str(work / "reward.py")]}
    g.update(updates=updates, prompts_per_update=2, group_size=4, grpo_epochs=1)
    g.update(clip_range_low=0.2, clip_range_high=0.28, kl_coefficient=0.0)
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8, "seed": 1}
    tables = {"training": {"lr": 1e-3, "ctx": 256, "micro_batch": 256}, "grpo": g}
    tables["grpo.sampling"] = sampling
    rec = Recorder()
    run = write_run_file(work, "grpo", Path(setting.model), tables, device=run_device(setting))
    result, seconds = train_in(run_grpo, run, rec)
    losses = [s[names.TRAIN_LOSS] for s in rec.steps if names.TRAIN_LOSS in s]
    gaps = [s[names.SAMPLER_LOGPROB_GAP] for s in rec.steps if names.SAMPLER_LOGPROB_GAP in s]
    f = Findings()
    f.figures.update(rewards=result.curve, gaps=gaps, seconds=seconds)
    f.notes.append(f"{result.iterations} updates, {len(losses)} steps in {seconds:.1f} s")
    f.notes.append(f"rewards {', '.join(f'{r:.2f}' for r in result.curve)}")
    losses_checked(f, losses, "grpo")
    if result.iterations != updates:
        f.problems.append(f"{result.iterations} of {updates} updates ran ({result.stopped})")
    if not gaps:
        f.problems.append("no policy/sampler_logprob_gap reported")
    for gap in gaps:
        f.bound(gap, GAP_BOUND, "policy/sampler_logprob_gap")
    f.notes.append(f"sampler-trainer log-prob gap up to {max(gaps, default=float('nan')):.1e}")
    adapter_check(f, setting, result.output, must_move=False)
    return f.outcome()


def dpo(setting):
    from retrograd.algorithms.preference import run_preference
    from tests.factories.run_files import write_run_file

    bf16()
    work = Path(setting.work)
    (work / "pairs.jsonl").write_text(first_lines(EXAMPLES / "preference" / "plurals.jsonl", 8))
    epochs = 2 if setting.quick else 3
    p = {"data": "pairs.jsonl", "loss": "dpo", "beta": 0.1, "reference": "initial"}
    p["pairs_per_step"] = 2
    t = {"lr": 2e-3, "epochs": epochs, "ctx": 256, "micro_batch": 256}
    tables = {"training": t, "preference": p}
    run = write_run_file(
        work, "preference", Path(setting.model), tables, device=run_device(setting)
    )
    result, seconds = train_in(run_preference, run)
    losses = result.curve
    f = Findings()
    f.notes.append(f"{len(losses)} steps in {seconds:.1f} s")
    if losses_checked(f, losses, "dpo"):
        f.notes.append(f"first loss {losses[0]:.4f} (ln 2 = {LN2:.4f})")
        f.bound(abs(losses[0] - LN2), DPO_FIRST_BOUND, "|first loss - ln 2|")
        per = len(losses) // epochs
        falling(f, losses, [min(i // per, epochs - 1) for i in range(len(losses))])
    adapter_check(f, setting, result.output, must_move=True)
    return f.outcome()


def adapter_check(f: Findings, setting, adapter: Path, *, must_move: bool) -> None:
    """The written adapter: our loader applies it; llama.cpp loads it (--lora, through
    llama-cpp-python), its logits finite and moved by it; top-1 agreement with ours."""
    import numpy as np
    import torch

    import retrograd
    from retrograd.algorithms.context import chat_format

    if not Path(adapter).is_file():
        f.problems.append(f"no adapter written at {adapter}")
        return
    model = retrograd.load(setting.model, device="cpu", dtype=torch.float32, adapter=adapter)
    ids = chat_format(model).prompt_ids([{"role": "user", "content": "Plural of mouse:"}])
    ids += model.tokenize("Arr, mice be many.", add_bos=False)
    with torch.no_grad():
        ours = model.logits(ids).numpy()
    if not setting.llama_cpp:
        f.notes.append("llama.cpp not installed: the adapter checked by our loader only")
        return
    from tests.oracles.llama_oracle import llama_logits

    threads = os.cpu_count() or 2
    ref = llama_logits(Path(setting.model), ids, lora_path=str(adapter), threads=threads)
    base = llama_logits(Path(setting.model), ids, threads=threads)
    moved = float(np.abs(ref - base).max())
    top1 = float((ours.argmax(-1) == ref.argmax(-1)).mean())
    f.figures["adapter"] = {"llama_cpp_moved": moved, "top1_vs_ours": top1}
    f.notes.append(
        f"llama.cpp --lora loads it: moves logits {moved:.2e}, top-1 with ours {top1:.0%}"
    )
    if not np.isfinite(ref).all():
        f.problems.append("llama.cpp's logits with the adapter are not finite")
    if must_move and moved < ADAPTER_MOVES:
        f.problems.append(f"the adapter moves llama.cpp's logits by only {moved:.1e}")


# -- memory knobs --------------------------------------------------------------------------------


def knob_settings() -> dict[str, tuple[dict, str | None]]:
    """name -> ([training] keys over the baseline, RETRO_DEQUANT_CACHE): bench/memory_knobs.py's
    settings, then the dequantized-weight cache forced on and off."""
    from bench.memory_knobs import SETTINGS

    table = {name: (keys, None) for name, keys in SETTINGS.items()}
    table["dequant cache on (RETRO_DEQUANT_CACHE=1)"] = ({}, "1")
    table["dequant cache off (RETRO_DEQUANT_CACHE=0)"] = ({}, "0")
    return table


def memory_knobs(setting):
    import torch

    bf16()
    ctx = 64 if setting.quick else 512
    rows, problems = [], []
    for i, (name, (keys, cache)) in enumerate(knob_settings().items()):
        row = {"setting": name}
        try:
            row.update(one_knob(Path(setting.work) / f"k{i}", setting, ctx, keys, cache))
        except Exception as e:  # noqa: BLE001 - each knob is reported on its own
            row["error"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
            problems.append(f"{name}: {row['error']}")
        rows.append(row)
        gc.collect()
        if setting.device == "cuda":
            torch.cuda.empty_cache()
    base = rows[0].get("first_loss")
    for row in rows:
        loss = row.get("first_loss")
        if "error" in row:
            continue
        if loss is None or not math.isfinite(loss):
            problems.append(f"{row['setting']}: no finite first loss ({loss})")
        elif base is not None and math.isfinite(base):
            row["loss_vs_base"] = abs(loss - base) / abs(base)
            if row["loss_vs_base"] > KNOB_LOSS_BOUND:
                problems.append(f"{row['setting']}: first loss {loss:.4f}, baseline {base:.4f}")
    peaks = ", ".join(knob_summary(r) for r in rows)
    reason = f"ctx {ctx}, {len(rows)} settings: {peaks}"
    return judged(problems, reason, settings=rows)


def knob_summary(row: dict) -> str:
    if "error" in row:
        return f"{row['setting']} failed"
    peak = row.get("peak_cuda_mib")
    where = f"{peak:.0f} MiB" if peak is not None else f"{row['seconds']:.1f} s"
    return f"{row['setting'].split(' (')[0]} {where}"


def one_knob(work: Path, setting, ctx: int, keys: dict, cache: str | None) -> dict:
    """SFT over a few windows of text (two of Gemma's at ctx 512) with these [training] keys ->
    first loss, peak memory."""
    import torch

    from bench.memory_knobs import TEXT
    from retrograd.algorithms.sft import run_sft
    from retrograd.observe import names
    from tests.factories.run_files import write_run_file

    work.mkdir(parents=True, exist_ok=True)
    (work / "data.txt").write_text(TEXT * (ctx * 2 // 25 + 2))
    t = {"ctx": ctx, "micro_batch": ctx, "lr": 1e-4, "epochs": 1, **keys}
    if t["micro_batch"] == "ctx/4":
        t["micro_batch"] = ctx // 4
    extra = {"lora": None} if t.get("trainable") == "full" else None
    tables = {"training": t, "sft": {"data": "data.txt", "shuffle": False}}
    run = write_run_file(
        work, "sft", Path(setting.model), tables, extra, device=run_device(setting)
    )
    if cache is not None:
        os.environ["RETRO_DEQUANT_CACHE"] = cache
    cuda = setting.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rec = Recorder()
    try:
        _, seconds = train_in(run_sft, run, rec)
    finally:
        os.environ.pop("RETRO_DEQUANT_CACHE", None)
    out = {"seconds": seconds, "steps": len(rec.steps)}
    out["first_loss"] = rec.steps[0][names.TRAIN_LOSS] if rec.steps else None
    if cuda:
        out["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / (1 << 20)
    return out


# -- two ranks -----------------------------------------------------------------------------------


def two_ranks(setting):
    """torchrun --nproc_per_node 2 of one SFT run: nccl on two GPUs, gloo on the CPU."""
    import gguf
    import numpy as np

    if setting.device == "cuda" and setting.gpus < 2:
        return skipped(f"{setting.gpus} GPU: nccl on two ranks needs two")
    backend = "nccl" if setting.device == "cuda" else "gloo"
    work = Path(setting.work)
    training = {"ctx": 128, "micro_batch": 64, "gradient_accumulation": 2}
    run = sft_run(work, setting, steps=4, training=training)
    run.write_text(run.read_text().replace("[run]\n", "[run]\nverbose = true\n", 1))
    env = {"OMP_NUM_THREADS": "1", "RETRO_THREADS": "1", "RETRO_DTYPE": "bfloat16"}
    if backend == "gloo":
        env["RETRO_COMPILE"] = "0"  # as tests/e2e/test_distributed.py: two ranks on few cores
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*launcher, "--nproc_per_node", "2", "-m", "retrograd.cli.main", "train", str(run)]
    t0 = time.perf_counter()
    done = subprocess.run(
        cmd,
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ | env,
    )
    seconds = time.perf_counter() - t0
    text = done.stdout
    print(text)  # into this part's log
    problems, figures = [], {"seconds": seconds, "backend": backend}
    if done.returncode != 0:
        last = [s for s in text.strip().splitlines() if s.strip()][-3:]
        return judged([f"torchrun exited {done.returncode}: {' | '.join(last)}"], backend)
    ranks = set(re.findall(r"rank (\d) of 2 \((\w+)", text))
    figures["ranks"] = sorted(ranks)
    if ranks != {("0", backend), ("1", backend)}:
        problems.append(f"the ranks did not report {backend}: {sorted(ranks)}")
    adapter = work / "out" / "adapter.gguf"
    if not adapter.is_file():
        problems.append("no adapter written")
    else:
        b = [t for t in gguf.GGUFReader(adapter).tensors if "lora_b" in t.name]
        if not any(np.abs(np.array(t.data, dtype=np.float32)).max() > 0 for t in b):
            problems.append("the adapter's B factors are all zero: nothing trained")
    return judged(problems, f"2 ranks, {backend}, SFT 4 steps in {seconds:.1f} s", **figures)


# -- bench/scale.py ------------------------------------------------------------------------------

SCALE = REPO / "bench" / "scale.py"
# what we would pass, in order, where its --help lists the flag
SCALE_FLAGS = [("--sizes", "8b"), ("--quick", None), ("--skip-peer", None), ("--rest", "0")]


def scale_command(help_text: str, json_path: Path, threads: int) -> list[str] | str:
    """The command line for bench/scale.py at 8B from its --help, or why there is none."""
    listed = set(re.findall(r"--[a-z][a-z-]*", help_text))
    missing = [f for f in ("--sizes", "--quick") if f not in listed]
    if missing:
        return f"bench/scale.py has no {' or '.join(missing)}"
    cmd = [sys.executable, str(SCALE)]
    for flag, value in SCALE_FLAGS:
        if flag in listed:
            cmd += [flag] + ([value] if value is not None else [])
    if "--threads" in listed:
        cmd += ["--threads", str(threads)]
    if "--json" in listed:
        cmd += ["--json", str(json_path)]
    return cmd


def scale_8b(setting):
    if not SCALE.is_file():
        return skipped("bench/scale.py is not in this checkout yet")
    out = Path(setting.work) / "scale.json"
    helped = subprocess.run([sys.executable, str(SCALE), "--help"], capture_output=True, text=True)
    cmd = scale_command(helped.stdout, out, os.cpu_count() or 2)
    if isinstance(cmd, str):
        return judged([cmd], "bench/scale.py --help")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO)  # its output goes to this part's log
    seconds = time.perf_counter() - t0
    figures = {"command": " ".join(cmd[1:]), "seconds": seconds}
    if out.is_file():
        figures["results"] = json.loads(out.read_text())
    problems = [] if done.returncode == 0 else [f"bench/scale.py exited {done.returncode}"]
    return judged(problems, f"{' '.join(cmd[2:])}: {seconds:.0f} s", **figures)
