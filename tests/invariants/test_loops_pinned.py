"""The seven training loops, pinned: what each reports, evaluates, checkpoints and exports on
tiny models, compared with tests/data/loops_pinned.json. A refactor that moves code between
the loops and the code they share must leave every figure here as it was.

Each loop (sft, offline distillation, preference dpo, grpo with a reward program, ppo with its
critic, on-policy distillation, agent_grpo in a local sandbox with forced turns) runs 2-4
optimizer steps in float32 on one thread with compilation off, with an evaluation and a
`steps` checkpoint. Recorded: every step's metrics (timing/ and system/ left out: they measure
the machine), evaluations, checkpoints written, the summary, the exported adapter (bytes by
sha256, and sums to compare on another machine) and the last checkpoint's progress, dataset
position, trajectory settings and artifacts.

Metrics compare at rtol 1e-6, adapters and checkpoints exactly, on the machine that wrote the
file (same torch, same CPU capability, same CPU model). On another CPU the float32 kernels
round apart (another instruction set, another vendor's BLAS path), and the test says which
comparison it makes instead (measured with AVX2's kernels on the AVX-512 machine that wrote
the file, `make test-avx2`):

- the loops whose batches do not depend on the weights (sft, distill_offline, preference):
  every figure at rtol 1e-3, the bytes not at all, and the adapters' signed sums not at all
  (a sum of values of both signs near 0 has no relative precision: -0.014 against 0.025 on
  AVX2, where every abs_sum agreed to 1e-3);
- the loops that sample (grpo, ppo, distill_on_policy, agent_grpo): the record's shape alone
  (every key, step, evaluation, checkpoint and metric name). A rounding-sized change of a
  logit can draw another token; from there the run is another run (on AVX2: ppo's first
  update, grpo's third; reward, entropy and ratios then differ by 5-400%).

Regenerate (only where a change of numbers is meant, in a commit of its own saying why):
    .venv/bin/python -m tests.invariants.test_loops_pinned --write
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from retrograd.model.device import cpu_name
from tests.factories.agents import CHAT_TEMPLATE

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "loops_pinned.json"
LOOPS = (
    "sft",
    "distill_offline",
    "preference",
    "grpo",
    "ppo",
    "distill_on_policy",
    "agent_grpo",
)
# metrics that measure the machine, not the run: times and throughput
UNPINNED = ("timing/", "system/", "judge/latency", "env/acquire_ms", "env/container_create_ms")
RTOL, LOOSE = 1e-6, 1e-3
# the loops that draw tokens from the model they train: on another CPU only their shape compares
SAMPLING = ("grpo", "ppo", "distill_on_policy", "agent_grpo")

TEXT = "the cat sat on the mat. the dog sat on the log. a bird sang in the tree. "
PROMPTS = ["write some letters", "say something", "spell a word", "what comes next"]
HELD = ["give a word", "and now"]
E_WORDS = ["see", "tee", "bee", "eel", "feet", "seen", "free", "tree"]
O_WORDS = ["moo", "too", "boo", "zoo", "food", "noon", "room", "pool"]
# the share of "e" in the answer
REWARD = r"""
import json, sys
for line in sys.stdin:
    req = json.loads(line)
    if "protocol" in req or "_retrograd_batch_end" in req:
        print(json.dumps(req, separators=(",", ":")), flush=True)
        continue
    text = req["completion"]
    print(json.dumps({"reward": text.count("e") / max(1, len(text)),
                      "_retrograd_batch": req["_retrograd_batch"],
                      "_retrograd_index": req["_retrograd_index"]}), flush=True)
