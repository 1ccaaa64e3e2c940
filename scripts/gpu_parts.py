"""The model parts of `make gpu-check`: exactness, sampling and require_gpu_resident.

Each function takes the driver's Setting and returns an Outcome (scripts/gpu_check.py); it
runs in a process of its own, so it may load models and leave CUDA memory behind. The bounds
are stated here, each with where it comes from; a figure that exceeds its bound fails the
part. On `--device cpu` the same code runs with the CPU as its device: comparisons of the
device against the CPU are then trivially 0 and say so.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

from scripts.gpu_check import REPO, Findings, failed

# float32 logits on the device against the CPU's and llama.cpp's: (max, mean) abs difference.
# Gemma's are tests/oracles/test_model_exactness.py's bounds against llama.cpp (docs/
# exactness.md: its large residual stream puts float32 rounding at a few 1e-2); the tiny
# model's activations are small (docs/exactness.md measures 5e-4 against llama.cpp).
F32_BOUNDS = {"gemma": (0.1, 5e-3), "file": (0.1, 5e-3), "tiny": (2e-3, 2e-4)}
# bf16 against float32 on the same device: top-1 agreement, |mean NLL difference| over all
# scored tokens (nats), max abs logit or log-probability difference, mean abs log-probability
# difference. Measured on the CPU (AVX512-BF16), Gemma, two rows of 64 tokens: 98.4%, 0.0089
# nats, max 0.97 (logit) and 0.64 (log-probability), mean 0.048 (eager kernels); rows of 128:
# 97.7-98.4%, 0.0015 nats, 0.91, 0.12. The top-1 and NLL bounds are test_model_exactness's for
# bf16 against llama.cpp (93%, 0.02); the others two to three times the measured.
BF16_BOUNDS = {"top1": 0.93, "nll": 0.02, "max": 2.0, "logprob_mean": 0.15}
PRIMITIVE_BOUND = 1e-3  # model/logprobs.py's float32 tiles against log_softmax of the logits
HOST_LOGPROB_BOUND = 1e-3  # the device's float32 log-probabilities against the float64 host
NUCLEUS_SETTINGS = [(t, p) for t in (0.7, 1.0, 1.3) for p in (0.5, 0.9, 0.95, 0.99)]


def load(setting, dtype, device: str | None = None, **kw):
    import retrograd

    where = device or ("gpu" if setting.device == "cuda" else "cpu")
    return retrograd.load(setting.model, device=where, dtype=dtype, **kw)


def texts() -> str:
    return (REPO / "tests" / "data" / "varied.txt").read_text()


def prompt_rows(setting, model) -> list[list[int]]:
    """Token rows of varied text: one past Gemma's 512-token window and two shorter ones."""
    ids = model.tokenize(texts(), add_bos=True)
    longest = min(len(ids), model.config.n_ctx_train, 64 if setting.quick else 600)
    short = min(longest, 64 if setting.quick else 128)
    rows = [ids[:longest]]
    for start in (100, 300)[: 1 if setting.quick else 2]:
        rows.append(ids[:1] + ids[start : start + short - 1])
    return [r for r in rows if len(r) > 2]


def diff(a, b) -> tuple[float, float]:
    d = (a.float().cpu() - b.float().cpu()).abs()
    return float(d.max()), float(d.mean())


def scored(model, rows):
    """model/logprobs.py's batched primitive (right-padded rows, float32 tiles) -> per row."""
    import torch

    from retrograd.model.logprobs import sequence_logprobs

    with torch.no_grad():
        return [t.cpu() for t in sequence_logprobs(model.decoder, [(r, 1) for r in rows])]


def plain_logprobs(logits, ids):
    import torch

    lp = torch.log_softmax(logits[:-1].float().cpu(), -1)
    return lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def worst(pairs) -> tuple[float, float]:
    """The largest (max, mean) over rows of (a, b) pairs."""
    got = [diff(a, b) for a, b in pairs]
    return max(g[0] for g in got), max(g[1] for g in got)


# -- exactness -------------------------------------------------------------------------------


