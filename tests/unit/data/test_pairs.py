"""Preference pair files (formats.md §1.5): what a valid line becomes, and each refusal naming
the file and line, before any tokenizer or model is loaded."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from retrograd.data.pairs import read_pairs
from retrograd.errors import DataError

EXAMPLE = Path(__file__).parents[3] / "examples" / "data" / "pairs.jsonl"

TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "description": "a + b", "parameters": {"type": "object"}},
    }
]


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str, **extra) -> dict:
    return {"role": "assistant", "content": text, **extra}


def call(name: str = "add", **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def pair(prompt=None, chosen=None, rejected=None, **extra) -> dict:
    return {
        "prompt": prompt if prompt is not None else [user("Shout: hi")],
        "chosen": chosen if chosen is not None else [assistant("HI")],
        "rejected": rejected if rejected is not None else [assistant("hi")],
        **extra,
    }


def write(tmp_path: Path, *lines) -> Path:
    p = tmp_path / "pairs.jsonl"
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return p


def test_the_shipped_example_reads():
    f = read_pairs(EXAMPLE)
    assert len(f) == 1
    (p,) = f.pairs
    assert p.key == "pairs.jsonl:1" and p.index == 0
    assert p.prompt == ({"role": "user", "content": "Shout: hello there"},)
    assert p.chosen == ({"role": "assistant", "content": "HELLO THERE"},)
    assert p.rejected == ({"role": "assistant", "content": "hello there"},)
    assert p.tools == () and p.metadata is None
    assert f.fingerprint == hashlib.sha256(EXAMPLE.read_bytes()).hexdigest()


def test_the_plurals_example_pairs_the_plural_with_a_wrong_one():
    """examples/preference/plurals*.jsonl: the prompts of the GRPO example (few-shot turns
    included), chosen the plural by the reward program's rule, rejected another spelling."""
    import sys

    rewards = EXAMPLE.parents[1] / "rewards"
    sys.path.insert(0, str(rewards))
    try:
        from plurals import QUESTION, plural
    finally:
        sys.path.remove(str(rewards))
    folder = EXAMPLE.parents[1] / "preference"
    sizes = []
    for name in ("plurals.jsonl", "plurals-eval.jsonl"):
        f = read_pairs(folder / name)
        sizes.append(len(f))
        for p in f.pairs:
            word = QUESTION.search(p.prompt[-1]["content"])[1]
            assert p.chosen[0]["content"] == plural(word)
            assert p.rejected[0]["content"] in (word, word + "s")
            assert p.rejected[0]["content"] != p.chosen[0]["content"]
    assert sizes == [230, 32]


def test_lines_keep_their_numbers_past_blank_lines_and_metadata_is_kept(tmp_path):
    meta = {"source": "hand", "score": [1, 2]}
    second = pair(
        prompt=[{"role": "system", "content": "Be loud."}, user("a"), assistant("A"), user("b")],
        metadata=meta,
        extra_column="ignored",
    )
    path = write(tmp_path, pair(), "", "   ", second)
    f = read_pairs(path)
    assert [p.key for p in f.pairs] == ["pairs.jsonl:1", "pairs.jsonl:4"]
    assert [p.index for p in f.pairs] == [0, 1]
    assert f.pairs[1].metadata == meta
    # Assistant turns inside the prompt are context and stay in it.
    assert [m["role"] for m in f.pairs[1].prompt] == ["system", "user", "assistant", "user"]
    with pytest.raises(AttributeError):
        f.pairs[0].key = "x"  # frozen


def test_a_tool_pair_spans_turns_and_is_normalized(tmp_path):
    # The prompt ends on the observation of its own call; chosen calls again and answers;
    # rejected answers at once. Calls without ids are named in turn order across the prompt.
    prompt = [
        user("2+3, then +4"),
        assistant("", tool_calls=[call(a=2, b=3)]),
        {"role": "tool", "content": "5"},
    ]
    chosen = [
        assistant(
            "", tool_calls=[{**call(), "function": {"name": "add", "arguments": '{"a":5,"b":4}'}}]
        ),
        {"role": "tool", "content": "9"},
        assistant("9"),
    ]
    rejected = [assistant("5")]
    flat_tools = [{"name": "add", "description": "a + b", "parameters": {"type": "object"}}]
    f = read_pairs(write(tmp_path, pair(prompt, chosen, rejected, tools=flat_tools)))
    (p,) = f.pairs
    assert p.tools == tuple(TOOLS)
    assert p.prompt[1]["tool_calls"][0]["id"] == "call_0"
    assert p.prompt[2]["tool_call_id"] == "call_0" and p.prompt[2]["name"] == "add"
    assert p.chosen[0]["tool_calls"][0]["id"] == "call_1"
    assert p.chosen[0]["tool_calls"][0]["function"]["arguments"] == {"a": 5, "b": 4}
    assert [m["role"] for m in p.chosen] == ["assistant", "tool", "assistant"]
    # An answer may also stop on the results of its calls.
    ends_on_result = [assistant("", tool_calls=[call(a=5, b=4)]), {"role": "tool", "content": "9"}]
    f = read_pairs(write(tmp_path, pair(prompt, ends_on_result, rejected, tools=TOOLS)))
    assert f.pairs[0].chosen[-1]["role"] == "tool"


