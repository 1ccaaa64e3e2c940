"""Training beside a neighbour: how much each side slows when another process takes one core.

  .venv/bin/python bench/contended.py [--sides sft,peer,grpo] [--threads N] [--steps 12]
                                      [--warmup 4] [--pin CPU] [--rest 10]
                                      [--prompts 4] [--group 8] [--new 64]

RL on one machine always has neighbours (reward programs, a judge model, the browser). Each
side runs twice in its own process, quiet and then beside the same neighbour, `yes >
/dev/null` (one process spinning on one core; `--pin CPU` pins it to that CPU, else the
scheduler places it), started before the side and killed after it. The report gives tokens/s
(a GRPO update's seconds) each way and the slowdown, quiet over beside, against the
proportional one: with C usable CPUs a neighbour on one of them leaves C - 1, so C / (C - 1)
(2.00x on 2 cores).
  - sft: ours, `run_sft` (the loop `retrograd train` runs) on Gemma 3 270M Q4_K_M from
    `assemble()`, [training] ctx 128 and micro_batch 32 (the reference defaults: a window in
    four passes of 32 tokens, one optimizer step each), LoRA rank 8 alpha 16 on q k v o gate up
    down, AdamW at a constant lr 1e-4, on windows of tests/data/varied.txt (bench/sft.py's
    corpus); tokens/s counts the trained tokens of the timed steps;
  - peer: PEFT + transformers on the same GGUF, the same LoRA and optimizer, the plain loop of
    bench/sft_sides.py (forward with labels, backward, clip, fused AdamW) over the same windows
    of 128 ids, one window a step, in bf16 weights where the CPU has fast bf16 products and
    float32 elsewhere (the peer's fastest; needs `pip install -e '.[bench]'`);
  - grpo: ours, one GRPO update of bench/grpo.py's workload (--prompts 4 x --group 8 answers
    of --new 64 tokens, the arithmetic reward program) after one untimed update.
Every process gets the process tuning ours gives itself (bench/tuning.py): the same thread
count (`--threads`, default retrograd's own choice: every usable CPU, RETRO_THREADS or
OMP_NUM_THREADS where set) and the same OpenMP wait policy (PASSIVE unless the environment
chose one: `GOMP_SPINCOUNT=300000`, libgomp's default, measures the spinning waiters). Step
times after `--warmup` untimed steps (4 by default: one whole window of ours, four passes that
each see a different length of earlier keys), the wall time between the ends of consecutive steps; nothing is downloaded. Results go to docs/performance.md by hand, with this command.
"""

from __future__ import annotations

import sys
from pathlib import Path

# NOTE: bench/tokenize.py would shadow the standard library's tokenize module for scripts run
# from this folder; put the repository root first instead of the script's folder.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import argparse
import contextlib
import json
import os
import subprocess
import tempfile
import time

from bench.sft import write_corpus
from bench.tuning import tune

CTX, MICRO_BATCH = 128, 32
SIDES = ("sft", "peer", "grpo")


# -- workers (each in its own process) ---------------------------------------------------------


def worker_sft(args) -> dict:
    """`run_sft` on the corpus; tokens/s over the timed steps (their trained tokens)."""
    import torch

    from bench.sft_sides import write_run_file
    from retrograd.algorithms.sft import run_sft
    from retrograd.config import load_run
    from retrograd.observe.sinks import Sinks

    run_file = write_run_file(Path(args.workdir), args.threads, CTX, MICRO_BATCH)
    steps: list[tuple[float, int]] = []  # (end, trained tokens)

    class Clock(Sinks):
        def step(self, global_step, epoch, values, tokens, seconds, position=None):
            steps.append((time.perf_counter(), tokens))

    run_sft(load_run(run_file), sinks=Clock(quiet=True))
    assert len(steps) >= args.warmup + args.steps, f"{len(steps)} steps: the corpus is short"
    timed = steps[args.warmup - 1 : args.warmup + args.steps]
    seconds = timed[-1][0] - timed[0][0]
    tokens = sum(t for _, t in timed[1:])
    return {"tok_s": tokens / seconds, "steps": len(timed) - 1, "threads": torch.get_num_threads()}


def worker_peer(args) -> dict:
    """bench/sft_sides.py's PEFT + transformers loop over the corpus's windows."""
    from bench.sft_sides import worker_loop
    from retrograd.model.device import cpu_has_fast_bf16

    args.variant = "bf16w" if cpu_has_fast_bf16() else "f32"
    r = worker_loop(args)
    return {"tok_s": r["tok_s"], "steps": r["steps"], "threads": r["threads"]} | {
        "variant": args.variant
    }


def worker_grpo(args) -> dict:
    """bench/grpo_sides.py's `run_grpo` worker: the seconds of the timed update."""
    from bench.grpo_sides import worker_ours

    args.ctx, args.warmup, args.updates = 1024, 1, 1
    r = worker_ours(args)
    return {"update_s": r["updates"][-1]["total"], "threads": r["threads"]}


WORKERS = {"sft": worker_sft, "peer": worker_peer, "grpo": worker_grpo}


# -- the driver ----------------------------------------------------------------------------------


@contextlib.contextmanager
def neighbour(pin: int | None):
    """`yes > /dev/null` for the duration, pinned to CPU `pin` if given; killed after."""

    def place():
        if pin is not None:
            os.sched_setaffinity(0, {pin})

    proc = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL, preexec_fn=place)  # noqa: PLW1509
    try:
        time.sleep(1.0)  # running, and spread by the scheduler, before the side starts
        yield proc
    finally:
        proc.kill()
        proc.wait()


