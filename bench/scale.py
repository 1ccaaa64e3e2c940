"""Llama-shaped models at 1B, 3B and 8B: speed, memory and where each side stops fitting, one run.

  .venv/bin/python bench/scale.py [--sizes 1b,3b,8b] [--steps 4] [--threads 2] [--skip-sft]
                                  [--skip-peer] [--skip-grpo] [--skip-generate] [--quick]
                                  [--json OUT]
                                  [--build-only] [--build-threads N] [--rest 10]

The models: the shapes of Llama 3.2 1B, Llama 3.2 3B and Llama 3.1 8B with random weights and
the real Llama 3 tokenizer (tests/factories/llama_shaped.py), written as F16 one chunk of rows at
a time and quantized to Q4_K_M by llama.cpp's quantizer (llama-cpp-python's
`llama_model_quantize`); built once, in a process of their own whose peak memory is printed,
and kept in .cache/scale/ under a name holding the size and the recipe version (the F16 file
is deleted). Then, on each size, each measurement in its own process so that its peak RSS is
its own, with bench/tuning.py's process tuning and `--threads` threads on every side:
  - SFT, ctx 512, batch 1, LoRA r8 alpha 16 on q k v o gate up down, AdamW: ours (`run_sft`
    from a run file, bench/sft_sides.py) with the dequantized-weight cache on
    (RETRO_DEQUANT_CACHE=1), the weights in 8 bits (=int8) and the cache off (=0), and the
    peer, a plain PEFT + transformers loop in its fastest dtype (bf16 weights where the CPU
    has fast bf16, else f32) on the same weights
    (dequantized from the same file by gguf-py); tokens/s is the median step after the
    warm-up, MFU that rate times the FLOPs a trained token costs over the machine's matmul
    rate, measured in the same run (best of 10 torch.mm 2048^3 in bf16 and f32, the faster);
  - one GRPO update of ours (4 prompts x 8 answers x 64 new tokens, bench/grpo.py's update,
    rewarded by answer length so that random answers differ), after one warm-up update, with
    its phases: generation, reward, scoring, optimizer, other; and the optimizer pass's
    trained answer tokens a second with its MFU: 4 x the layers' matrices over every position
    the pass runs (each group's prompt once, then its answers) plus 4 x the output product
    over the answer tokens, a second, over the matmul rate;
  - generation at 1 and 8 sequences (128-token prompts, 128 new tokens, greedy, end of
    generation ignored): ours (bench/generate.py's sampler) with the cache `auto` chooses and
    with the weights in 8 bits (=int8; one run where `auto` chooses it), and llama.cpp
    decoding as many sequences in parallel (bench/llamacpp.py), each alone in its process
    with its peak RSS; the report gives our peaks over llama.cpp's.
Our GRPO and generation runs get the cache `auto` would choose (on when the dense weights fit in
40% of the memory available, else the 8-bit store when it fits in 60%, else off), fixed by the
driver so that the estimate matches the run.
FLOPs per trained token: 4 x (N + H), N the parameters of the layers' matrices, H those of the
output product (vocabulary x width; the embedding lookup costs none): 2 per weight forward and 2
backward (the gradient with respect to the activations; the frozen weights get none, the LoRA's
own products and attention's scores are left out).
Before each measurement the driver estimates its peak RSS from the shape (`estimates`: the
file, the dense cache, activations, PyTorch; set on the first runs' peaks, on the high side)
and compares it with MemAvailable: where it exceeds 95% of it, it prints "does not fit" with
the estimate instead of running it (a measurement that dies anyway is reported as failed). At
the end it prints, for every side and size, the estimate against the memory available then and
where each side stops fitting. --quick runs tiny steps
(1 timed SFT step, an update of 2 x 4 answers of 8 tokens, 8 new tokens generated) to prove the
harness, not to measure. Results go to docs/performance.md by hand, with this command.
"""

from __future__ import annotations

import sys
from pathlib import Path

# NOTE: bench/tokenize.py would shadow the standard library's tokenize module.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from bench.tuning import tune
from retrograd.model.device import cpu_has_fast_bf16
from retrograd.server.plans import host_memory
from tests.factories.llama_shaped import N_VOCAB, SHAPES, LlamaShape

