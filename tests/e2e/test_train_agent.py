"""`retrograd train` for agentic GRPO, end to end on a tiny model: trajectories act in a real
local sandbox and are scored by its verify command (forced turns), or by a command judge
(sampled turns); the run trains, observes, resumes exactly after a kill, and refuses bad
input before the model loads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import retrograd.algorithms.agent_grpo as agent_grpo
import retrograd.sampling.backend as sampling_backend
from retrograd.cli.main import main
from retrograd.config import load_run
from retrograd.errors import DataError, TrainingError
from tests.e2e.test_train_grpo import phase_seconds, sinks
from tests.e2e.test_train_sft import scalars
from tests.factories.agents import CHAT_TEMPLATE, Scripted, call
from tests.factories.run_files import write_run_file
from tests.unit.agent.test_container_env import cli as container_cli

# the judge of sampled (tool-less) trajectories: the share of "e" in what the assistant wrote
JUDGE = r"""
import json, sys
for line in sys.stdin:
    req = json.loads(line)
    text = req["completion"]
    print(json.dumps({"reward": text.count("e") / max(1, len(text))}), flush=True)
"""


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    from tests.factories.tiny_gguf import write_tiny

    path = tmp_path_factory.mktemp("agent") / "tiny-chat.gguf"
    return write_tiny(path, "gemma3", chat_template=CHAT_TEMPLATE)


CONTAINER = """
[agent.environment]
type = "container"
profile = "custom"
image = "localhost/retrograd-agent:bookworm"
[agent.environment.pool]
max_live = 4
reuse = "workspace"
[agent.environment.limits]
memory_mb = 256
[agent.environment.tools]
default = "mini"
[agent.environment.tools.toolset.mini]
tools = ["write_file"]
"""


def write_run(
    tmp: Path, model: Path, agent: dict | None = None, *, env=True, world=None, **sections
) -> Path:
    scenarios = [
        {
            "id": f"file-{i}",
            "user": f"write {i} into answer.txt",
            "metadata": {
                "env": {
                    "files": {"notes.txt": "hello"},
                    "verify": {"command": ["grep", "-qx", str(i), "answer.txt"]},
                }
            }
            if env
            else {},
        }
        for i in range(4)
    ]
    (tmp / "scenarios.jsonl").write_text("".join(json.dumps(s) + "\n" for s in scenarios))
    (tmp / "judge.py").write_text(JUDGE)
    a = {
        "scenarios": "scenarios.jsonl",
        "updates": 4,
        "scenarios_per_update": 2,
        "group_size": 4,
        "epochs_per_update": 2,
        "max_turns": 3,
        "max_new_tokens_per_turn": 96 if env else 8,
    }
    a.update(agent or {})
    t = {"lr": 2e-2, "ctx": 2048 if env else 128, "micro_batch": 2048 if env else 128}
    t.update(sections.pop("training", {}))
    world = world or (
        """
[agent.environment]
type = "local"
allow_unsandboxed = true
[agent.environment.tools]
default = "mini"
[agent.environment.tools.toolset.mini]
tools = ["write_file"]
"""
        if env
        else f"""
[agent.judge]
type = "command"
command = [{json.dumps(sys.executable)}, {json.dumps(str(tmp / "judge.py"))}]
"""
    )
    tables = {"training": t, "agent": a}
    return write_run_file(tmp, "agent_grpo", model, tables, sections, tail=world)


def solving(seed: int, turn: int) -> str:
    """Half the trajectories write the right file and stop; the others answer without a call."""
    if seed % 2:
        return "no idea"
    if turn == 0:
        return "!target"
    return "done"


def force(monkeypatch, script) -> list:
    """The loop's sampler writes script(seed, turn, target), target the scenario's number
    (the groups of a wave are rolled one at a time, so that each knows its target). -> the
    list the training groups' samples are added to."""
    made, seen = [], []

    def sampler(decoder, tokenizer, **settings):
        made.append(
            Scripted(decoder, tokenizer, lambda seed, turn: script(seed, turn, made[0].target))
        )
        return made[-1]

    real_roll = agent_grpo.AgentRoller.roll

    def roll(self, groups, on_turn=None):
        out = []
        for g in groups:
            self.sampler.target = int(g[0].id.split("-")[1])
            out += real_roll(self, [g], on_turn)
        if len(groups[0][1]) > 1:  # training groups, not held-out trajectories
            seen.extend(s for grp in out for s in grp)
        return out

    monkeypatch.setattr(sampling_backend, "Sampler", sampler)
    monkeypatch.setattr(agent_grpo.AgentRoller, "roll", roll)
    return seen