def run_side(side: str, args, beside: bool) -> dict:
    time.sleep(args.rest)  # each run starts from an idle machine
    load = os.getloadavg()[0]
    workdir = Path(args.workdir) / side
    cmd = [sys.executable, __file__, "--worker", side, "--workdir", str(workdir)]
    cmd += ["--threads", str(args.threads), "--steps", str(args.steps)]
    for key in ("warmup", "prompts", "group", "new"):
        cmd += [f"--{key}", str(getattr(args, key))]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with neighbour(args.pin) if beside else contextlib.nullcontext():
        t = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t
    if out.returncode != 0:
        sys.exit(f"{side} ({'beside' if beside else 'quiet'}) failed:\n{out.stderr[-6000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    where = "beside yes" if beside else "quiet"
    print(f"  {side} {where}: {wall:.0f} s, load before {load:.2f}; {json.dumps(r)}", flush=True)
    return r | {"load": load}


def report(args, cpus: int, tuning: str, res: dict) -> None:
    proportional = f"{cpus / (cpus - 1):.2f}x" if cpus > 1 else "n/a (one CPU)"
    where = f"pinned to CPU {args.pin}" if args.pin is not None else "placed by the scheduler"
    print(
        f"\nBeside a neighbour: {cpus} usable CPUs, {args.threads} threads every side; "
        f"neighbour `yes > /dev/null` {where}; {args.steps} timed steps after {args.warmup}"
    )
    print(f"process tuning, every side: {tuning}")
    print(f"{'side':<34} {'quiet':>12} {'beside':>12} {'slowdown':>9} {'proportional':>13}")
    names = {
        "sft": f"SFT ours (ctx {CTX}, micro_batch {MICRO_BATCH})",
        "peer": f"SFT peer (PEFT loop, {res.get('peer', {}).get('quiet', {}).get('variant')})",
        "grpo": f"GRPO update ours ({args.prompts * args.group} x {args.new} tokens)",
    }
    for side, r in res.items():
        quiet, beside = r["quiet"], r["beside"]
        if side == "grpo":
            cells = f"{quiet['update_s']:10.1f} s {beside['update_s']:10.1f} s"
            slowdown = beside["update_s"] / quiet["update_s"]
        else:
            cells = f"{quiet['tok_s']:8.1f} tok/s {beside['tok_s']:6.1f} tok/s"
            slowdown = quiet["tok_s"] / beside["tok_s"]
        print(f"{names[side]:<34} {cells} {slowdown:8.2f}x {proportional:>13}")
    loads = {f"{s} {k}": round(r[k]["load"], 2) for s, r in res.items() for k in r}
    print(f"load average before each run: {loads}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sides", default=",".join(SIDES), help="of sft, peer, grpo")
    p.add_argument("--threads", type=int, help="every side (default: retrograd's own choice)")
    p.add_argument("--steps", type=int, default=12, help="timed SFT steps per run")
    p.add_argument("--warmup", type=int, default=4, help="untimed SFT steps (at least 1)")
    p.add_argument("--pin", type=int, help="pin the neighbour to this CPU")
    p.add_argument("--rest", type=float, default=10.0, help="idle seconds before each run")
    p.add_argument("--prompts", type=int, default=4, help="grpo: prompts per update")
    p.add_argument("--group", type=int, default=8, help="grpo: answers per prompt")
    p.add_argument("--new", type=int, default=64, help="grpo: new tokens per answer")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        tuning = tune()  # before torch, in every worker: the same process tuning
        print(json.dumps(WORKERS[args.worker](args) | {"tuning": tuning}))
        return
    from retrograd.threads import choose_threads, default_threads, usable_cpus

    sides = [s for s in args.sides.split(",") if s]
    if not set(sides) <= set(SIDES) or not sides:
        sys.exit(f"--sides {args.sides}: must name some of {', '.join(SIDES)}")
    if args.warmup < 1 or args.steps < 1:
        sys.exit("--warmup and --steps must be at least 1")
    cpus = usable_cpus()
    if args.pin is not None and args.pin not in os.sched_getaffinity(0):
        sys.exit(
            f"--pin {args.pin}: not one of this process's CPUs {sorted(os.sched_getaffinity(0))}"
        )
    # what a retrograd process would choose: RETRO_THREADS, else OpenMP's count (OMP_NUM_THREADS
    # or every CPU of the affinity mask) bounded by the usable CPUs
    omp = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    openmp = int(omp) if omp else len(os.sched_getaffinity(0))
    args.threads = args.threads or choose_threads() or default_threads(openmp)
    res: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-contended-") as workdir:
        args.workdir = workdir
        steps = args.warmup + args.steps
        # ours: passes of MICRO_BATCH tokens, CTX / MICRO_BATCH a window (one window to spare);
        # the peer: one window a step
        sft, peer, grpo = (Path(workdir, side) for side in SIDES)
        for folder in (sft, peer, grpo):
            folder.mkdir()
        write_corpus(sft, steps * MICRO_BATCH // CTX + 2, CTX)
        write_corpus(peer, steps, CTX)
        for side in sides:
            res[side] = {"quiet": run_side(side, args, False), "beside": run_side(side, args, True)}
        tuning = res[sides[0]]["quiet"]["tuning"]
    report(args, cpus, tuning, res)


if __name__ == "__main__":
    main()