def exactness(setting):
    import torch

    runs = {}
    for name, dtype, where in (
        ("cpu", torch.float32, "cpu"),
        ("f32", torch.float32, None),
        ("bf16", torch.bfloat16, None),
    ):
        if name == "f32" and setting.device == "cpu":
            runs["f32"] = runs["cpu"]  # the device is the CPU: the same computation
            continue
        model = load(setting, dtype, where)
        if name == "cpu":
            rows = prompt_rows(setting, model)
        with torch.no_grad():
            runs[name] = ([model.logits(r).cpu() for r in rows], scored(model, rows))
            if name != "bf16":
                runs[name + " alone"] = [scored(model, [r])[0] for r in rows]
        del model
    f = Findings()
    f.figures["tokens"] = [len(r) for r in rows]
    float32_rows(setting, f, rows, runs["f32"][0], runs["cpu"][0])
    bf16_rows(f, rows, runs["bf16"], runs["f32"])
    logprob_rows(setting, f, rows, runs)
    return f.outcome()


def float32_rows(setting, f: Findings, rows, got, ref) -> None:
    """The device's float32 logits against the CPU's and against llama.cpp's."""
    most, mean = F32_BOUNDS[setting.model_kind]
    d = worst(zip(got, ref, strict=True))
    f.figures["f32_device_vs_cpu"] = {"max": d[0], "mean": d[1]}
    if setting.device == "cuda":
        f.notes.append(f"f32 cuda-cpu max {d[0]:.1e} mean {d[1]:.1e}")
        f.bound(d[0], most, "f32 cuda vs cpu max")
        f.bound(d[1], mean, "f32 cuda vs cpu mean")
    else:
        f.notes.append("f32 device is the CPU (reference)")
    oracle = llama_comparison(setting, rows, got)
    if oracle is None:
        f.notes.append("llama.cpp not installed: no oracle row")
    else:
        f.figures["f32_device_vs_llama_cpp"] = {"max": oracle[0], "mean": oracle[1]}
        f.notes.append(f"vs llama.cpp max {oracle[0]:.1e} mean {oracle[1]:.1e}")
        f.bound(oracle[0], most, "f32 vs llama.cpp max")
        f.bound(oracle[1], mean, "f32 vs llama.cpp mean")
    f.notes.append(f"(f32 bounds {most:g}/{mean:g})")


def bf16_rows(f: Findings, rows, low, high) -> None:
    """bf16 against float32 on the device: top-1, the NLL over all scored tokens, logits."""
    import torch

    top1 = min(
        float((a.argmax(-1) == b.argmax(-1)).float().mean())
        for a, b in zip(low[0], high[0], strict=True)
    )
    dnll = abs(float(torch.cat(low[1]).mean() - torch.cat(high[1]).mean()))
    most = worst(zip(low[0], high[0], strict=True))[0]
    f.figures["bf16_vs_f32"] = {"max": most, "top1": top1, "nll": dnll}
    f.notes.append(f"bf16-f32 max {most:.2f} top-1 {top1:.1%} dNLL {dnll:.4f}")
    b = BF16_BOUNDS
    f.bound(most, b["max"], "bf16 vs f32 max logit")
    f.bound(dnll, b["nll"], "bf16 vs f32 NLL")
    if top1 < b["top1"]:
        f.problems.append(f"bf16 vs f32 top-1 {top1:.1%} under {b['top1']:.0%}")


