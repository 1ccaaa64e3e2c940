"""`retrograd collect` end to end with --api: a scripted OpenAI-compatible endpoint writes the
turns, a real HTTP environment server grades them; flags and outputs refused before anything
is asked of either."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from retrograd.cli.main import main
from retrograd.data.pairs import read_pairs
from retrograd.tokenizer import validate_record
from tests.factories.env_server import env_server
from tests.factories.scripted_openai import reply, scripted_openai

KEY_ENV = "RETRO_TEST_COLLECT_KEY"
SCENARIOS = [
    {"id": "a", "user": "Bring the counter to 2.", "metadata": {"target": 2}},
    {"id": "b", "user": "Bring the counter to 1.", "metadata": {"target": 1}},
]


def run_file(tmp: Path, env_url: str, api_url: str, extra: str = "") -> Path:
    (tmp / "s.jsonl").write_text("".join(json.dumps(s) + "\n" for s in SCENARIOS))
    path = tmp / "run.toml"
    path.write_text(
        f"""
[run]
algorithm = "agent_grpo"
[output]
path = "out.gguf"
[lora]
[agent]
scenarios = "s.jsonl"
group_size = 2
seed = 7
[agent.environment]
type = "http"
base_url = "{env_url}"
[agent.collect_api]
base_url = "{api_url}"
model = "gpt-test"
api_key_env = "{KEY_ENV}"
temperature = 0.5
{extra}"""
    )
    return path


SCRIPT = [
    reply("", calls=[("add", {"by": 2})]),  # a, member 0: reaches 2, reward 1.0
    reply("I would rather not."),  # a, member 1: nothing graded it
    reply("", calls=[("add", {"by": 1})]),  # b, member 0
    reply("", calls=[("add", {"by": 1})]),  # b, member 1: the same turns
]


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "test-key")


def test_collect_api_writes_records_and_a_report(tmp_path, key, capsys):
    with env_server() as env, scripted_openai(SCRIPT) as api:
        cfg = run_file(tmp_path, env.url, api.base_url)
        out, report = tmp_path / "traces.jsonl", tmp_path / "report.json"
        assert main(["collect", str(cfg), "--api", "--out", str(out), "--report", str(report)]) == 0
        requests = api.requests
        resets = [json.loads(c["body"]) for c in env.calls if c["path"] == "/reset"]
    assert [r["seed"] for r in resets] == [7, 8, 9, 10]  # seed + i * k + member
    assert all(r["temperature"] == 0.5 and r["model"] == "gpt-test" for r in requests)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["metadata"]["scenario_id"] for r in records] == ["a", "b"]
    for i, r in enumerate(records):
        validate_record(r, f"traces.jsonl:{i + 1}", require_assistant=True)
        assert r["metadata"]["generator"] == "gpt-test" and r["metadata"]["form"] == "structured"
    assert records[0]["metadata"]["reward"] == 1.0 and records[0]["metadata"]["pass_rate"] == 0.5
    assert [t["function"]["name"] for t in records[0]["tools"]] == ["add", "echo"]
    data = json.loads(report.read_text())
    assert data["attempted"] == 4 and data["kept"] == 2 and data["interrupted"] is False
    assert data["rejected"]["unscored"] == 1 and data["rejected"]["duplicate"] == 1
    assert data["scenarios"][1] == {
        "id": "b",
        "attempted": 2,
        "passed": 2,
        "kept": 1,
        "pass_rate": 1.0,
    }
    printed = capsys.readouterr().out
    assert "unscored 1, duplicate 1" in printed and f"wrote {out}" in printed
    assert not (tmp_path / "traces.jsonl.tmp").exists()


def test_collect_api_pairs(tmp_path, key):
    script = [
        reply("", calls=[("add", {"by": 2})]),  # a: reward 1.0
        reply("", calls=[("add", {"by": 1})]),  # a: 0.1, then stops
        reply("Stopping here."),
        reply("", calls=[("add", {"by": 1})]),  # b: both reach it: no pair
        reply("", calls=[("add", {"by": 5})]),
    ]
    with env_server() as env, scripted_openai(script) as api:
        cfg = run_file(tmp_path, env.url, api.base_url)
        out, report = tmp_path / "pairs.jsonl", tmp_path / "report.json"
        args = ["collect", str(cfg), "--api", "--pairs", "--out", str(out), "--report", str(report)]
        assert main(args) == 0
    pairs = read_pairs(out)
    assert len(pairs) == 1 and pairs.pairs[0].metadata["gap"] == pytest.approx(0.9)
    assert json.loads(report.read_text())["no_pair"] == {
        "no_passing": 0,
        "no_rejected": 0,
        "below_min_gap": 1,
    }


def test_out_is_refused_without_force_and_replaced_with_it(tmp_path, key, capsys):
    out = tmp_path / "traces.jsonl"
    out.write_text("old\n")
    with env_server() as env, scripted_openai(list(SCRIPT)) as api:
        cfg = run_file(tmp_path, env.url, api.base_url)
        assert main(["collect", str(cfg), "--api", "--out", str(out)]) == 1
        assert "exists; pass --force" in capsys.readouterr().err
        assert api.requests == [] and env.calls == []
        assert (
            main(["collect", str(cfg), "--api", "--out", str(out), "--force", "--limit", "1"]) == 0
        )
        assert len(api.requests) == 2
    assert [json.loads(x)["metadata"]["scenario_id"] for x in out.read_text().splitlines()] == ["a"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--pairs", "--keep", "2"], "takes no --keep"),
        (["--min-gap", "0.2"], "--min-gap is read only with --pairs"),
        (["--raw"], "--api writes structured turns"),
        (["--k", "0"], "--k 0: must be at least 1"),
        (["--pairs", "--k", "1"], "a pair needs at least two attempts"),
        (["--device", "cpu"], "--api loads no model"),
        (["--out", "s.jsonl", "--force"], "is the scenario file"),
        (["--out", "run.toml"], "is the run file"),
        (["--report", "traces.jsonl"], "is the --out file"),
    ],
)
def test_flags_are_refused_before_anything_is_asked(tmp_path, key, capsys, flags, message):
    with env_server() as env, scripted_openai([]) as api:
        cfg = run_file(tmp_path, env.url, api.base_url)
        args = ["collect", str(cfg), "--api", "--out", str(tmp_path / "traces.jsonl")]
        flags = [str(tmp_path / f) if f.endswith((".jsonl", ".toml")) else f for f in flags]
        assert main(args + flags) == 1
        assert message in capsys.readouterr().err
        assert api.requests == [] and env.calls == []
    assert (tmp_path / "s.jsonl").read_text().count("\n") == 2 and "[run]" in (
        tmp_path / "run.toml"
    ).read_text()


def test_a_missing_key_is_named_before_any_request(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with env_server() as env, scripted_openai(list(SCRIPT)) as api:
        cfg = run_file(tmp_path, env.url, api.base_url)
        assert main(["collect", str(cfg), "--api", "--out", str(tmp_path / "t.jsonl")]) == 1
        assert api.requests == [] and env.calls == []
    err = capsys.readouterr().err
    assert (
        f"[agent.collect_api].api_key_env = {KEY_ENV}: the environment variable is not set" in err
    )


def test_grading_is_required_for_k_1_and_api(tmp_path, key, capsys):
    judge_only = tmp_path / "judge.toml"
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(s) + "\n" for s in SCENARIOS))
    judge_only.write_text(
        """