def writes_target(seed: int, turn: int, target: int) -> str:
    """solving(), with the scenario's number written where it says "!target"."""
    text = solving(seed, turn)
    return call("write_file", path="answer.txt", content=str(target)) if text == "!target" else text


def test_a_local_sandbox_verifies_and_the_policy_tokens_train(chat_model, tmp_path, monkeypatch):
    """Forced turns: the trajectories that write the right answer are verified (reward 1),
    the others are not (0); the update trains on the policy's tokens only and is observed."""
    seen = force(monkeypatch, writes_target)
    run = write_run(
        tmp_path,
        chat_model,
        observe='directory = "obs"',
        metrics='tensorboard_dir = "tb"',
        evaluation='data = "scenarios.jsonl"\nevery_iterations = 2\nmax_examples = 3',
    )
    result = agent_grpo.run_agent_grpo(load_run(run), run_file=run, sinks=sinks())
    assert result.iterations == 4 and result.global_step == 8
    # held-out: one trajectory per scenario at updates 2 and 4, seeds fixed for the run
    assert [u for u, _ in result.evals] == [2, 4]
    assert result.evals[0][1] == result.evals[1][1]  # forced turns: the same answers
    assert sorted(scalars(tmp_path / "tb", "eval/mean_reward")) == [4, 8]
    assert (tmp_path / "out" / "adapter.gguf").exists()
    by_parity = {0: set(), 1: set()}
    for s in seen:
        by_parity[s.traj.seed % 2].add(s.traj.reward)
        assert s.traj.finish == "no_tool_call"
    assert by_parity == {0: {1.0}, 1: {0.0}}
    evens = [s.traj.seed % 2 == 0 for s in seen]
    assert result.curve == pytest.approx([np.mean(evens[u * 8 : u * 8 + 8]) for u in range(4)])
    tb = tmp_path / "tb"
    assert sorted(scalars(tb, "policy/surrogate_loss")) == [2, 4, 6, 8]  # logged per update
    assert scalars(tb, "agent/turns_per_traj_mean")
    reuse = scalars(tb, "generation/prefill_reuse_fraction")
    assert reuse and all(v > 0 for v in reuse.values())
    records = [json.loads(line) for line in (tmp_path / "obs" / "observe.jsonl").open()]
    rollouts = [r for r in records if r["type"] == "rollout"]
    assert len(rollouts) == 4 * 2 * 4
    solved = [r for r in rollouts if r["seed"] % 2 == 0]
    assert all(
        r["messages"][1]["tool_calls"][0]["function"]["name"] == "write_file" for r in solved
    )
    assert all(r["messages"][2]["content"].startswith("wrote ") for r in solved)
    outcomes = [e for r in records if r["type"] == "outcome" for e in r["entries"]]
    assert len(outcomes) == 32 and any(e["trained"] for e in outcomes)
    assert all(e["trained"] == (e["skip_reason"] is None) for e in outcomes)
    assert {r["type"] for r in records} >= {"selection", "outcome", "update"}