def logprob_rows(setting, f: Findings, rows, runs) -> None:
    """model/logprobs.py's log-probabilities: the rows as one right-padded batch on the device
    against the CPU's and against each row alone (docs/exactness.md, "Batch mates"); a row
    alone (vocabulary tiles) against log_softmax of the same device's logits; bf16's against
    float32's."""
    got, ref, low = runs["f32"][1], runs["cpu"][1], runs["bf16"][1]
    alone = runs["f32 alone"] if "f32 alone" in runs else runs["cpu alone"]
    dev = worst(zip(got, ref, strict=True))[0]
    mates = worst(zip(got, alone, strict=True))[0]
    plain = [plain_logprobs(g, r) for g, r in zip(runs["f32"][0], rows, strict=True)]
    tiles = worst(zip(alone, plain, strict=True))[0]
    half = worst(zip(low, got, strict=True))
    f.figures["logprobs"] = {
        "device_vs_cpu": dev,
        "batch_vs_alone": mates,
        "tiles_vs_plain": tiles,
        "bf16_max": half[0],
        "bf16_mean": half[1],
    }
    f.notes.append(
        f"log-probs dev-cpu {dev:.1e}, batch-alone {mates:.1e}, tiles-plain {tiles:.1e}, bf16 "
        f"max {half[0]:.2f} mean {half[1]:.3f}"
    )
    f.bound(dev, F32_BOUNDS[setting.model_kind][0], "log-probs device vs cpu")
    f.bound(mates, F32_BOUNDS[setting.model_kind][0], "log-probs batch vs alone")
    f.bound(tiles, PRIMITIVE_BOUND, "log-probs tiles vs plain")
    f.bound(half[0], BF16_BOUNDS["max"], "bf16 log-probs max")
    f.bound(half[1], BF16_BOUNDS["logprob_mean"], "bf16 log-probs mean")


def llama_comparison(setting, rows, got) -> tuple[float, float] | None:
    """(max, mean) of our float32 device logits against llama.cpp's (exact settings) on an
    F32 copy made by its own quantizer; None without llama-cpp-python."""
    if not setting.llama_cpp:
        return None
    from tests.factories.tiny_gguf import quantize
    from tests.oracles.llama_oracle import llama_logits

    threads = os.cpu_count() or 2
    f32 = Path(setting.model)
    if setting.model_kind != "tiny":  # the tiny model is F32 already
        f32 = quantize(f32, Path(setting.work) / "model-f32.gguf", "ALL_F32", threads=threads)
    import torch

    refs = [torch.from_numpy(llama_logits(f32, r, threads=threads)) for r in rows]
    return worst(zip(got, refs, strict=True))


# -- sampling --------------------------------------------------------------------------------


def sampling(setting):
    import torch

    from retrograd.sampling import Sampler

    dev = load(setting, torch.float32)
    cpu = dev if setting.device == "cpu" else load(setting, torch.float32, "cpu")
    prompts = chat_prompts(setting, dev)
    new = 8 if setting.quick else 32
    f = Findings()
    greedy = greedy_agreement(dev, cpu, prompts, new, F32_BOUNDS[setting.model_kind][0])
    f.figures["greedy"] = greedy
    f.notes.append(f"greedy f32: {greedy['equal']}/{greedy['answers']} equal to the CPU's")
    if greedy["unexplained"]:
        f.problems.append(f"greedy differs from the CPU's past a near-tie: {greedy['unexplained']}")
    elif greedy["near_ties"]:
        f.notes.append(f"{greedy['near_ties']} diverged at a near-tie")

    drawn = drawn_answers(Sampler(dev.decoder, dev.tokenizer, fast=False), dev, prompts, new)
    f.figures["sampled"] = drawn
    f.notes.append(
        f"sampled T=1 p=0.95: {drawn['tokens']} tokens, rescored within {drawn['gap']:.1e}"
    )
    f.problems += drawn["problems"]
    f.bound(drawn["gap"], F32_BOUNDS[setting.model_kind][0], "sampled log-probs vs rescored")

    with torch.no_grad():
        rows = torch.cat([dev.logits(p)[-4:] for p in prompts])  # (B, V) real logits
    nucleus_findings(f, nucleus_check(rows, setting.quick))
    return f.outcome()


