"""collect (formats.md §4.5): filters and their counters, order, dedupe, keep, pairs, the
report, the .tmp writer, and records read back by the SFT and preference readers."""

from __future__ import annotations

import json

import pytest

import retrograd
from retrograd.agent.collect import (
    REJECTIONS,
    CollectOptions,
    CollectStats,
    RecordWriter,
    chat_check,
    check_outputs,
    collect,
    select_pair,
    select_traces,
)
from retrograd.agent.trajectory import Trajectory, Turn
from retrograd.agent.types import Verification
from retrograd.data.pairs import read_pairs, tokenize_pairs
from retrograd.data.sft import load_sft_data
from retrograd.errors import ConfigError
from retrograd.gguf import GGUFFile
from retrograd.tokenizer import ChatFormat, chat_template
from tests.unit.agent.counter_env import TOOLS, scenario

CATALOG = [spec.openai() for spec in TOOLS]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def trace(
    member: int,
    reward: float | None = 1.0,
    adds: tuple[int, ...] = (3,),
    tokens: int = 10,
    finish: str = "done",
    valid: bool = True,
    passed: bool | None = True,
    sc=None,
    error: bool = False,
) -> Trajectory:
    """A counter trace: one turn per add, then a turn calling done."""
    sc = sc or scenario()
    t = Trajectory(sc, member, 100 + member, CATALOG, sc.opening(), generator="gpt-test")
    n = 0
    for a in (*adds, None):
        name, args = ("add", {"n": a}) if a is not None else ("done", {})
        cid = f"call_{n}"
        n += 1
        call = {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
        t.messages.append({"role": "assistant", "content": f"step {n}", "tool_calls": [call]})
        obs = {"role": "tool", "tool_call_id": cid, "name": name, "content": "ok"}
        if error and a is not None:
            obs.update(content="argument 'n' must be an integer", is_error=True)
        t.messages.append(obs)
        text = f'step {n}\n<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'
        t.turns.append(
            Turn(
                text,
                f"step {n}",
                [{"id": cid, "name": name, "arguments": args}],
                valid,
                tokens // (len(adds) + 1),
                [obs],
            )
        )
    t.finish = finish
    t.final_reward = reward
    if passed is not None:
        t.verification = Verification(reward or 0.0, passed)
    return t


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    from tests.factories.tiny_gguf import write_tiny

    path = write_tiny(
        tmp_path_factory.mktemp("collect") / "tiny.gguf",
        "gemma3",
        seed=0,
        chat_template=CHAT_TEMPLATE,
    )
    tok = retrograd.load_tokenizer(path)
    return ChatFormat(tok, chat_template(tok, GGUFFile(path).metadata))


def test_filters_count_the_first_failing_cause():
    group = [
        trace(0, finish="max_turns", valid=False),  # truncated before invalid
        trace(1, finish="failed", reward=None, passed=None),
        trace(2, reward=None, passed=None),  # nothing graded it
        trace(3, valid=False, reward=0.1),  # invalid before below_min_reward
        trace(4, reward=0.2, passed=False),  # below_min_reward before unverified
        trace(5, reward=0.9, passed=False),
        trace(6, reward=0.8, passed=None),  # no verification at all
        trace(7, reward=1.0),
    ]
    stats = CollectStats()
    opts = CollectOptions(min_reward=0.5, require_verified=True)
    records = select_traces(group, opts, stats)
    assert stats.rejected == {
        "truncated": 1,
        "unscored": 2,
        "invalid_turns": 1,
        "below_min_reward": 1,
        "unverified": 2,
        "duplicate": 0,
        "over_keep": 0,
        "unexportable": 0,
    }
    assert [r["metadata"]["member"] for r in records] == [7]
    [sc] = stats.scenarios
    assert (sc.attempted, sc.passed, sc.kept, sc.pass_rate) == (8, 1, 1, 1 / 8)
    # without the two optional filters, unverified and low rewards pass
    stats = CollectStats()
    select_traces(group, CollectOptions(keep=8), stats)
    assert stats.scenarios[0].passed == 4 and stats.rejected["unverified"] == 0


def test_sort_dedupe_and_keep():
    group = [
        trace(0, reward=1.0, adds=(1, 2), tokens=30),
        trace(1, reward=1.0, adds=(3,), tokens=12),  # same reward, fewer tokens: first
        trace(2, reward=1.0, adds=(3,), tokens=12),  # the same turns as member 1
        trace(3, reward=0.5, adds=(2, 1), tokens=5),
        trace(4, reward=1.5, adds=(1, 1, 1), tokens=40),  # highest reward wins over length
    ]
    stats = CollectStats()
    records = select_traces(group, CollectOptions(keep=3), stats)
    assert [r["metadata"]["member"] for r in records] == [4, 1, 0]
    assert stats.rejected["duplicate"] == 1 and stats.rejected["over_keep"] == 1
    assert stats.kept == 3
    # equal reward and tokens: the lower member first
    tie = [trace(5, adds=(2, 1), tokens=8), trace(2, adds=(1, 2), tokens=8)]
    assert [
        r["metadata"]["member"] for r in select_traces(tie, CollectOptions(), CollectStats())
    ] == [2]


def test_record_shape_and_metadata():
    t = trace(3, reward=1.0, error=True)
    t.step_rewards = [0.25]
    [record] = select_traces(
        [t, trace(4, reward=0.0, passed=False)], CollectOptions(), CollectStats()
    )
    assert set(record) == {"tools", "messages", "metadata"}
    assert record["tools"] == CATALOG
    assert record["metadata"] == {
        "scenario_id": "count-3",
        "seed": 103,
        "member": 3,
        "reward": 1.25,
        "verification": {"reward": 1.0, "passed": True},
        "turns": 2,
        "generator": "gpt-test",
        "form": "structured",
        "pass_rate": 1.0,
    }
    tool = record["messages"][2]
    assert tool["is_error"] is True and tool["content"] == "argument 'n' must be an integer"
    # a prefix already in the content is not written twice
    t.messages[2]["content"] = "ERROR: argument 'n' must be an integer"
    [again] = select_traces([t], CollectOptions(), CollectStats())
    assert again["messages"][2]["content"] == "argument 'n' must be an integer"
    raw = select_traces([t], CollectOptions(raw=True), CollectStats())[0]
    assert raw["metadata"]["form"] == "raw"
    assert raw["messages"][1]["raw"] is True and "<tool_call>" in raw["messages"][1]["content"]


def test_unexportable_records_leave_their_place_to_the_next(chat):
    broken = trace(0, reward=2.0)
    broken.tools = []  # its calls name no declared tool: the record rules refuse it
    good = trace(1, reward=1.0, adds=(1, 2))
    stats = CollectStats()
    [record] = select_traces([broken, good], CollectOptions(), stats)
    assert record["metadata"]["member"] == 1 and stats.rejected["unexportable"] == 1
    assert (
        "first unexportable: scenario count-3 member 0: message 1: tool_calls[0]: the record calls 'add' but declares no"
        in stats.summary()
    )
    # raw turns whose text the student's parser cannot read the calls back from
    garbled = trace(2, reward=2.0)
    for turn in garbled.turns:
        turn.text = turn.content  # the markup is missing
    stats = CollectStats()
    opts = CollectOptions(raw=True)
    [record] = select_traces([garbled, trace(3, adds=(2, 1))], opts, stats, chat_check(chat))
    assert record["metadata"]["member"] == 3 and stats.rejected["unexportable"] == 1
    assert "raw turn" in stats.first_unexportable and "member 2" in stats.first_unexportable


def test_records_are_read_back_by_the_sft_reader(tmp_path, chat):
    groups = [
        [
            trace(0, sc=scenario("a", index=0)),
            trace(1, reward=0.0, passed=False, sc=scenario("a", index=0)),
        ],
        [trace(0, adds=(1, 1, 1), sc=scenario("b", index=1), error=True)],
    ]
    for raw in (False, True):
        out = tmp_path / f"traces-{raw}.jsonl"
        writer = RecordWriter(out)
        stats = collect(groups, CollectOptions(raw=raw), writer, chat_check(chat))
        writer.commit()
        assert stats.kept == 2 and not writer.tmp.exists()
        data = load_sft_data(out, chat.tokenizer, 4096, chat=chat)
        assert len(data.examples) == 2 and data.truncated == 0
        # every assistant turn is trained: its prose and the call markup
        first = data.examples[0]
        ids = [i for i, m in zip(first.ids, first.mask, strict=True) if m]
        trained = chat.tokenizer.detokenize(ids).replace("\u2581", " ")  # the tiny vocab's spaces
        assert "step 1" in trained and '"name": "done"' in trained


def test_pairs_best_passing_against_worst_complete(tmp_path, chat):
    sc = scenario()
    group = [
        trace(0, reward=0.0, passed=False, adds=(1,), sc=sc),
        trace(1, reward=1.0, adds=(3,), tokens=20, sc=sc),
        trace(2, reward=1.0, adds=(1, 2), tokens=8, sc=sc),  # the best: shorter
        trace(3, reward=-1.0, passed=False, adds=(5,), finish="max_turns", sc=sc),  # not complete
        trace(4, reward=0.5, passed=False, adds=(2,), sc=sc),
    ]
    stats = CollectStats(pairs=True)
    pair = select_pair(group, CollectOptions(pairs=True), stats)
    assert pair["metadata"]["chosen"]["member"] == 2
    assert pair["metadata"]["rejected"]["member"] == 0  # worst complete, not the truncated one
    assert pair["metadata"]["gap"] == 1.0
    assert pair["prompt"] == [{"role": "user", "content": "Bring the counter to 3."}]
    assert pair["chosen"][0]["role"] == "assistant" and pair["tools"] == CATALOG
    assert stats.kept == 1 and stats.scenarios[0].kept == 1
    out = tmp_path / "pairs.jsonl"
    writer = RecordWriter(out)
    collect([group], CollectOptions(pairs=True), writer, chat_check(chat))
    writer.commit()
    pairs = read_pairs(out)
    assert len(pairs) == 1 and pairs.pairs[0].tools == tuple(CATALOG)
    [tp] = tokenize_pairs(pairs, chat, 4096)
    assert sum(tp.chosen_mask) > 0 and sum(tp.rejected_mask) > 0


def test_scenarios_without_a_pair_are_counted():
    opts = CollectOptions(pairs=True, min_gap=0.5)
    stats = CollectStats(pairs=True)
    nothing_passes = [trace(0, finish="max_turns"), trace(1, reward=None, passed=None)]
    assert select_pair(nothing_passes, opts, stats) is None
    assert select_pair([trace(0, reward=1.0)], opts, stats) is None  # nothing to reject
    assert (
        select_pair([trace(0, reward=1.0, adds=(3,)), trace(1, reward=1.0, adds=(3,))], opts, stats)
        is None
    )  # same turns
    assert (
        select_pair([trace(0, reward=1.0), trace(1, reward=0.75, adds=(2, 1))], opts, stats) is None
    )
    assert stats.no_pair == {"no_passing": 1, "no_rejected": 2, "below_min_gap": 1}
    smaller = CollectOptions(pairs=True, min_gap=0.25)
    assert (
        select_pair([trace(0, reward=1.0), trace(1, reward=0.75, adds=(2, 1))], smaller, stats)
        is not None
    )
    report = stats.as_json()
    assert report["no_pair"] == stats.no_pair and report["kept"] == 1


def test_report_shape():
    stats = CollectStats()
    select_traces([trace(0), trace(1, finish="deadline")], CollectOptions(), stats)
    report = json.loads(json.dumps(stats.as_json()))
    assert report == {
        "attempted": 2,
        "kept": 1,
        "rejected": {**dict.fromkeys(REJECTIONS, 0), "truncated": 1},
        "scenarios": [{"id": "count-3", "attempted": 2, "passed": 1, "kept": 1, "pass_rate": 0.5}],
        "interrupted": False,
    }
    assert "truncated 1" in stats.summary() and "1 traces written" in stats.summary()


def test_writer_renames_at_completion_and_an_interruption_keeps_the_tmp(tmp_path):
    out = tmp_path / "traces.jsonl"

    def groups():
        yield [trace(0, sc=scenario("a"))]
        assert (tmp_path / "traces.jsonl.tmp").read_text().count("\n") == 1  # written as it goes
        assert not out.exists()
        yield [trace(0, sc=scenario("b"))]
        raise KeyboardInterrupt

    writer = RecordWriter(out)
    stats = CollectStats()
    with pytest.raises(KeyboardInterrupt):
        collect(groups(), CollectOptions(), writer, stats=stats)
    writer.close()
    assert stats.interrupted and stats.as_json()["interrupted"] is True
    assert not out.exists()
    kept = [json.loads(line) for line in writer.tmp.read_text().splitlines()]
    assert [r["metadata"]["scenario_id"] for r in kept] == ["a", "b"]


def test_outputs_are_checked(tmp_path):
    scenarios = tmp_path / "s.jsonl"
    scenarios.write_text("{}\n")
    out = tmp_path / "out.jsonl"
    check_outputs(out, False, None, {"scenario file": scenarios})
    with pytest.raises(ConfigError, match="is the scenario file"):
        check_outputs(scenarios, True, None, {"scenario file": scenarios})
    with pytest.raises(ConfigError, match="--report .*is the scenario file"):
        check_outputs(out, False, scenarios, {"scenario file": scenarios})
    with pytest.raises(ConfigError, match="is the --out file"):
        check_outputs(out, False, tmp_path / "out.jsonl", {})
    out.write_text("old\n")
    with pytest.raises(ConfigError, match="exists; pass --force"):
        check_outputs(out, False, None, {})
    check_outputs(out, True, None, {})


def test_structured_turns_must_parse_back_to_their_calls(chat):
    """Prose that holds call markup would be read back as one more call by the student's
    parser: such a record is unexportable with the chat check, writable without it."""
    t = trace(0, reward=2.0)
    t.messages[1]["content"] = 'Like <tool_call>{"name": "done", "arguments": {}}</tool_call>.'
    stats = CollectStats()
    [record] = select_traces([t, trace(1, adds=(2, 1))], CollectOptions(), stats, chat_check(chat))
    assert record["metadata"]["member"] == 1
    assert "the hermes parser reads ['done', 'add'] back" in stats.first_unexportable
    [record] = select_traces([t], CollectOptions(), CollectStats())
    assert record["metadata"]["member"] == 0


def test_a_record_with_a_lone_surrogate_is_written_and_reads_back(tmp_path):
    out = tmp_path / "traces.jsonl"
    writer = RecordWriter(out)
    record = {"messages": [{"role": "user", "content": "é \ud800"}]}
    writer.write(record)
    writer.write({"messages": [{"role": "user", "content": "plain é"}]})
    writer.commit()
    lines = out.read_bytes().decode("utf-8").splitlines()
    assert [json.loads(line) for line in lines][0] == record
    assert lines[1] == '{"messages": [{"role": "user", "content": "plain é"}]}'  # as it was