[run]
algorithm = "agent_grpo"
[model]
path = "m.gguf"
[output]
path = "out.gguf"
[lora]
[agent]
scenarios = "s.jsonl"
[agent.judge]
type = "command"
command = ["python3", "judge.py"]
"""
    )
    assert main(["collect", str(judge_only), "--k", "1", "--out", str(tmp_path / "t.jsonl")]) == 1
    assert "--k 1: only the environment can grade here" in capsys.readouterr().err
    local = judge_only.read_text().replace(
        "[agent.judge]",
        '[agent.environment]\ntype = "local"\nallow_unsandboxed = true\n'
        '[agent.environment.tools]\ndefault = "base"\n[agent.judge]',
    )
    judge_only.write_text(local)
    assert main(["collect", str(judge_only), "--api", "--out", str(tmp_path / "t.jsonl")]) == 1
    err = capsys.readouterr().err
    assert "--api: s.jsonl:1 (a) has no metadata.env.verify" in err
    assert not (tmp_path / "t.jsonl.tmp").exists()


def test_a_run_file_of_another_algorithm_is_refused(tmp_path, capsys):
    cfg = tmp_path / "sft.toml"
    cfg.write_text(
        '[run]\nalgorithm = "sft"\n[model]\npath = "m.gguf"\n[output]\npath = "o.gguf"\n[lora]\n[sft]\ndata = "d.jsonl"\n'
    )
    assert main(["collect", str(cfg), "--api", "--out", str(tmp_path / "t.jsonl")]) == 1
    assert "this command reads an agent_grpo run file" in capsys.readouterr().err


def test_collect_api_in_a_local_sandbox_with_verify(tmp_path, key, capsys):
    """The local environment (real sandboxes on this host) runs the calls and verifies; with
    every scenario verifiable, --require-verified is the default."""
    verify = {"command": ["sh", "-c", 'test "$(cat answer.txt)" = 42']}
    scenarios = [
        {"id": "answer", "user": "Write 42 to answer.txt.", "metadata": {"env": {"verify": verify}}}
    ]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(s) + "\n" for s in scenarios))
    script = [
        reply("", calls=[("write_file", {"path": "answer.txt", "content": "42"})]),
        reply("Done.", calls=[("submit", {})]),
        reply("", calls=[("write_file", {"path": "answer.txt", "content": "41"})]),
        reply("That should do."),
    ]
    with scripted_openai(script) as api:
        cfg = tmp_path / "run.toml"
        cfg.write_text(
            f"""[run]