def test_profile_reports_agentic_phases_and_writes_nothing(
    chat_model, tmp_path, monkeypatch, capsys
):
    """`retrograd profile` on an agent_grpo run: forced turns in a local sandbox, the shortened
    workload (scenarios x group 4, one optimizer pass), every phase measured, nothing of what
    the run file names written (output, observe, metrics)."""
    force(monkeypatch, writes_target)
    run = write_run(
        tmp_path,
        chat_model,
        observe='directory = "obs"',
        metrics='tensorboard_dir = "tb"',
        evaluation='data = "scenarios.jsonl"',
    )
    assert main(["profile", str(run), "--prompts", "2"]) == 0
    out = capsys.readouterr().out
    assert (
        "agent_grpo, 1 updates x 2 scenarios x group 4, 1 epoch(s), up to 96 new tokens a turn"
        in out
    )
    assert "backend: device cpu, compute float32" in out and "peak host memory" in out
    rows = phase_seconds(out)
    phases = ["initialization", "generation", "tools and episodes", "judge", "reference scoring"]
    assert list(rows) == [*phases, "optimizer", "other", "total"], out
    for phase in ("generation", "tools and episodes", "optimizer"):
        assert rows[phase] > 0, rows
    assert "optimizer steps: 1 (none where every group scored alike)" in out
    for name in ("out", "obs", "tb"):
        assert not (tmp_path / name).exists(), name


REPO = Path(__file__).resolve().parents[2]


def _train(run: Path, *extra: str, wait_for: Path | None = None) -> subprocess.CompletedProcess:
    """The real command in its own process, with forced turns (tests/factories/agent_train.py);
    with wait_for, killed with SIGKILL as soon as that checkpoint exists."""
    cmd = [sys.executable, "-m", "tests.factories.agent_train", "train", str(run), *extra]
    env = os.environ | {"RETRO_THREADS": "2", "PYTHONPATH": str(REPO)}
    if wait_for is None:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
    deadline = time.monotonic() + 600
    while not (wait_for / "manifest.msgpack").exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL  # killed, not finished
    return subprocess.CompletedProcess(cmd, proc.returncode)