"""
SANDBOX = """
[agent.environment]
type = "local"
allow_unsandboxed = true
[agent.environment.tools]
default = "mini"
[agent.environment.tools.toolset.mini]
tools = ["write_file"]
"""


# -- what a run leaves ------------------------------------------------------------------------


def recording_sinks():
    """Sinks that print nothing and keep every report."""
    from retrograd.observe.sinks import Sinks

    class Recording(Sinks):
        def __init__(self):
            super().__init__(quiet=True)
            self.record = {"steps": [], "evals": [], "checkpoints": [], "summary": None}

        def step(self, global_step, epoch, values, tokens, seconds, position=None):
            kept = {k: float(v) for k, v in sorted(values.items()) if not k.startswith(UNPINNED)}
            self.record["steps"].append([global_step, epoch, position, tokens, kept])

        def evaluation(self, global_step, values, improved):
            kept = {k: float(v) for k, v in sorted(values.items())}
            self.record["evals"].append([global_step, kept, bool(improved)])

        def checkpoint(self, path, global_step):
            self.record["checkpoints"].append([Path(path).name, global_step])

        def finish(self, summary):
            self.record["summary"] = {k: str(v) for k, v in summary.items()}

    return Recording()


def adapter_record(path: Path) -> dict:
    from gguf import GGUFReader

    out = {}
    for t in GGUFReader(path).tensors:
        values = torch.from_numpy(t.data.copy()).double()
        out[t.name] = {
            "sha256": hashlib.sha256(t.data.tobytes()).hexdigest(),
            "sum": values.sum().item(),
            "abs_sum": values.abs().sum().item(),
        }
    return out


def checkpoint_record(directory: Path) -> dict:
    """The last `steps` checkpoint's position, trajectory settings and artifacts."""
    from dataclasses import asdict

    from retrograd.checkpoint import latest_checkpoint, load_checkpoint

    state = load_checkpoint(latest_checkpoint(directory))
    return {
        "progress": asdict(state.progress),
        "dataset": asdict(state.dataset),
        "trajectory": dict(state.identity.trajectory_settings),
        "artifacts": {k: hashlib.sha256(v).hexdigest() for k, v in sorted(state.artifacts.items())},
    }


def plain(value, folders: dict[str, Path]):
    """JSON's view of a record, each folder's path written as its name ({"<tmp>": path})."""
    text = json.dumps(value, default=str, sort_keys=True)
    for name, path in folders.items():
        text = text.replace(str(path), name)
    return json.loads(text)


# -- the seven run files ----------------------------------------------------------------------


def jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path.name


def chats(prompts: list[str], answers: list[str] | None = None) -> list[dict]:
    return [
        {
            "messages": [{"role": "user", "content": p}]
            + ([{"role": "assistant", "content": answers[i]}] if answers else [])
        }
        for i, p in enumerate(prompts)
    ]


def run_file(tmp: Path, algorithm: str, model: Path, tables: dict, tail: str = "") -> Path:
    from tests.factories.run_files import write_run_file

    tables = {"checkpoint": 'directory = "ck"\nmode = "steps"\nevery_steps = 2', **tables}
    return write_run_file(tmp, algorithm, model, tables, tail=tail)