RECIPE = 1  # the model files' recipe: change it when llama_shaped.py writes other weights
CACHE = ROOT / ".cache" / "scale"
GIB = 1 << 30
FIT = 0.95  # a side runs where its estimate is at most this share of MemAvailable
SIDES = {
    "sft_on": "SFT ours, dense cache on",
    "sft_off": "SFT ours, dense cache off",
    "sft_int8": "SFT ours, 8-bit store",
    "sft_peer": "SFT peer, PEFT + transformers",
    "grpo": "GRPO update, ours",
    "gen_ours": "generation, ours",
    "gen_int8": "generation, ours, 8-bit",
    "gen_llama": "generation, llama.cpp",
}


def model_file(size: str) -> Path:
    return CACHE / f"llama-{size}-r{RECIPE}-q4_k_m.gguf"


# -- memory estimates: bytes at peak, from the shape ------------------------------------------

BYTES_PER_PARAM_Q4_K_M = 0.66  # a file's size before it is built (1B: 0.76 GiB for 1.24 B)


def activations(s: LlamaShape, tokens: int, seq: int, width: int) -> int:
    """What a LoRA pass keeps for backward: per token and layer, the inputs of the products
    and the MLP's halves in `width` bytes, the residual stream in float32, and float32
    attention probabilities over a sequence of `seq`."""
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    per = width * (4 * s.n_embd + 4 * s.n_ff + 2 * q + 2 * kv) + 8 * s.n_embd + 4 * s.n_head * seq
    return tokens * s.n_layer * per


def estimates(s: LlamaShape, file_bytes: int, args) -> dict[str, int]:
    """Each side's peak RSS, estimated (GiB-sized constants: PyTorch with its compiled kernels,
    transformers, llama.cpp's compute buffers)."""
    width = 2 if args.fast_bf16 else 4
    dense = dense_bytes(s, args)
    largest = max(r * c for _, r, c in s.matrices())
    ours = file_bytes + int(1.25 * GIB)
    kept = int8_bytes(s) + int(1.25 * GIB)  # the file's pages leave as each weight is quantized
    sft = activations(s, 512, 512, width)
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    peer_act = 512 * s.n_layer * width * (6 * s.n_embd + 5 * s.n_ff + 3 * q + 4 * kv)
    seq = 128 + args.new  # a prompt and its answer
    kv_rows = 2 * kv * s.n_layer * 4  # keys and values of one position, float32 at most
    batch = max(int(b) for b in args.batches.split(","))
    mode = auto_cache(s, args)
    base = {"1": ours + 2 * dense, "int8": kept, "0": ours}[mode]  # dense: and packed copies
    return {
        "sft_on": ours + dense + sft,
        "sft_off": ours + sft + width * largest,  # the largest product's dense copy, made on use
        "sft_int8": kept + sft + width * largest,  # and the largest weight's q in bf16
        "sft_peer": width * s.params()
        + peer_act
        + 512 * N_VOCAB * (width + 16)  # the logits, upcast, log-softmax and its gradient
        + int(1.5 * GIB),
        "grpo": base
        + activations(s, args.ctx, seq, width)
        + args.prompts * args.group * (seq * kv_rows + 12 * N_VOCAB),
        "gen_ours": base
        - (dense if mode == "1" else 0)  # packed copies, not both
        + batch * (args.gen_prompt + args.gen_new) * kv_rows,
        "gen_int8": kept + batch * (args.gen_prompt + args.gen_new) * kv_rows,
        "gen_llama": file_bytes
        + batch * (args.gen_prompt + args.gen_new + 8) * kv_rows // 2  # f16 cache
        + int(0.6 * GIB),
    }


def dense_bytes(s: LlamaShape, args) -> int:
    return (2 if args.fast_bf16 else 4) * sum(r * c for _, r, c in s.matrices())


def int8_bytes(s: LlamaShape) -> int:
    """The 8-bit store: a byte a weight of the products (the embedding only where it is the
    head) and a float32 scale a row."""
    rows = [(n, r, c) for n, r, c in s.matrices() if s.tied or n != "token_embd.weight"]
    return sum(r * c + 4 * r for _, r, c in rows)


def auto_cache(s: LlamaShape, args) -> str:
    """What the loader's cache = "auto" chooses for this model on this machine now, as
    RETRO_DEQUANT_CACHE spells it: "1" where the dense weights fit in its share of
    MemAvailable, else "int8" where the 8-bit store fits in its share, else "0"."""
    from retrograd.compute import CACHE_FRACTION, INT8_FRACTION

    avail = host_memory()[1]
    if dense_bytes(s, args) <= CACHE_FRACTION * avail:
        return "1"
    return "int8" if int8_bytes(s) <= INT8_FRACTION * avail else "0"