@pytest.mark.slow
def test_judged_trajectories_train_and_resume_exactly_after_a_kill(chat_model, tmp_path):
    """No environment: one-turn trajectories ("eeee" or "abcd") scored by the command judge.
    A run killed after its checkpoint at step 4 and resumed ends with the uninterrupted run's
    adapter."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for d in (whole, cut):
        d.mkdir()
        write_run(
            d, chat_model, env=False, checkpoint='directory = "ck"\nmode = "steps"\nevery_steps = 4'
        )
    done = _train(whole / "run.toml")
    assert done.returncode == 0, done.stderr
    _train(cut / "run.toml", wait_for=cut / "ck" / "step-000000000004.state")
    assert not (cut / "out" / "adapter.gguf").exists()
    resumed = _train(cut / "run.toml", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert (whole / "out" / "adapter.gguf").read_bytes() == (
        cut / "out" / "adapter.gguf"
    ).read_bytes()


def test_too_few_trajectories_fail_or_skip(chat_model, tmp_path, monkeypatch):
    """Every trajectory cut by max_turns and dropped: the run stops (max_dropped_fraction), or
    with max_dropped_fraction = 1 the update has nothing to train and skips when asked."""
    force(monkeypatch, writes_target)
    monkeypatch.setattr("tests.e2e.test_train_agent.solving", lambda seed, turn: "!target")
    run = write_run(tmp_path, chat_model, {"max_turns": 1, "updates": 1})
    with pytest.raises(TrainingError, match="max_dropped_fraction"):
        agent_grpo.run_agent_grpo(load_run(run), run_file=run, sinks=sinks())
    run = write_run(
        tmp_path, chat_model, {"max_turns": 1, "updates": 1, "max_dropped_fraction": 1.0}
    )
    with pytest.raises(TrainingError, match="skip_empty_updates"):
        agent_grpo.run_agent_grpo(load_run(run), run_file=run, sinks=sinks())
    run = write_run(
        tmp_path,
        chat_model,
        {"max_turns": 1, "updates": 1, "max_dropped_fraction": 1.0, "skip_empty_updates": True},
    )
    result = agent_grpo.run_agent_grpo(load_run(run), run_file=run, sinks=sinks())
    assert result.counts["skipped"] == 1 and result.global_step == 0
    # every trajectory complete and scored alike: usable, nothing to learn, no error
    monkeypatch.setattr("tests.e2e.test_train_agent.solving", lambda seed, turn: "no idea")
    run = write_run(tmp_path, chat_model, {"updates": 1})
    result = agent_grpo.run_agent_grpo(load_run(run), run_file=run, sinks=sinks())
    assert (
        result.counts["skipped"] == 0
        and result.counts["no_signal"] == 1
        and result.global_step == 0
    )


def test_min_reward_trains_a_cut_trajectory_at_the_group_minimum(chat_model, tmp_path, monkeypatch):
    """Even members write the answer and stop (1.0); odd ones write a wrong one and are cut by
    max_turns (their own verify: 0). With truncation = "min_reward" the cut ones train at the
    group's minimum, 0, not at the minimum of the complete ones (1.0): the groups have signal."""

    def script(seed, turn, target):
        if seed % 2 == 0:
            return (
                call("write_file", path="answer.txt", content=str(target)) if turn == 0 else "done"
            )
        return call("write_file", path="answer.txt", content="x")

    force(monkeypatch, script)
    seen = []
    real = agent_grpo.drop_and_advantage

    def spy(cfg, groups, update):
        out = real(cfg, groups, update)
        seen.extend(r for g in groups for r in g.members)
        return out

    monkeypatch.setattr(agent_grpo, "drop_and_advantage", spy)
    run = write_run(
        tmp_path, chat_model, {"updates": 1, "max_turns": 2, "truncation": "min_reward"}
    )
    result = agent_grpo.run_agent_grpo(load_run(run), run_file=run, sinks=sinks())
    mixed = {r.group for r in seen if r.seed % 2} & {r.group for r in seen if r.seed % 2 == 0}
    assert mixed and result.global_step == 2
    for r in seen:
        cut = r.seed % 2 == 1
        assert r.truncated == cut and r.reward == (0.0 if cut else 1.0)
        if r.group in mixed:  # a group of both kinds has signal: the cut ones push down
            assert r.skip_reason is None and r.trained and (r.advantage < 0) == cut
        else:
            assert r.skip_reason == "zero_signal"