def nucleus_findings(f: Findings, n: dict) -> None:
    f.figures["nucleus"] = n
    equal = n["prefix_checks"] - n["prefix_mismatches"]
    f.notes.append(
        f"fast nucleus = full sort on {n['draws']} draws ({n['mismatches']} differ), scan "
        f"prefixes {equal}/{n['prefix_checks']} equal, device log-probs vs float64 "
        f"{n['logprob_gap']:.1e}"
    )
    if n["mismatches"]:
        f.problems.append(f"fast nucleus differs from the full sort on {n['mismatches']} draws")
    if n["prefix_mismatches"]:
        f.problems.append(
            f"cumsum's prefixes depend on the row's length ({n['prefix_mismatches']} cases): "
            "select.py's exactness argument does not hold on this device"
        )
    f.bound(n["logprob_gap"], HOST_LOGPROB_BOUND, "device log-probs vs float64")
    if n["greedy_host_mismatches"]:
        f.problems.append(f"device greedy != host greedy on {n['greedy_host_mismatches']} rows")


def chat_prompts(setting, model) -> list[list[int]]:
    from retrograd.algorithms.context import chat_format

    questions = ["What is the capital of Peru?", "Name three colors.", "Count to five."]
    fmt = chat_format(model)
    picked = questions[: 2 if setting.quick else 3]
    return [fmt.prompt_ids([{"role": "user", "content": q}]) for q in picked]


def greedy_agreement(dev, cpu, prompts, new: int, tie: float) -> dict:
    """Greedy answers (exact context, float32) on the device and on the CPU. A divergence is
    a near-tie when the CPU's two best logits there differ by less than the float32 bound."""
    import torch

    from retrograd.sampling import Sampler
    from retrograd.sampling.params import SampleRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=new, stop_ids=frozenset())
    reqs = [SampleRequest(tuple(p), params) for p in prompts]
    a = [c[0].ids for c in Sampler(dev.decoder, dev.tokenizer, fast=False).generate(reqs)]
    b = [c[0].ids for c in Sampler(cpu.decoder, cpu.tokenizer, fast=False).generate(reqs)]
    out = {"answers": len(prompts), "equal": 0, "near_ties": 0, "unexplained": []}
    for p, x, y in zip(prompts, a, b, strict=True):
        if x == y:
            out["equal"] += 1
            continue
        k = next(i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t)
        with torch.no_grad():
            top = cpu.logits(list(p) + list(y[:k]))[-1].topk(2).values
        gap = float(top[0] - top[1])
        if gap <= tie:
            out["near_ties"] += 1
        else:
            out["unexplained"].append(f"token {k}: top-2 gap {gap:.3f}")
    return out


def drawn_answers(sampler, model, prompts, new: int) -> dict:
    """Sampled answers: ids in the vocabulary, log-probabilities finite and at most 0, and
    within the float32 bound of the same tokens rescored by model/logprobs.py."""
    from retrograd.sampling.params import SampleRequest, SamplingParams

    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=new, seed=7)
    answers = sampler.generate([SampleRequest(tuple(p), params, n=4) for p in prompts])
    problems, gap, tokens = [], 0.0, 0
    vocab = model.config.n_vocab
    rows, said = [], []
    for p, group in zip(prompts, answers, strict=True):
        for c in group:
            tokens += len(c.ids)
            if any(not 0 <= t < vocab for t in c.ids):
                problems.append("a sampled id outside the vocabulary")
            if any(not math.isfinite(x) or x > 1e-6 for x in c.logprobs):
                problems.append("a sampled log-probability not finite or above 0")
            rows.append(list(p) + list(c.ids))
            said.append(c.logprobs)
    for logp, lp in zip(said, scored_tail(model, rows, said), strict=True):
        gap = max(gap, max((abs(a - b) for a, b in zip(logp, lp, strict=True)), default=0.0))
    return {"tokens": tokens, "gap": gap, "problems": sorted(set(problems))}


def scored_tail(model, rows, said):
    """Each row's last len(said[i]) log-probabilities, scored by model/logprobs.py."""
    import torch

    from retrograd.model.logprobs import sequence_logprobs

    pairs = [(r, len(r) - len(s)) for r, s in zip(rows, said, strict=True)]
    with torch.no_grad():
        return [t.cpu().tolist() for t in sequence_logprobs(model.decoder, pairs)]


