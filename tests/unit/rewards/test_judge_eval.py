"""`retrograd judge eval` (formats.md §3.6): the fixture reader, the rank correlations against
scipy's, the table and the exit statuses, with a real command judge (one process per group)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scipy import stats

from retrograd.cli.main import main
from retrograd.errors import DataError
from retrograd.rewards.judge_eval import read_fixtures

USER = {"role": "user", "content": "Name a fruit."}


def answer(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def fixture(sid: str, texts: list[str], labels: list[float], **extra) -> dict:
    candidates = [{"messages": answer(t), "label": x} for t, x in zip(texts, labels, strict=True)]
    return {"scenario_id": sid, "context": [USER], "candidates": candidates, **extra}


def write_lines(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_reads_fixtures(tmp_path):
    good = fixture("a", ["x", "yy"], [0, 1], rubric="Prefer long names.")
    good["candidates"][1]["env_state"] = "basket: 2 fruits"
    path = write_lines(tmp_path / "fixtures.jsonl", [good, "", fixture("b", ["x", "y"], [1, 1])])
    a, b = read_fixtures(path)
    assert (a.key, a.scenario_id, a.rubric) == ("fixtures.jsonl:1", "a", "Prefer long names.")
    assert a.context == (USER,)
    assert [c.label for c in a.candidates] == [0.0, 1.0]
    assert [c.env_state for c in a.candidates] == [None, "basket: 2 fruits"]
    assert b.key == "fixtures.jsonl:3" and b.rubric is None


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("[1, 2]", "a fixture line must be a JSON object"),
        ('{"scenario_id": "b"', "invalid JSON"),
        ({**fixture("b", ["x", "y"], [0, 1]), "notes": "hi"}, "unknown key 'notes'"),
        ({**fixture("b", ["x", "y"], [0, 1]), "scenario_id": " "}, '"scenario_id" must be'),
        (fixture("a", ["x", "y"], [0, 1]), 'scenario_id "a" was already used at fixtures.jsonl:1'),
        (fixture("b", ["x"], [0]), "at least 2"),
        (fixture("b", ["x", "y"], [0, True]), r'candidates\[1\]: "label" must be a finite number'),
        (fixture("b", ["x", "y"], [0, "high"]), '"label" must be a finite number'),
        ({**fixture("b", ["x", "y"], [0, 1]), "context": [{"role": "robot"}]}, r"context\[0\]"),
        ({**fixture("b", ["x", "y"], [0, 1]), "rubric": 3}, '"rubric" must be'),
    ],
)
def test_broken_lines_name_file_and_line(tmp_path, line, match):
    path = write_lines(tmp_path / "fixtures.jsonl", [fixture("a", ["x", "y"], [0, 1]), line])
    with pytest.raises(DataError, match=match) as caught:
        read_fixtures(path)
    assert str(caught.value).startswith("fixtures.jsonl:2")


def test_broken_candidates(tmp_path):
    bad = fixture("a", ["x", "y"], [0, 1])
    bad["candidates"][0] = {"messages": [], "label": 1}
    with pytest.raises(
        DataError, match=r"fixtures.jsonl:1: candidates\[0\]: messages must be a non-empty list"
    ):
        read_fixtures(write_lines(tmp_path / "fixtures.jsonl", [bad]))
    bad["candidates"][0] = {"messages": answer("x"), "label": 1, "score": 2}
    with pytest.raises(DataError, match="unknown key 'score'"):
        read_fixtures(write_lines(tmp_path / "fixtures.jsonl", [bad]))
    with pytest.raises(DataError, match="no fixture in the file"):
        read_fixtures(write_lines(tmp_path / "fixtures.jsonl", [""]))


def run_file(tmp_path: Path, judge_argv: list[str], algorithm: str = "grpo") -> Path:
    """A grpo run file whose [grpo.judge] is the command `judge_argv` (no model needed)."""
    (tmp_path / "p.jsonl").write_text(json.dumps({"messages": [USER]}) + "\n")
    text = f"""