algorithm = "agent_grpo"
[output]
path = "out.gguf"
[lora]
[agent]
scenarios = "s.jsonl"
group_size = 2
[agent.environment]
type = "local"
allow_unsandboxed = true
[agent.environment.tools]
default = "base"
[agent.collect_api]
base_url = "{api.base_url}"
model = "gpt-test"
api_key_env = "{KEY_ENV}"
"""
        )
        out, report = tmp_path / "traces.jsonl", tmp_path / "report.json"
        assert main(["collect", str(cfg), "--api", "--out", str(out), "--report", str(report)]) == 0
        tools = {t["function"]["name"] for t in api.requests[0]["tools"]}
    assert {"bash", "write_file", "submit"} <= tools
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["metadata"]["verification"] == {"reward": 1.0, "passed": True}
    assert record["metadata"]["reward"] == 1.0 and record["metadata"]["member"] == 0
    assert record["messages"][-1]["role"] == "tool" and record["messages"][-1]["name"] == "submit"
    data = json.loads(report.read_text())
    assert data["rejected"]["unverified"] == 1 and data["scenarios"][0]["passed"] == 1


def test_an_interrupted_collection_keeps_the_tmp_and_reports_it(tmp_path, capsys):
    from retrograd.agent.collect import CollectOptions
    from retrograd.cli import collect as cli
    from tests.unit.agent.test_collect import trace

    def groups():
        yield [trace(0)]
        raise KeyboardInterrupt

    out, report = tmp_path / "t.jsonl", tmp_path / "r.json"
    assert cli._write(groups(), CollectOptions(), None, out, report) == 130
    assert not out.exists() and len((tmp_path / "t.jsonl.tmp").read_text().splitlines()) == 1
    assert json.loads(report.read_text())["interrupted"] is True
    err = capsys.readouterr().err
    assert "t.jsonl.tmp holds the 1 records kept" in err