def nucleus_check(real, quick: bool) -> dict:
    """select.py on the device: the fast nucleus against the full sort, greedy against the
    host's, the device log-probabilities against float64, and the premise of the fast path
    (a sorted row's cumsum prefixes equal the cumsum of the prefix)."""
    import torch

    from retrograd.sampling.select import select_device, select_host, token_logprobs_device
    from retrograd.sampling.select import token_logprobs_host as host_lp

    dev = real.device
    gen = torch.Generator().manual_seed(0)
    V = max(real.shape[1], 262144)  # Gemma's vocabulary: wider than the 256 candidates
    synthetic = [torch.randn(8, V, generator=gen) * s for s in (1.0, 4.0, 12.0)]
    blocks = [real.float(), *(x.to(dev) for x in synthetic)]
    draws = mismatches = greedy_bad = 0
    lp_gap = 0.0
    for z in blocks:
        B = z.shape[0]
        zero = torch.zeros(B, device=dev)
        greedy = select_device(z, zero, torch.ones(B, device=dev), zero)
        greedy_bad += int((greedy.cpu() != select_host(z, zero, torch.ones(B), zero)).sum())
        for t, p in NUCLEUS_SETTINGS[: 4 if quick else None]:
            temp, top = torch.full((B,), t, device=dev), torch.full((B,), p, device=dev)
            for _ in range(2 if quick else 6):
                u = torch.rand(B, generator=gen).to(dev)
                fast = select_device(z, temp, top, u, fast_top_p=True)
                full = select_device(z, temp, top, u, fast_top_p=False)
                mismatches += int((fast != full).sum())
                draws += B
            lp = token_logprobs_device(z, temp, fast)
            lp_gap = max(lp_gap, float((lp.cpu() - host_lp(z, temp, fast)).abs().max()))
    checks, bad = prefix_property(blocks, quick)
    return {
        "draws": draws,
        "mismatches": mismatches,
        "greedy_host_mismatches": greedy_bad,
        "logprob_gap": lp_gap,
        "prefix_checks": checks,
        "prefix_mismatches": bad,
    }


def prefix_property(blocks, quick: bool) -> tuple[int, int]:
    """Count (checks, mismatches) of cumsum(vals)[:, :k] == cumsum(vals[:, :k]) bit for bit,
    vals each row's probabilities sorted high to low, for prefix lengths the selection uses."""
    import torch

    checks = bad = 0
    for z in blocks:
        vals = torch.softmax(z.float(), -1).sort(dim=-1, descending=True, stable=True).values
        whole = vals.cumsum(-1)
        n = vals.shape[1]
        for k in (1, 7, 256, 1000, 4097, 65536, n - 1)[: 4 if quick else None]:
            if k < n:
                checks += 1
                bad += int(not torch.equal(whole[:, :k], vals[:, :k].contiguous().cumsum(-1)))
    return checks, bad


# -- require_gpu_resident -----------------------------------------------------------------------


REFUSAL = "[training].require_gpu_resident = true: the run is on the CPU"


def gpu_resident(setting):
    """docs/configuration.md: require_gpu_resident (or RETRO_REQUIRE_GPU_RESIDENT=1) refuses a
    run on the CPU; on a GPU the start-up audit stops a run whose operations fall back."""
    from scripts.gpu_train import sft_run

    work = Path(setting.work)
    f = Findings()
    for how, env in (("key", {}), ("variable", {"RETRO_REQUIRE_GPU_RESIDENT": "1"})):
        run = sft_run(work / f"cpu-{how}", setting, device="cpu", resident=how == "key", steps=1)
        done = train(run, env)
        if done.returncode == 0 or REFUSAL not in done.stdout + done.stderr:
            f.problems.append(f"the CPU run with the {how} was not refused as documented")
    f.notes.append("CPU runs refused with the documented message (key and variable)")
    if setting.device != "cuda":
        f.notes.append("GPU half: no CUDA (--device cpu)")
        return f.outcome()
    report = f.figures["preflight"] = audit(setting)
    f.notes.append(f"preflight: {report['ops']} ops, fallbacks {report['problems'] or 'none'}")
    if report["problems"]:
        f.problems.append(f"operations fall back off the GPU: {', '.join(report['problems'])}")
    done = train(sft_run(work / "gpu", setting, device="gpu", resident=True, steps=2), {})
    if done.returncode != 0:
        f.problems.append(f"a GPU run with require_gpu_resident failed: {tail(done)}")
    else:
        f.notes.append("a GPU run with it completed")
    return f.outcome()