def sampling(tokens: int = 8) -> dict:
    return {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": tokens, "seed": 3}


def write_sft(tmp: Path, models: dict) -> Path:
    (tmp / "data.txt").write_text(TEXT)
    (tmp / "eval.txt").write_text(TEXT[:60])
    t = {"lr": 5e-3, "epochs": 2, "ctx": 32, "micro_batch": 16, "gradient_accumulation": 2}
    tables = {"training": t, "sft": {"data": "data.txt"}, "evaluation": {"data": "eval.txt"}}
    return run_file(tmp, "sft", models["student"], tables)


def write_distill_offline(tmp: Path, models: dict) -> Path:
    from retrograd.cli.main import main

    answers = [" ".join(E_WORDS[i : i + 3]) for i in range(len(PROMPTS))]
    d = {
        "teacher_path": str(models["teacher"]),
        "mode": "topk_offline",
        "data": jsonl(tmp / "corpus.jsonl", chats(PROMPTS, answers)),
        "sidecar": "corpus.topk",
        "offline_epochs": 1,
    }
    t = {"lr": 2e-2, "ctx": 64, "micro_batch": 32, "gradient_accumulation": 2}
    run = run_file(tmp, "distill", models["student"], {"training": t, "distill": d})
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        assert main(["distill-teacher", str(run), "--k", "8"]) == 0
    return run


def write_preference(tmp: Path, models: dict) -> Path:
    def pairs(prompts: list[str], shift: int) -> list[dict]:
        return [
            {
                "prompt": [{"role": "user", "content": q}],
                "chosen": [{"role": "assistant", "content": E_WORDS[i + shift]}],
                "rejected": [{"role": "assistant", "content": O_WORDS[i + shift]}],
            }
            for i, q in enumerate(prompts)
        ]

    p = {"data": jsonl(tmp / "pairs.jsonl", pairs(PROMPTS, 0)), "loss": "dpo"}
    t = {"lr": 1e-2, "ctx": 64, "micro_batch": 64, "epochs": 2}
    e = {"data": jsonl(tmp / "held.jsonl", pairs(HELD, 4))}
    return run_file(
        tmp, "preference", models["student"], {"training": t, "preference": p, "evaluation": e}
    )


def rollout_tables(tmp: Path, section: str, keys: dict, **extra) -> dict:
    (tmp / "reward.py").write_text(REWARD)
    s = {"prompts": jsonl(tmp / "prompts.jsonl", chats(PROMPTS)), **keys}
    if "reward_command" in keys:
        s["reward_command"] = [sys.executable, str(tmp / "reward.py")]
    jsonl(tmp / "held.jsonl", chats(HELD))
    return {
        "training": {"lr": 2e-2, "ctx": 64, "micro_batch": 64},
        section: s,
        **extra,
        f"{section}.sampling": sampling(),
        "evaluation": {"data": "held.jsonl", "every_iterations": 2},
    }


def write_grpo(tmp: Path, models: dict) -> Path:
    g = {
        "reward_command": True,
        "updates": 3,
        "prompts_per_update": 2,
        "group_size": 4,
        "grpo_epochs": 2,
        "clip_range_low": 0.2,
        "clip_range_high": 0.28,
        "kl_coefficient": 0.05,
    }
    return run_file(tmp, "grpo", models["student"], rollout_tables(tmp, "grpo", g))


def write_ppo(tmp: Path, models: dict) -> Path:
    p = {
        "reward_command": True,
        "updates": 2,
        "rollout_batch_size": 8,
        "ppo_epochs": 2,
        "clip_range": 0.2,
        "kl_coefficient": 0.05,
    }
    tables = rollout_tables(tmp, "ppo", p, **{"ppo.critic": {"enabled": True}})
    return run_file(tmp, "ppo", models["student"], tables)


def write_distill_on_policy(tmp: Path, models: dict) -> Path:
    d = {
        "teacher_path": str(models["teacher"]),
        "updates": 3,
        "prompts_per_update": 2,
        "samples_per_prompt": 2,
        "kl_coefficient": 0.05,
    }
    return run_file(tmp, "distill", models["student"], rollout_tables(tmp, "distill", d))


def write_agent_grpo(tmp: Path, models: dict) -> Path:
    scenarios = [
        {
            "id": f"file-{i}",
            "user": f"write 7 into answer.txt ({i})",
            "metadata": {"env": {"verify": {"command": ["grep", "-qx", "7", "answer.txt"]}}},
        }
        for i in range(4)
    ]
    a = {
        "scenarios": jsonl(tmp / "scenarios.jsonl", scenarios),
        "updates": 3,
        "scenarios_per_update": 2,
        "group_size": 4,
        "epochs_per_update": 2,
        "kl_coefficient": 0.05,
        "max_turns": 2,
        "max_new_tokens_per_turn": 128,
    }
    tables = {
        "training": {"lr": 2e-2, "ctx": 2048, "micro_batch": 2048},
        "agent": a,
        "evaluation": {"data": "scenarios.jsonl", "every_iterations": 2, "max_examples": 2},
    }
    return run_file(tmp, "agent_grpo", models["student"], tables, tail=SANDBOX)


def solving(seed: int, turn: int) -> str:
    """The forced turns of agent_grpo: even seeds write the answer, then stop; odd ones stop."""
    from tests.factories.agents import call

    if seed % 2 or turn > 0:
        return "done"
    return call("write_file", path="answer.txt", content="7")


def scripted_sampler(decoder, tokenizer, **settings):
    from tests.factories.agents import Scripted

    return Scripted(decoder, tokenizer, solving)


WRITERS = {
    "sft": write_sft,
    "distill_offline": write_distill_offline,
    "preference": write_preference,
    "grpo": write_grpo,
    "ppo": write_ppo,
    "distill_on_policy": write_distill_on_policy,
    "agent_grpo": write_agent_grpo,
}


# -- running them -----------------------------------------------------------------------------


@contextlib.contextmanager
def pinned_process(forced: bool):
    """One thread, compilation off, float32, and with `forced` the agent's forced turns (the
    run's sampler scripted); all put back after."""
    import retrograd.sampling.backend as sampling_backend

    saved = {k: os.environ.get(k) for k in ("RETRO_THREADS", "RETRO_COMPILE", "RETRO_DTYPE")}
    threads, sampler = torch.get_num_threads(), sampling_backend.Sampler
    os.environ.update(RETRO_THREADS="1", RETRO_COMPILE="0", RETRO_DTYPE="float32")
    if forced:
        sampling_backend.Sampler = scripted_sampler
    try:
        yield
    finally:
        sampling_backend.Sampler = sampler
        torch.set_num_threads(threads)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def write_models(root: Path) -> dict[str, Path]:
    """A tiny gemma3 with a chat template, and another (other weights, same vocabulary) as
    the distillation teacher."""
    from tests.factories.tiny_gguf import write_tiny

    return {
        "student": write_tiny(root / "student.gguf", "gemma3", chat_template=CHAT_TEMPLATE),
        "teacher": write_tiny(root / "teacher.gguf", "gemma3", seed=1, chat_template=CHAT_TEMPLATE),
    }


def run_loop(name: str, models: dict, tmp: Path) -> dict:
    """Run one loop in tmp (its working directory meanwhile) -> its record."""
    from retrograd.algorithms.agent_grpo import run_agent_grpo
    from retrograd.algorithms.distill import run_distill
    from retrograd.algorithms.grpo import run_grpo
    from retrograd.algorithms.ppo import run_ppo
    from retrograd.algorithms.preference import run_preference
    from retrograd.algorithms.sft import run_sft
    from retrograd.config import load_run

    loops = {
        "sft": run_sft,
        "distill_offline": run_distill,
        "preference": run_preference,
        "grpo": run_grpo,
        "ppo": run_ppo,
        "distill_on_policy": run_distill,
        "agent_grpo": run_agent_grpo,
    }
    cwd = Path.cwd()
    os.chdir(tmp)
    try:
        with pinned_process(forced=name == "agent_grpo"):
            run = WRITERS[name](tmp, models)
            sinks = recording_sinks()
            loops[name](load_run(run), sinks=sinks, run_file=run)
    finally:
        os.chdir(cwd)
    record = {
        **sinks.record,
        "adapter": adapter_record(tmp / "out" / "adapter.gguf"),
        "checkpoint": checkpoint_record(tmp / "ck"),
    }
    return plain(record, {"<tmp>": tmp, "<models>": models["student"].parent})


def machine() -> dict:
    """What decides the float32 kernels: torch, the instruction set it dispatches to, and the
    CPU (an Intel CPU with AMX and an AMD one with AVX-512 both report "AVX512")."""
    return {
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "model": cpu_name(),
    }


# -- comparing --------------------------------------------------------------------------------


def differences(want, got, rtol: float, exact: bool, where: str = "") -> list[str]:
    """Every place got departs from want: numbers beyond rtol, anything else unequal.
    Without `exact`, sha256 digests are not compared."""
    if isinstance(want, dict) and isinstance(got, dict):
        if set(want) != set(got):
            return [f"{where}: keys {sorted(set(want) ^ set(got))} differ"]
        out = []
        for k in want:
            if not exact and k == "sha256":
                continue
            out += differences(want[k], got[k], rtol, exact, f"{where}.{k}")
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{where}: {len(got)} entries, pinned {len(want)}"]
        pairs = enumerate(zip(want, got, strict=True))
        return [d for i, (a, b) in pairs for d in differences(a, b, rtol, exact, f"{where}[{i}]")]
    numbers = (int, float)
    if isinstance(want, numbers) and isinstance(got, numbers) and not isinstance(want, bool):
        if want == got or math.isclose(want, got, rel_tol=rtol, abs_tol=rtol * 1e-3):
            return []
        if math.isnan(want) and math.isnan(got):
            return []
        return [f"{where}: {got!r}, pinned {want!r}"]
    return [] if want == got else [f"{where}: {got!r}, pinned {want!r}"]


def portable(record: dict) -> dict:
    """A record without what only the machine that wrote it reproduces: byte digests (the
    adapter's, the checkpoint's artifacts, kept by name), the adapters' signed sums, and the
    summary's figures (its lines kept by name; the steps hold the same figures)."""
    return {
        **record,
        "adapter": {k: {"abs_sum": v["abs_sum"]} for k, v in record["adapter"].items()},
        "checkpoint": {
            **record["checkpoint"],
            "artifacts": sorted(record["checkpoint"]["artifacts"]),
        },
        "summary": sorted(record["summary"] or ()),
    }


def shape(value):
    """A record's shape: its keys and list lengths, every leaf its type's name."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


def compare(name: str, want: dict, got: dict, same: bool) -> tuple[list[str], str]:
    """The differences between a pinned record and a run's, and how they were compared."""
    if same:
        return differences(want, got, RTOL, exact=True), f"at rtol {RTOL}, bytes exactly"
    if name not in SAMPLING:
        how = f"at rtol {LOOSE}, without bytes or signed sums"
        return differences(portable(want), portable(got), LOOSE, exact=True), how
    return differences(shape(want), shape(got), 0, exact=True), "by shape alone (it samples)"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return write_models(tmp_path_factory.mktemp("pinned"))


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", LOOPS)
def test_the_loop_reports_and_trains_as_pinned(name, models, golden, tmp_path):
    got = run_loop(name, models, tmp_path)
    same = golden["machine"] == machine()
    found, how = compare(name, golden["loops"][name], got, same)
    if not same:
        warnings.warn(
            f"{GOLDEN.name} was written on {golden['machine']}, this is {machine()}: "
            f"{name} compared {how}",
            stacklevel=1,
        )
    assert not found, f"{name}: {len(found)} differences\n" + "\n".join(found[:40])


def test_another_cpu_compares_what_it_can():
    """On another CPU a sampling loop's figures are not compared but its shape is, and a loop
    that does not sample still compares its figures, without the signed sums."""
    want = {
        "steps": [[1, 0, None, 8, {"train/loss": 2.0}]],
        "adapter": {"a": {"sha256": "x", "sum": 0.02, "abs_sum": 9.0}},
        "checkpoint": {"artifacts": {"first.bin": "y"}},
        "summary": {"loss": "2.0 -> 1.0"},
    }
    moved = json.loads(json.dumps(want))
    moved["adapter"]["a"].update(sha256="z", sum=-0.01)
    moved["checkpoint"]["artifacts"]["first.bin"] = "w"
    moved["summary"]["loss"] = "2.0 -> 1.1"
    assert compare("sft", want, moved, same=False)[0] == []
    assert compare("sft", want, moved, same=True)[0] != []
    moved["steps"][0][4]["train/loss"] = 2.01
    assert compare("sft", want, moved, same=False)[0] != []
    assert compare("grpo", want, moved, same=False)[0] == []
    moved["steps"][0][4]["policy/kl"] = 0.0
    assert compare("grpo", want, moved, same=False)[0] != []
    moved["steps"][0][4].pop("policy/kl")
    moved["steps"].append(moved["steps"][0])
    assert compare("grpo", want, moved, same=False)[0] != []


def test_the_pinned_file_covers_every_loop(golden):
    assert tuple(golden["loops"]) == LOOPS
    assert set(SAMPLING) < set(LOOPS)
    for name, record in golden["loops"].items():
        assert record["steps"] and record["adapter"], name
        assert record["checkpoint"]["progress"]["global_step"] > 0, name
        # each loop evaluates, except offline distillation (it refuses [evaluation])
        assert bool(record["evals"]) == (name != "distill_offline"), name


def write() -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        models = write_models(root)
        loops = {}
        for name in LOOPS:
            (root / name).mkdir()
            loops[name] = run_loop(name, models, root / name)
            print(f"{name}: {len(loops[name]['steps'])} steps", flush=True)
    text = json.dumps({"machine": machine(), "loops": loops}, indent=1, sort_keys=False)
    tmp = GOLDEN.with_suffix(".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(GOLDEN)
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: python -m tests.invariants.test_loops_pinned --write\n{__doc__}")
    write()