def file_size(size: str) -> int:
    path = model_file(size)
    if path.exists():
        return path.stat().st_size
    return int(SHAPES[size].params() * BYTES_PER_PARAM_Q4_K_M)


def flops_per_token(s: LlamaShape) -> int:
    """4 x (layers' matrices + output product): 2 per weight forward, 2 backward."""
    return 4 * (s.block_params() + s.head_params())


# -- workers -----------------------------------------------------------------------------------


def run_worker(kind: str, args, size: str, workdir: str = "", env: dict | None = None) -> dict:
    """One measurement in its own process; its dict, or {"error": ...} when it fails."""
    cmd = [sys.executable, __file__, "--worker", kind, "--size", size, "--workdir", workdir]
    keys = ("threads", "steps", "warmup", "warmup_updates", "prompts", "group", "new", "ctx")
    for key in (*keys, "batches", "gen_prompt", "gen_new", "variant", "build_threads"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"} | (env or {})
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    if out.returncode != 0:
        why = f"exit {out.returncode}" + (" (killed: out of memory?)" if out.returncode < 0 else "")
        return {"error": why, "stderr": out.stderr[-3000:], "seconds": seconds}
    return json.loads(out.stdout.strip().splitlines()[-1]) | {"seconds": seconds}


def worker(args) -> None:
    from bench import scale_sides as sides

    tuning = tune()  # before torch: every side gets the same process tuning
    if args.worker == "matmul":
        from bench.forward import worker_matmul

        fn = worker_matmul
    else:
        fn = getattr(sides, f"worker_{args.worker}")
    args.model = str(model_file(args.size))
    print(json.dumps(fn(args) | {"tuning": tuning}))


# -- one size ----------------------------------------------------------------------------------


def build(size: str, args) -> dict:
    path = model_file(size)
    if path.exists():
        print(f"  {path.relative_to(ROOT)}: built before", flush=True)
        return {"cached": True, "file_bytes": path.stat().st_size}
    s = SHAPES[size]
    need = int(2 * s.params() + file_size(size) + GIB)  # the F16 file and the result
    CACHE.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(CACHE).free
    if free < need:
        sys.exit(f"{CACHE}: building {size} needs {need / GIB:.1f} GiB free, has {free / GIB:.1f}")
    print(f"  building {path.relative_to(ROOT)} ...", flush=True)
    res = run_worker("build", args, size)
    if "error" in res:
        sys.exit(f"building {size} failed: {res['error']}\n{res['stderr']}")
    print(
        f"  built in {res['seconds']:.0f} s with {res['threads']} quantizer thread(s): "
        f"{res['file_bytes'] / GIB:.2f} GiB; peak RSS {res['maxrss_mib'] / 1024:.2f} GiB "
        f"(anonymous {res['anon_peak_mib'] / 1024:.2f}, file-backed "
        f"{res['file_peak_mib'] / 1024:.2f}, sampled every 0.1 s)",
        flush=True,
    )
    return res


def plan(args) -> list[tuple[str, dict]]:
    """(side, extra environment) in the order measured."""
    sides = []
    if not args.skip_sft:
        sides += [
            ("sft_on", {"RETRO_DEQUANT_CACHE": "1"}),
            ("sft_int8", {"RETRO_DEQUANT_CACHE": "int8"}),
            ("sft_off", {"RETRO_DEQUANT_CACHE": "0"}),
        ]
    if not args.skip_peer and not args.skip_sft:
        sides.append(("sft_peer", {}))
    if not args.skip_grpo:
        sides.append(("grpo", {}))
    if not args.skip_generate:
        sides += [
            ("gen_ours", {}),
            ("gen_int8", {"RETRO_DEQUANT_CACHE": "int8"}),
            ("gen_llama", {}),
        ]
    return sides


WORKERS = {
    "sft_on": "sft_ours",
    "sft_off": "sft_ours",
    "sft_int8": "sft_ours",
    "sft_peer": "sft_peer",
    "grpo": "grpo",
    "gen_ours": "gen_ours",
    "gen_int8": "gen_ours",
    "gen_llama": "gen_llama",
}


def measure(size: str, args) -> dict:
    s = SHAPES[size]
    out: dict = {"build": build(size, args)}
    with tempfile.TemporaryDirectory(prefix=f"bench-scale-{size}-") as workdir:
        inputs = run_worker("inputs", args, size, workdir)
        if "error" in inputs:
            sys.exit(f"preparing the inputs of {size} failed:\n{inputs['stderr']}")
        for side, env in plan(args):
            if side in ("grpo", "gen_ours"):  # what `auto` chooses now, fixed for the estimate
                env = {"RETRO_DEQUANT_CACHE": auto_cache(s, args)}
            if side == "gen_int8" and auto_cache(s, args) == "int8":
                continue  # `auto` keeps this size in 8 bits: gen_ours measured it
            est = estimates(s, file_size(size), args)[side]
            avail = host_memory()[1]
            row = {"estimate_bytes": est, "available_bytes": avail, "cache_env": env}
            if est > FIT * avail:
                print(
                    f"  {SIDES[side]}: does not fit (estimate {est / GIB:.1f} GiB, "
                    f"available {avail / GIB:.1f} GiB)",
                    flush=True,
                )
                out[side] = row | {"fits": False}
                continue
            time.sleep(args.rest)
            res = run_worker(WORKERS[side], args, size, workdir, env)
            out[side] = row | {"fits": True} | res
            print(f"  {SIDES[side]}: {short(side, res)}", flush=True)
    return out


# -- report ------------------------------------------------------------------------------------


def gib(mib: float | None) -> str:
    return "?" if mib is None else f"{mib / 1024:.2f} GiB"


def short(side: str, r: dict) -> str:
    """One line of a measurement, as it arrives."""
    if "error" in r:
        return f"FAILED ({r['error']}): {r['stderr'].strip().splitlines()[-1:]}"
    peak = f"peak RSS {gib(r['maxrss_mib'])}"
    if side.startswith("sft"):
        return f"{r['tok_s']:.1f} tok/s, {peak} (train {gib(r['train_peak_mib'])}), loss@1 {r['first_loss']:.3f}"
    if side == "grpo":
        u = r["updates"][-1]
        return f"update {u['total']:.1f} s, {peak}, trained fraction {r['trained_fraction'][-1]}"
    return ", ".join(f"{b} seq {v:.1f} tok/s" for b, v in r["tok_s"].items()) + f", {peak}"


def report_size(size: str, r: dict, args, peak_flops: float) -> list[str]:
    s = SHAPES[size]
    fpt = flops_per_token(s)
    b = r["build"]
    lines = [
        f"\n{size}: Llama shape, {s.n_layer} layers, width {s.n_embd}, MLP {s.n_ff}, "
        f"{s.n_head}/{s.n_head_kv} heads of {s.head_dim}, vocabulary {N_VOCAB:,}, "
        f"{'tied' if s.tied else 'untied'} output; Q4_K_M {b['file_bytes'] / GIB:.2f} GiB; "
        f"{s.params() / 1e9:.2f} B parameters; FLOPs per trained token 4 x ({s.block_params() / 1e9:.3f}"
        f" + {s.head_params() / 1e9:.3f}) B = {fpt / 1e9:.2f} GFLOP",
        f"{'side':<38} {'tok/s':>8} {'MFU':>6} {'peak RSS':>10} {'train peak':>10} "
        f"{'estimate':>9}  notes",
    ]
    for side in SIDES:
        if side not in r:
            continue
        m = r[side]
        est = f"{m['estimate_bytes'] / GIB:.1f} GiB"
        name = SIDES[side] + (f" ({args.variant})" if side == "sft_peer" else "")
        if not m["fits"]:
            lines.append(
                f"{name:<38} does not fit: estimate {est}, available "
                f"{m['available_bytes'] / GIB:.1f} GiB"
            )
            continue
        if "error" in m:
            lines.append(f"{name:<38} FAILED: {m['error']} (estimate {est})")
            continue
        lines += side_rows(side, name, m, est, s, peak_flops)
    rates = {k: r[k].get("tok_s") for k in ("sft_on", "sft_int8", "sft_off") if k in r}
    if rates.get("sft_on") and (rates.get("sft_int8") or rates.get("sft_off")):
        lines.append(
            "against the dense cache's SFT rate (one run each, minutes apart): "
            + ", ".join(
                f"{k.removeprefix('sft_')} {v / rates['sft_on']:.0%}"
                for k, v in rates.items()
                if v and k != "sft_on"
            )
        )
    lines += generation_memory(r)
    return lines


def generation_memory(r: dict) -> list[str]:
    """Our generation's peak RSS over llama.cpp's, in each cache mode measured."""
    llama = r.get("gen_llama", {}).get("maxrss_mib")
    ours = {
        r[k]["cache_env"].get("RETRO_DEQUANT_CACHE"): r[k]["maxrss_mib"]
        for k in ("gen_ours", "gen_int8")
        if r.get(k, {}).get("maxrss_mib")
    }
    if not llama or not ours:
        return []
    names = {"1": "dense cache", "int8": "8-bit store", "0": "cache off"}
    return [
        "generation peak RSS against llama.cpp's: "
        + ", ".join(f"{names[k]} {v / llama:.2f}x" for k, v in ours.items())
    ]


def optimizer_rate(m: dict) -> float:
    """Trained answer tokens a second of the GRPO update's optimizer pass (its forward and
    backward, and AdamW's step) over the timed updates: their answer tokens times the trained
    fraction."""
    n = len(m["updates"])
    pairs = zip(m["answer_tokens"][-n:], m["trained_fraction"][-n:], strict=True)
    tokens = sum(t * f for t, f in pairs)
    return tokens / max(1e-9, sum(u["optimizer"] for u in m["updates"]))


def optimizer_flops(m: dict, s: LlamaShape) -> float:
    """FLOPs a second of the optimizer pass over the timed updates: 4 x the layers' matrices
    over every position they run (each group's prompt once, then its answers; the prompts'
    keys and values take the adapters' gradient too) and 4 x the output product over the
    answer tokens it scores."""
    n = len(m["updates"])
    seconds = max(1e-9, sum(u["optimizer"] for u in m["updates"]))
    rows = zip(
        m["positions"][-n:], m["answer_tokens"][-n:], m["trained_fraction"][-n:], strict=True
    )
    flops = sum(f * 4 * (p * s.block_params() + t * s.head_params()) for p, t, f in rows)
    return flops / seconds


def side_rows(
    side: str, name: str, m: dict, est: str, s: LlamaShape, peak_flops: float
) -> list[str]:
    fpt = flops_per_token(s)
    peak = f"{m['maxrss_mib'] / 1024:8.2f} GiB"
    if side.startswith("sft"):
        train = f"{m['train_peak_mib'] / 1024:8.2f} GiB" if m.get("train_peak_mib") else "?"
        mfu = m["tok_s"] * fpt / peak_flops
        return [
            f"{name:<38} {m['tok_s']:8.1f} {mfu:6.1%} {peak:>10} {train:>10} {est:>9}  "
            f"step {m['step_s']:.2f} s ({m['steps']} timed), loss@1 {m['first_loss']:.3f}"
        ]
    if side == "grpo":
        u = {k: statistics.mean(x[k] for x in m["updates"]) for k in m["updates"][0]}
        phases = ", ".join(
            f"{k} {u[k]:.1f}" for k in ("generation", "reward", "scoring", "optimizer", "other")
        )
        rate = optimizer_rate(m)
        tok_s, mfu = f"{rate:8.1f}", f"{optimizer_flops(m, s) / peak_flops:6.1%}"
        return [
            f"{name:<38} {tok_s} {mfu} {peak:>10} {gib(m['train_peak_mib']):>10} {est:>9}  "
            f"update {u['total']:.1f} s: {phases}; trained fraction {m['trained_fraction'][-1]}; "
            f"cache {m['cache_env'].get('RETRO_DEQUANT_CACHE')}; tok/s and MFU: the optimizer pass "
            f"(tok/s: answer tokens; MFU: its products over every position they run)"
        ]
    rows = []
    for b, rate in m["tok_s"].items():
        rows.append(
            f"{name + f', {b} sequence(s)':<38} {rate:8.1f} {'':>6} {peak:>10} {'':>10} {est:>9}"
            + (
                f"  cache {m['cache_env'].get('RETRO_DEQUANT_CACHE', '-')}"
                if side in ("gen_ours", "gen_int8")
                else ""
            )
        )
    return rows


def report_fit(res: dict, args) -> list[str]:
    """Every side at every size: the estimate against the memory available now, and the
    measured peak where it ran; where each side stops fitting."""
    avail = host_memory()[1]
    lines = [
        f"\nwhere each side stops fitting: estimated peak RSS against MemAvailable now "
        f"({avail / GIB:.1f} GiB; {host_memory()[0] / GIB:.1f} GiB in all); measured peak in brackets"
    ]
    sizes = [k for k in SHAPES if k != "tiny"]
    lines.append(f"{'side':<38} " + " ".join(f"{k:>16}" for k in sizes) + "  stops at")
    for side in SIDES:
        cells, stop = [], None
        for size in sizes:
            est = estimates(SHAPES[size], file_size(size), args)[side]
            ran = res.get(size, {}).get(side, {})
            fits = est <= FIT * avail
            stop = stop or (None if fits else size)
            cell = f"{est / GIB:.1f}{' ' if fits else '!'}"
            cells.append(
                cell + (f" ({ran['maxrss_mib'] / 1024:.1f})" if "maxrss_mib" in ran else "")
            )
        lines.append(
            f"{SIDES[side]:<38} "
            + " ".join(f"{c:>16}" for c in cells)
            + f"  {stop or 'fits at every size'}"
        )
    lines.append("(! = does not fit; GiB)")
    return lines


# -- main --------------------------------------------------------------------------------------


def parse(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--sizes", default="1b,3b,8b", help="comma-separated: 1b, 3b, 8b (tiny: 2 layers, a try)"
    )
    p.add_argument("--steps", type=int, default=4, help="timed SFT steps, after --warmup")
    p.add_argument("--warmup", type=int, default=2, help="untimed SFT steps first (>= 1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--build-threads", type=int, default=None, help="quantizer threads")
    p.add_argument("--skip-sft", action="store_true", help="none of the SFT sides (ours or peer)")
    p.add_argument("--skip-peer", action="store_true", help="no PEFT + transformers SFT")
    p.add_argument("--skip-grpo", action="store_true")
    p.add_argument("--skip-generate", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny steps: proves the harness runs")
    p.add_argument("--build-only", action="store_true", help="build the model files, no more")
    p.add_argument("--rest", type=float, default=10.0, help="idle seconds before each side")
    p.add_argument("--json", help="write every result to this file")
    # the GRPO update and the generation runs (bench/grpo.py's and bench/generate.py's)
    p.add_argument("--prompts", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--group", type=int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--new", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--ctx", type=int, default=1024, help=argparse.SUPPRESS)
    p.add_argument("--warmup-updates", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--batches", default="1,8", help=argparse.SUPPRESS)
    p.add_argument("--gen-prompt", type=int, default=128, help=argparse.SUPPRESS)
    p.add_argument("--gen-new", type=int, default=128, help=argparse.SUPPRESS)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick and not args.worker:
        args.steps, args.warmup, args.rest = 1, 1, 0.0
        args.prompts, args.group, args.new = 2, 4, 8
        args.gen_prompt, args.gen_new = 16, 8
    args.fast_bf16 = cpu_has_fast_bf16()
    # the peer's fastest dtype: bf16 weights where bf16 products are fast (bench/sft.py's loop)
    args.variant = args.variant or ("bf16w" if args.fast_bf16 else "f32")
    args.build_threads = args.build_threads or args.threads
    return p, args


def main() -> None:
    p, args = parse()
    if args.worker:
        worker(args)
        return
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SHAPES]
    if unknown or not sizes:
        p.error(f"--sizes {args.sizes}: each must be one of {', '.join(SHAPES)}")
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be at least 1")
    print(f"CPU: {cpu_name()}; {args.threads} threads; fast bf16: {args.fast_bf16}", flush=True)
    if args.build_only:
        for size in sizes:
            print(f"\n== {size}", flush=True)
            build(size, args)
        return
    matmul = run_worker("matmul", args, sizes[0])
    if "error" in matmul:
        sys.exit(f"the matmul probe failed:\n{matmul['stderr']}")
    rates = matmul["tflops"]
    fastest = max(rates, key=rates.get)
    res: dict = {}
    for size in sizes:
        print(f"\n== {size}", flush=True)
        res[size] = measure(size, args)
    lines = [
        f"\nmachine: {cpu_name()}, {args.threads} threads; matmul "
        + ", ".join(f"{k} {v:.2f} TFLOP/s" for k, v in rates.items())
        + f" (2048^3, best of 10); MFU against {fastest}"
        + (" -- QUICK RUN: tiny steps, not a measurement" if args.quick else "")
    ]
    for size in sizes:
        lines += report_size(size, res[size], args, rates[fastest] * 1e12)
    lines += report_fit(res, args)
    print("\n".join(lines))
    if args.json:
        doc = {"args": {k: v for k, v in vars(args).items()}, "matmul": matmul, "sizes": res}
        tmp = Path(args.json + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(args.json)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    main()