def audit(setting) -> dict:
    import torch

    from retrograd.trainable.preflight import preflight

    model = load(setting, torch.bfloat16)
    report = preflight(model.decoder, ["auto"])
    return {
        "ops": report.n_ops,
        "problems": report.problems,
        "loss": report.loss,
        "seconds": report.seconds,
    }


def train(run: Path, env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "retrograd.cli.main", "train", str(run)]
    return subprocess.run(
        cmd, cwd=run.parent, capture_output=True, text=True, env=os.environ | env, timeout=600
    )


def tail(done: subprocess.CompletedProcess) -> str:
    lines = [s for s in (done.stdout + done.stderr).strip().splitlines() if s.strip()]
    return lines[-1][:300] if lines else f"exit code {done.returncode}"


# The suite's tests whose tolerances the CPU's kernels decide (docs/exactness.md, "Batch mates"
# and "Other CPUs"): the model layer's (log-probabilities of rows with batch mates, the decode
# graph, attention, bf16 against float32), the pinned loops, and GRPO learning in bf16 as in
# float32. On the GPU machine's host CPU, an AMX CPU where it is a recent Intel Xeon.
HOST_TESTS = [
    "tests/unit/model",
    "tests/invariants",
    "tests/e2e/test_train_grpo.py::test_bf16_learns_as_float32_does",
]
HOST_TESTS_QUICK = ["tests/unit/model/test_logprobs.py", "tests/unit/model/test_decoder.py"]


def host_cpu(setting):
    """The suite's kernel-sensitive tests (HOST_TESTS) on the machine's own CPU, CUDA hidden,
    as `make test` runs them (float32 unless a test asks for bf16, the fused kernels compiled
    whatever RETRO_COMPILE the driver set); PASS when pytest passes.
    Reports the CPU, whether it has AMX or AVX512-BF16, PyTorch's kernel level and the
    default dtype there, and any failing test."""
    import importlib.util

    import torch

    from retrograd.model.device import cpu_flags, cpu_has_fast_bf16, cpu_name

    flags = cpu_flags()
    isa = [
        name for name in ("amx_tile", "amx_bf16", "avx512_bf16", "avx512f", "avx2") if name in flags
    ]
    figures = {
        "cpu": cpu_name(),
        "flags": isa,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "fast_bf16": cpu_has_fast_bf16(),
    }
    where = (
        f"{figures['cpu']} ({' '.join(isa) or 'no AVX2'}; PyTorch {figures['capability']}; "
        f"default dtype {'bf16' if figures['fast_bf16'] else 'float32'})"
    )
    if importlib.util.find_spec("pytest") is None:
        return failed(f"pytest is not installed: {where}", **figures)
    tests = HOST_TESTS_QUICK if setting.quick else HOST_TESTS
    env = os.environ | {
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
    }
    env.pop("RETRO_COMPILE", None)  # as `make test` runs: the fused kernels compiled
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *tests],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
    )
    out = done.stdout + done.stderr
    lines = [s for s in out.strip().splitlines() if s.strip()]
    failing = [s.split(" ", 1)[1].split(" - ")[0] for s in lines if s.startswith("FAILED ")]
    figures.update(summary=lines[-1] if lines else "", failing=failing)
    f = Findings()
    f.figures = figures
    f.notes.append(f"{figures['summary'].strip('= ')} on {where}")
    if done.returncode != 0:
        f.problems.append(
            f"pytest exit code {done.returncode}"
            + (f": {', '.join(failing[:5])}" if failing else "")
        )
    return f.outcome()