[run]
algorithm = "{algorithm}"
[output]
path = "out.gguf"
[lora]
[grpo]
prompts = "p.jsonl"
reward_command = ["python3", "reward.py"]
updates = 1
prompts_per_update = 1
group_size = 2
grpo_epochs = 1
clip_range_low = 0.2
clip_range_high = 0.28
kl_coefficient = 0.0
judge_weight = 1.0
[grpo.sampling]
temperature = 1.0
top_p = 1.0
max_new_tokens = 8
seed = 1
[grpo.judge]
type = "command"
command = {json.dumps(judge_argv)}
"""
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


# The default oneshot program scores an answer by its length: the labels below order answers
# (a) as the judge does, (b) partly against it, (c) not at all (all equal: undefined).
TEXTS = {"a": ["a", "abc", "ab"], "b": ["aa", "aaaa", "a", "aaa"], "c": ["a", "ab"]}
LABELS = {"a": [0.0, 1.0, 0.5], "b": [0.0, 1.0, 2.0, 3.0], "c": [1.0, 1.0]}


def test_eval_against_scipy(tmp_path, oneshot, capsys):
    config = run_file(tmp_path, oneshot())
    fixtures = write_lines(
        tmp_path / "fixtures.jsonl", [fixture(k, TEXTS[k], LABELS[k]) for k in TEXTS]
    )
    assert main(["judge", "eval", str(config), "--fixtures", str(fixtures), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {row["scenario_id"]: row for row in report["fixtures"]}
    for k in ("a", "b"):
        lengths = [float(len(t)) for t in TEXTS[k]]
        assert rows[k]["scores"] == lengths == rows[k]["repeat"]
        tau = stats.kendalltau(lengths, LABELS[k]).statistic
        rho = stats.spearmanr(lengths, LABELS[k]).statistic
        assert rows[k]["tau_labels"] == pytest.approx(tau)
        assert rows[k]["rho_labels"] == pytest.approx(rho)
        assert rows[k]["tau_repeat"] == pytest.approx(1.0)
    assert rows["a"]["tau_labels"] == pytest.approx(1.0)
    assert rows["b"]["tau_labels"] == pytest.approx(0.0)  # 3 of 6 pairs agree
    assert rows["c"]["tau_labels"] is None and rows["c"]["tau_repeat"] == pytest.approx(1.0)
    s = report["summary"]
    assert s["tau_labels"] == pytest.approx((1.0 + 0.0) / 2) and s["tau_labels_count"] == 2
    assert s["tau_repeat_count"] == 3 and s["failed"] == 0

    assert main(["judge", "eval", str(config), "--fixtures", str(fixtures)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == [
        "scenario",
        "n",
        "tau/labels",
        "rho/labels",
        "tau/repeat",
        "rho/repeat",
    ]
    assert table[2].split()[:3] == ["a", "3", "+1.000"]
    assert table[4].split()[:4] == ["c", "2", "-", "-"]
    assert table[6].split()[:3] == ["mean", "9", "+0.500"]
    # a gate for scripts: the mean tau against the labels (0.5) is below 0.9
    argv = ["judge", "eval", str(config), "--fixtures", str(fixtures), "--min-tau", "0.9"]
    assert main(argv) == 3
    assert main([*argv[:-1], "0.4"]) == 0


def test_a_failing_judge_is_reported_and_exits_2(tmp_path, oneshot, capsys):
    argv = oneshot("def reply(req):\n    return {'verdict': 1}\n")
    config = run_file(tmp_path, argv)
    fixtures = write_lines(tmp_path / "fixtures.jsonl", [fixture("a", TEXTS["a"], LABELS["a"])])
    assert main(["judge", "eval", str(config), "--fixtures", str(fixtures)]) == 2
    out = capsys.readouterr().out
    assert "fixtures.jsonl:1 (a): judge failed: [grpo.judge].command" in out
    assert 'unknown key "verdict"' in out


def test_refusals(tmp_path, oneshot, capsys):
    fixtures = write_lines(tmp_path / "fixtures.jsonl", [fixture("a", TEXTS["a"], LABELS["a"])])
    config = run_file(tmp_path, oneshot())
    text = config.read_text()
    config.write_text(text[: text.index("[grpo.judge]")].replace("judge_weight = 1.0\n", ""))
    assert main(["judge", "eval", str(config), "--fixtures", str(fixtures)]) == 1
    assert "no [grpo.judge] to evaluate" in capsys.readouterr().err
    config.write_text(text)
    missing = str(tmp_path / "nothing.jsonl")
    assert main(["judge", "eval", str(config), "--fixtures", missing]) == 1
    assert "no such file" in capsys.readouterr().err


def test_an_agent_run_file_gives_its_agent_judge(tmp_path, oneshot, capsys):
    config = tmp_path / "agent.toml"
    config.write_text(
        '[run]\nalgorithm = "agent_grpo"\n[output]\npath = "out.gguf"\n[lora]\n'
        f'[agent]\nscenarios = "s.jsonl"\n[agent.judge]\ntype = "command"\n'
        f"command = {json.dumps(oneshot())}\n"
    )
    fixtures = write_lines(tmp_path / "fixtures.jsonl", [fixture("a", TEXTS["a"], LABELS["a"])])
    assert main(["judge", "eval", str(config), "--fixtures", str(fixtures)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].split()[:3] == ["a", "3", "+1.000"]
    assert "1 fixture, 0 failed" in out
    sft = config.read_text().replace("agent_grpo", "sft").split("[agent]")[0]
    config.write_text(sft + '[sft]\ndata = "d.jsonl"\n')
    assert main(["judge", "eval", str(config), "--fixtures", str(fixtures)]) == 1
    assert "judge eval reads the judge of a grpo or agent_grpo run file" in capsys.readouterr().err


def test_help_explains_the_fixtures_and_exit_statuses(capsys):
    with pytest.raises(SystemExit) as done:
        main(["judge", "eval", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "Kendall's tau" in out and '"candidates"' in out and "Exit status" in out


def test_eval_of_a_ruler_judge_against_the_scripted_endpoint(tmp_path, monkeypatch, capsys):
    """The whole command against a real HTTP endpoint: the scripted judge reads each
    trajectory's "q=<quality>" (from its final state when it has one) and scores it so, except
    under the rubric "Biased", where it gives 1 to whichever trajectory is shown first. The
    second pass shows the candidates in another order, which only the biased judge notices."""
    from retrograd.rewards.ruler.prompt import permutation
    from tests.factories.scripted_openai import reply, scripted_openai

    def verdict(body: dict):
        prompt = body["messages"][0]["content"]
        shown = json.loads(prompt.split("<trajectories>\n")[1].split("\n</trajectories>")[0])
        biased = prompt.startswith("Biased")
        scores = [
            {
                "trajectory_id": t["trajectory_id"],
                "explanation": "",
                "score": float(k == 0) if biased else quality(t),
            }
            for k, t in enumerate(shown)
        ]
        return reply("Here you go:\n```json\n" + json.dumps({"scores": scores}) + "\n```")

    def quality(t: dict) -> float:
        return float(t.get("final_state", t["messages"][-1]["content"]).split("q=")[1])

    good = fixture("good", ["q=0.9", "q=0.2", "q=0.5"], [3, 1, 2])
    flipped = fixture("flipped", ["q=0.1", "q=0.8"], [1, 0])
    stateful = fixture("stateful", ["done", "done", "done"], [0, 1, 2])
    for c, state in zip(stateful["candidates"], ["q=0.3", "q=0.2", "q=0.9"], strict=True):
        c["env_state"] = state
    biased = fixture("biased", ["a", "b", "c", "d", "e"], [4, 3, 2, 1, 0], rubric="Biased.")
    lines = [good, flipped, stateful, biased]
    fixtures = write_lines(tmp_path / "fixtures.jsonl", lines)
    config = run_file(tmp_path, ["unused"])
    text = config.read_text()
    config.write_text(
        text[: text.index("[grpo.judge]")]
        + '[grpo.judge]\ntype = "ruler"\nmodel = "judge"\napi_key_env = "EVAL_TEST_KEY"\n'
        + 'cache_path = "verdicts.jsonl"\n'
    )
    monkeypatch.setenv("EVAL_TEST_KEY", "test-key")
    with scripted_openai([verdict] * (2 * len(lines))) as api:
        with config.open("a") as f:
            f.write(f'base_url = "{api.base_url}"\n')
        argv = ["judge", "eval", str(config), "--fixtures", str(fixtures), "--json"]
        assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(api.requests) == 2 * len(lines)  # one listwise request a pass, nothing cached
    assert not (tmp_path / "verdicts.jsonl").exists()
    rows = {row["scenario_id"]: row for row in report["fixtures"]}
    assert rows["good"]["scores"] == [0.9, 0.2, 0.5] == rows["good"]["repeat"]
    assert rows["good"]["tau_labels"] == pytest.approx(1.0)
    assert rows["flipped"]["tau_labels"] == pytest.approx(-1.0)
    assert rows["stateful"]["scores"] == [0.3, 0.2, 0.9]
    # the biased judge: the first candidate shown gets 1, in each pass its own order
    n = len(lines)
    first, second = permutation(3, 0, 5)[0], permutation(n + 3, 0, 5)[0]
    assert first != second  # the passes disagree, as a position-biased judge should
    expected = [[float(k == first) for k in range(5)], [float(k == second) for k in range(5)]]
    assert [rows["biased"]["scores"], rows["biased"]["repeat"]] == expected
    tau = stats.kendalltau(*expected).statistic
    assert rows["biased"]["tau_repeat"] == pytest.approx(tau) and tau < 0
    assert rows["biased"]["tau_labels"] == pytest.approx(
        stats.kendalltau(expected[0], [4, 3, 2, 1, 0]).statistic
    )


EXAMPLE = Path(__file__).parents[3] / "examples" / "grpo-judge"


def test_the_example_fixtures_through_the_example_judge(tmp_path, monkeypatch, capsys):
    """examples/grpo-judge: its fixtures read, and its pairwise judge (all pairs, both orders,
    win rates) evaluates them against a scripted endpoint that prefers the answer of fewer
    words. Each candidate's expected score is its win rate over the others, by hand."""
    from tests.factories.scripted_openai import reply, scripted_openai

    fixtures = read_fixtures(EXAMPLE / "fixtures.jsonl")
    assert len(fixtures) >= 5 and all(len({c.label for c in f.candidates}) > 1 for f in fixtures)

    def words(side: dict) -> int:
        return len(side["messages"][-1]["content"].split())

    def verdict(body: dict):
        prompt = body["messages"][0]["content"]
        pair = json.loads(prompt.split("<trajectories>\n")[1].split("\n</trajectories>")[0])
        a, b = words(pair["a"]), words(pair["b"])
        winner = "a" if a < b else "b" if b < a else "tie"
        return reply(json.dumps({"winner": winner, "explanation": "fewer words"}))

    def win_rate(counts: list[int], i: int) -> float:
        others = [c for j, c in enumerate(counts) if j != i]
        won = sum(1.0 if counts[i] < c else 0.5 if counts[i] == c else 0.0 for c in others)
        return won / len(others)

    requests = sum(2 * 2 * len(f.candidates) * (len(f.candidates) - 1) // 2 for f in fixtures)
    monkeypatch.setenv("JUDGE_API_KEY", "test-key")
    with scripted_openai([verdict] * requests) as api:
        text = (EXAMPLE / "plurals-judged.toml").read_text()
        text = text.replace('"http://127.0.0.1:8081/v1"', f'"{api.base_url}"')
        text = text.replace('"../', f'"{EXAMPLE.parent}/')  # the example's own relative paths
        config = tmp_path / "plurals-judged.toml"
        config.write_text(text)
        argv = ["judge", "eval", str(config), "--fixtures", str(EXAMPLE / "fixtures.jsonl")]
        assert main([*argv, "--json"]) == 0
    assert len(api.requests) == requests  # both orders of every pair, twice, nothing cached
    report = json.loads(capsys.readouterr().out)
    for f, row in zip(fixtures, report["fixtures"], strict=True):
        counts = [len(c.messages[-1]["content"].split()) for c in f.candidates]
        expected = [win_rate(counts, i) for i in range(len(counts))]
        assert row["scores"] == pytest.approx(expected) and row["repeat"] == pytest.approx(expected)
        labels = [c.label for c in f.candidates]
        if len(set(expected)) > 1:
            tau = stats.kendalltau(expected, labels).statistic
            assert row["tau_labels"] == pytest.approx(tau)