@pytest.mark.parametrize(
    "line,message",
    [
        ("{not json", r"pairs.jsonl:2: invalid JSON"),
        ('{"prompt": ' + "[" * 900 + "]" * 900 + "}", r"pairs.jsonl:2: invalid JSON \(nested more"),
        ('{"prompt": "x\\udfff"}', r"pairs.jsonl:2: a lone surrogate"),
        ('["a"]', r"pairs.jsonl:2: a pair must be a JSON object"),
        ({"prompt": [user("q")], "rejected": [assistant("r")]}, r'pairs.jsonl:2: missing "chosen"'),
        ({"chosen": [assistant("c")], "rejected": [assistant("r")]}, r'missing "prompt"'),
        (pair(rejected=[]), r'pairs.jsonl:2: "rejected" must be a non-empty list'),
        (pair(prompt="Shout: hi"), r'"prompt" must be a non-empty list of messages'),
        (pair(chosen=[assistant("hi")]), r'"chosen" and "rejected" are the same answer'),
        # Where the prompt ends, where the answers start and end.
        (
            pair(prompt=[user("q"), assistant("a")]),
            r'pairs.jsonl:2: the prompt ends on a message of role "assistant"; it must end on '
            r"a user turn or on tool observations",
        ),
        (
            pair(prompt=[{"role": "system", "content": "s"}]),
            r'prompt ends on a message of role "system"',
        ),
        (
            pair(chosen=[user("more")]),
            r'"chosen" starts with a message of role "user"',
        ),
        (
            pair(rejected=[assistant("x"), user("again")]),
            r'"rejected" ends on a message of role "user"; it must end on an assistant turn',
        ),
        # The conversation rules, numbered from the prompt's first message.
        (
            pair(prompt=[user("q"), {"role": "system", "content": "late"}, user("q2")]),
            r"pairs.jsonl:2: prompt \+ chosen: message 1: a system message may only open",
        ),
        (
            pair(chosen=[assistant("a"), {"role": "system", "content": "s"}, assistant("b")]),
            r"prompt \+ chosen: message 2: a system message may only open",
        ),
        (
            pair(rejected=[assistant("a"), assistant("b")]),
            r"prompt \+ rejected: message 2: two consecutive assistant messages",
        ),
        (pair(chosen=[assistant("")]), r"prompt \+ chosen: message 1 \(assistant\): empty content"),
        (pair(prompt=[user("q"), {"role": "critic", "content": "x"}]), r"role 'critic' is not"),
        (
            pair(prompt=[user("q"), {"role": "tool", "content": "5"}]),
            r"message 1: a tool message answers no pending call",
        ),
    ],
)
def test_refusals_name_the_file_and_line(tmp_path, line, message):
    path = write(tmp_path, pair(), line, pair())
    with pytest.raises(DataError, match=message):
        read_pairs(path)


def test_tool_rules_hold_across_prompt_and_answer(tmp_path):
    opened = [user("2+3"), assistant("", tool_calls=[call(a=2, b=3)])]
    # The prompt's call must be answered before the answer starts.
    unanswered = pair(prompt=opened + [user("well?")], tools=TOOLS)
    with pytest.raises(
        DataError, match=r"pairs.jsonl:1: prompt \+ chosen: message 2: calls call_0"
    ):
        read_pairs(write(tmp_path, unanswered))
    # An answer's call must name a declared tool, and a pair with calls must declare tools.
    undeclared = pair(chosen=[assistant("", tool_calls=[call("mul", a=1, b=2)])], tools=TOOLS)
    with pytest.raises(DataError, match=r"'mul' is not a declared tool"):
        read_pairs(write(tmp_path, undeclared))
    no_tools = pair(
        chosen=[assistant("", tool_calls=[call(a=1, b=2)]), {"role": "tool", "content": "3"}]
    )
    with pytest.raises(DataError, match=r'declares no "tools"'):
        read_pairs(write(tmp_path, no_tools))
    with pytest.raises(DataError, match=r'"tools" must be a list'):
        read_pairs(write(tmp_path, pair(tools={"add": {}})))


def test_missing_and_empty_files_name_the_key(tmp_path):
    with pytest.raises(DataError, match=r"\[preference\].data = .*nope.jsonl: no such pair file"):
        read_pairs(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=r"\[evaluation\].data = .*: no pair in the file"):
        read_pairs(write(tmp_path, "", "  "), where="[evaluation].data")
    (tmp_path / "arr.jsonl").write_text(json.dumps([pair()]))
    with pytest.raises(DataError, match=r"a JSON array; JSONL is one JSON object per line"):
        read_pairs(tmp_path / "arr.jsonl")
    (tmp_path / "bad.jsonl").write_bytes(json.dumps(pair()).encode() + b"\n\xff\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid UTF-8"):
        read_pairs(tmp_path / "bad.jsonl")


def test_the_fingerprint_follows_the_bytes(tmp_path):
    a = read_pairs(write(tmp_path, pair()))
    b = read_pairs(write(tmp_path, pair(chosen=[assistant("HI!")])))
    assert a.fingerprint != b.fingerprint
    assert b.fingerprint == hashlib.sha256((tmp_path / "pairs.jsonl").read_bytes()).hexdigest()