def test_bad_scenarios_are_refused_before_the_model_loads(
    chat_model, tmp_path, capsys, monkeypatch
):
    import retrograd.model.model

    monkeypatch.setattr(
        retrograd.model.model, "load", lambda *a, **k: pytest.fail("the model loaded")
    )
    run = write_run(tmp_path, chat_model)
    lines = (tmp_path / "scenarios.jsonl").read_text().splitlines()
    lines[2] = json.dumps({"id": "x", "user": "u", "extra": 1})
    (tmp_path / "scenarios.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["train", str(run)]) == 1
    err = capsys.readouterr().err
    assert "scenarios.jsonl:3" in err and 'unknown key "extra"' in err
    lines[2] = json.dumps({"id": "x", "user": "u", "metadata": {"env": {"toolset": "python"}}})
    (tmp_path / "scenarios.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["train", str(run)]) == 1
    assert "scenarios.jsonl:3" in capsys.readouterr().err
    with pytest.raises(DataError, match="not verifiable|no metadata.env.verify"):
        held = tmp_path / "held.jsonl"
        held.write_text(json.dumps({"id": "h", "user": "u"}) + "\n")
        run = write_run(tmp_path, chat_model, evaluation='data = "held.jsonl"')
        agent_grpo.run_agent_grpo(load_run(run), run_file=run, sinks=sinks())


def test_collect_keeps_verified_traces_that_sft_and_preference_read(
    chat_model, tmp_path, monkeypatch, capsys
):
    """retrograd collect with the local model (forced turns): scenario i is rolled from seeds
    42 + 4i + j; members with an even j write the right answer. One verified trace per
    scenario is kept, written as tool records the SFT reader takes; --pairs writes pairs."""
    from retrograd.data.pairs import read_pairs
    from retrograd.data.sft import load_sft_data
    from retrograd.gguf import GGUFFile
    from retrograd.tokenizer import ChatFormat, chat_template, load_tokenizer

    def script(seed, turn):
        i, j = divmod(seed - 42, 4)
        if j % 2 or turn:
            return "no idea" if turn == 0 else "done"
        return call("write_file", path="answer.txt", content=str(i))

    monkeypatch.setattr(
        sampling_backend, "Sampler", lambda d, t, **settings: Scripted(d, t, script)
    )
    run = write_run(tmp_path, chat_model, {"group_size": 4})
    out, report = tmp_path / "traces.jsonl", tmp_path / "report.json"
    assert main(["collect", str(run), "--out", str(out), "--report", str(report)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 4 and not (tmp_path / "traces.jsonl.tmp").exists()
    for i, r in enumerate(records):
        assert r["metadata"]["scenario_id"] == f"file-{i}" and r["metadata"]["reward"] == 1.0
        assert r["metadata"]["member"] % 2 == 0
        assert r["messages"][1]["tool_calls"][0]["function"]["arguments"] == {
            "path": "answer.txt",
            "content": str(i),
        }
    stats = json.loads(report.read_text())
    assert stats["attempted"] == 16 and stats["kept"] == 4
    tok = load_tokenizer(chat_model)
    chat = ChatFormat(tok, chat_template(tok, GGUFFile(chat_model).metadata))
    data = load_sft_data(out, tok, 4096, chat=chat)
    assert len(data.examples) == 4 and data.n_targets > 0
    pairs = tmp_path / "pairs.jsonl"
    assert main(["collect", str(run), "--out", str(pairs), "--pairs", "--min-gap", "0.5"]) == 0
    read = read_pairs(pairs)
    assert len(read) == 4
    capsys.readouterr()


def test_an_http_environment_with_step_rewards_and_an_mcp_server_trains(
    chat_model, tmp_path, monkeypatch
):
    """A real HTTP environment (tests/factories/env_server.py: reach the target 3 with `add`,
    0.1 a step, 1.0 on reaching it, an opening observation) beside a real stateless MCP server
    over stdio. Even seeds reach 3 in one call; odd ones ask the MCP server to add, then add 1
    twice and stop. Rewards are final + step rewards; every episode is closed."""
    from tests.factories.env_server import env_server
    from tests.factories.mcp_server import stdio_command

    def script(seed, turn):
        if seed % 2 == 0:
            return [call("add", by=3), "done"][turn]
        return [call("calc__add", a=1, b=2), call("add", by=1), call("add", by=1), "stop"][turn]

    monkeypatch.setattr(
        sampling_backend, "Sampler", lambda d, t, **settings: Scripted(d, t, script)
    )
    seen = []
    real = agent_grpo.drop_and_advantage

    def spy(cfg, groups, update):
        out = real(cfg, groups, update)
        seen.extend(r for g in groups for r in g.members)
        return out

    monkeypatch.setattr(agent_grpo, "drop_and_advantage", spy)
    with env_server() as server:
        scenarios = [
            {"id": f"c{i}", "user": "reach the target", "metadata": {"target": 3, "greet": True}}
            for i in range(2)
        ]
        (tmp_path / "scenarios.jsonl").write_text("".join(json.dumps(s) + "\n" for s in scenarios))
        run = tmp_path / "run.toml"
        run.write_text(
            f"""
[run]
algorithm = "agent_grpo"
[model]
path = "{chat_model}"
device = "cpu"
[output]
path = "out/adapter.gguf"
[lora]
rank = 4
alpha = 8.0
[training]
lr = 1e-2
ctx = 2048
micro_batch = 2048
[agent]
scenarios = "scenarios.jsonl"
updates = 1
scenarios_per_update = 2
group_size = 4
epochs_per_update = 1
max_turns = 4
max_new_tokens_per_turn = 96
[agent.environment]
type = "http"
base_url = "{server.url}"
pool_size = 8
[[agent.mcp_servers]]
name = "calc"
command = {json.dumps(stdio_command())}
stateless = true
allowed_tools = ["add"]
"""
        )
        result = agent_grpo.run_agent_grpo(load_run(run), run_file=run, sinks=sinks())
        assert result.global_step == 1
        assert len(server.closed) == 8 == len(server.games)
    rewards = {}
    for r in seen:
        traj = r.extra["sample"].traj
        assert traj.messages[1] == {"role": "user", "content": "counter 0, target 3"}
        assert [t["function"]["name"] for t in traj.tools] == ["add", "echo", "calc__add"]
        rewards.setdefault(traj.seed % 2, set()).add(round(traj.reward, 6))
        if traj.seed % 2:
            assert traj.messages[3]["content"] == "3"  # the MCP server's answer
            assert traj.step_rewards == [pytest.approx(0.1), pytest.approx(0.1)]
            returns = r.extra["returns"]
            trained = returns[r.token_mask > 0]
            assert abs(trained.mean()) < 1e-9 and trained.max() > trained.min()
        else:
            assert traj.finish == "done" and traj.step_rewards == [1.0]
    assert rewards == {0: {1.0}, 1: {0.2}}


podman = pytest.fixture(container_cli.__wrapped__, scope="module", name="podman")


@pytest.mark.slow
def test_trajectories_act_in_containers(chat_model, tmp_path, monkeypatch, podman):
    """The forced writers of the local test, each trajectory in its own podman container
    (the test image; a pool of 4 reused containers): verified where they wrote the answer."""
    monkeypatch.setenv("RETRO_CONTAINER_CLI", podman[0])
    force(monkeypatch, writes_target)
    run = write_run(
        tmp_path, chat_model, {"updates": 1}, world=CONTAINER, metrics='tensorboard_dir = "tb"'
    )
    result = agent_grpo.run_agent_grpo(load_run(run), run_file=run, sinks=sinks())
    assert result.iterations == 1 and 0 < result.curve[0] < 1
    tb = tmp_path / "tb"
    assert scalars(tb, "env/pool_reuse_fraction")[2] > 0  # 8 leases of at most 4 containers
    assert scalars(tb, "env/live_containers_max")[2] <= 4
    assert scalars(tb, "env/sandbox_broken_fraction")[2] == 0.0
    listed = subprocess.run(
        [podman[0], "ps", "-a", "-q", "--filter", f"label=retrograd.pid={os.getpid()}"],
        capture_output=True,
        text=True,
    )
    assert listed.stdout.split() == []  # every container removed at the end of the run


def test_the_reference_default_micro_batch_gives_the_whole_context_update(
    chat_model, tmp_path, monkeypatch
):
    """Judged one-turn trajectories at ctx 128 with the default micro_batch (32: a group's
    trajectories are scored in several passes) and with micro_batch = ctx: the same first step."""
    from gguf import GGUFReader

    from tests.factories.agent_train import script

    monkeypatch.setattr(
        sampling_backend, "Sampler", lambda d, t, **settings: Scripted(d, t, script)
    )
    adapters, losses = [], []
    for micro in (None, 128):
        tmp = tmp_path / str(micro)
        tmp.mkdir()
        training = {"micro_batch": micro} if micro else {}
        run = write_run(
            tmp,
            chat_model,
            {"updates": 1, "epochs_per_update": 1},
            env=False,
            training=training,
            metrics='tensorboard_dir = "tb"',
        )
        text = run.read_text()
        if micro is None:
            text = text.replace("micro_batch = 128\n", "")
        run.write_text(text)
        cfg = load_run(run)
        assert cfg.training.micro_batch == (micro or 32)
        agent_grpo.run_agent_grpo(cfg, run_file=run, sinks=sinks())
        reader = GGUFReader(tmp / "out" / "adapter.gguf")
        adapters.append({t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors})
        losses.append(scalars(tmp / "tb", "policy/surrogate_loss")[1])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-7)
    default, whole = adapters
    moved = sum(float(np.abs(v).sum()) for k, v in whole.items() if k.endswith(".lora_b"))
    diff = sum(float(np.abs(default[k] - whole[k]).sum()) for k in whole)
    assert moved > 0 and diff < 1e-3 * moved, (diff, moved)


def _short(factory: str, name: str) -> str:
    """A built-in tool under its own name with a one-word description: a short prompt."""
    return f"""
[[agent.environment.tools.tool]]
id = "{name}-short"
version = 1
name = "{name}"
description = "."
builtin = {{ factory = "{factory}" }}
"""


HOSTILE_WORLD = (
    """
[agent.environment]
type = "local"
allow_unsandboxed = true
[agent.environment.tools]
default = "short"
[agent.environment.tools.toolset.short]
tools = ["bash-short", "read_file-short", "write_file-short"]
"""
    + _short("shell", "bash")
    + _short("read_file", "read_file")
    + _short("write_file", "write_file")
)


@pytest.mark.slow
def test_a_policy_writing_hostile_calls_trains_to_the_end(chat_model, tmp_path):
    """The real command, its policy forced to write calls no tool can run (a NUL byte in a
    command, a path out of the workspace, an unknown tool, wrong types and keys, a lone
    surrogate, nesting past the limit, NaN: tests/factories/agent_train.py's `hostile`): each
    is answered with an error, no trajectory fails, and the run trains and exits 0."""
    agent = {"updates": 1, "group_size": 4, "epochs_per_update": 1, "max_turns": 4}
    agent["max_new_tokens_per_turn"] = 400
    training = {"ctx": 4096, "micro_batch": 4096}
    run = write_run(
        tmp_path,
        chat_model,
        agent,
        world=HOSTILE_WORLD,
        observe='directory = "obs"',
        training=training,
    )
    cmd = [sys.executable, "-m", "tests.factories.agent_train", "train", str(run)]
    env = os.environ | {
        "RETRO_THREADS": "2",
        "PYTHONPATH": str(REPO),
        "RETRO_AGENT_SCRIPT": "hostile",
    }
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "out" / "adapter.gguf").exists()
    records = [json.loads(line) for line in (tmp_path / "obs" / "observe.jsonl").open()]
    rollouts = [r for r in records if r["type"] == "rollout"]
    assert len(rollouts) == 2 * 4
    for r in rollouts:
        assert r["finish"] == "no_tool_call" and r["failure"] is None, r["failure"]
        answers = [m["content"] for m in r["messages"] if m["role"] in ("tool", "user")][1:]
        assert "argument 'command' holds a NUL byte" in answers[0]
        assert answers[1] == "path '../../etc/passwd' is outside the workspace"
        assert answers[2].startswith("unknown tool 'nope'")
        assert answers[3] == "argument 'command' must be a string"
        assert answers[4] == "unknown argument 'mode'; write_file takes path, content"
        assert answers[5].startswith("ERROR: malformed tool call") and "surrogate" in answers[5]
    rewards = sorted(r["reward"] for r in rollouts)
    assert rewards[0] == 0.0 and rewards[-1] == 1.0  # the answer file passed verify
    [update] = [r for r in records if r["type"] == "update"]
    assert update["status"] == "completed"
