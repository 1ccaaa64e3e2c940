"""Record validation (formats.md §1.2, §1.4), tool-call parsing, special-token splitting."""

from __future__ import annotations

import pytest

from retrograd.errors import DataError
from retrograd.tokenizer.records import validate_record
from retrograd.tokenizer.special import SpecialSplitter
from retrograd.tokenizer.toolcalls import FORMATS, ToolCall, detect_format

TOOLS = [{"name": "add", "description": "add numbers", "parameters": {"type": "object"}}]


def call(name="add", cid=None, args='{"a": 1}'):
    c = {"type": "function", "function": {"name": name, "arguments": args}}
    return c | ({"id": cid} if cid else {})


def test_plain_chat_validates():
    msgs, tools = validate_record(
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                      {"role": "assistant", "content": "a"}]}, "d.jsonl:3", require_assistant=True,
    )  # fmt: skip
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"] and tools == []


@pytest.mark.parametrize(
    "messages,error",
    [
        ([], "non-empty list"),
        ([{"role": "user", "content": ""}], "empty content"),
        ([{"role": "bot", "content": "x"}], "role 'bot'"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "alternate"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
          {"role": "assistant", "content": "c"}], "two consecutive assistant"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "only open"),
        ([{"role": "assistant", "content": "a"}], "start with a user"),
    ],
)  # fmt: skip
def test_chat_rules_name_the_line(messages, error):
    with pytest.raises(DataError, match=rf"^d\.jsonl:7: .*{error}"):
        validate_record({"messages": messages}, "d.jsonl:7")


def test_tool_record_auto_names_answers_and_errors():
    record = {
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "user", "content": "environment text"},  # allowed in tool records
            {"role": "assistant", "content": "", "tool_calls": [call(), call(args={"a": 2})]},
            {"role": "tool", "tool_call_id": "call_1", "content": "2"},
            {"role": "tool", "content": "boom", "is_error": True},  # answers call_0
            {"role": "assistant", "content": "done"},
        ],
    }
    msgs, tools = validate_record(record, "t.jsonl:1")
    assert tools[0]["type"] == "function" and tools[0]["function"]["name"] == "add"
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["call_0", "call_1"]
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert msgs[3]["tool_call_id"] == "call_1" and msgs[4]["tool_call_id"] == "call_0"
    assert msgs[4]["content"] == "ERROR: boom" and msgs[4]["name"] == "add"


@pytest.mark.parametrize(
    "tail,tools,error",
    [
        ([{"role": "assistant", "content": "", "tool_calls": [call("mul")]}], TOOLS, "not a declared tool"),
        ([{"role": "assistant", "content": "", "tool_calls": [call()]}], None, "declares no"),
        ([{"role": "assistant", "content": "", "tool_calls": [call()]},
          {"role": "user", "content": "x"}], TOOLS, "not answered"),
        ([{"role": "assistant", "content": "", "tool_calls": [call(cid="c9")]},
          {"role": "tool", "tool_call_id": "zz", "content": "1"}], TOOLS, "names no pending call"),
        ([{"role": "assistant", "content": "", "tool_calls": [call()]},
          {"role": "tool", "name": "mul", "content": "1"}], TOOLS, "is not the called tool"),
        ([{"role": "assistant", "content": "", "tool_calls": [call(args="{bad")]}], TOOLS, "JSON"),
        ([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}], TOOLS,
         "must end on an assistant"),
    ],
)  # fmt: skip
def test_tool_rules(tail, tools, error):
    record = {"messages": [{"role": "user", "content": "go"}, *tail]}
    if tools:
        record["tools"] = tools
    with pytest.raises(DataError, match=error):
        validate_record(record, "t.jsonl:4")


def test_raw_turn_must_parse_to_its_declared_calls():
    hermes = FORMATS["hermes"]
    good = hermes.render([ToolCall("add", {"a": 1})])
    base = [{"role": "user", "content": "go"}]
    ok = {"role": "assistant", "raw": True, "content": "Sure.\n" + good, "tool_calls": [call()]}
    validate_record({"tools": TOOLS, "messages": [*base, ok]}, "r.jsonl:1", hermes)
    bad = dict(ok, tool_calls=[call(args={"a": 5})])
    with pytest.raises(DataError, match=r"r\.jsonl:2: message 1: the hermes parser reads"):
        validate_record({"tools": TOOLS, "messages": [*base, bad]}, "r.jsonl:2", hermes)


@pytest.mark.parametrize("name", list(FORMATS))
def test_formats_round_trip(name):
    fmt = FORMATS[name]
    calls = [ToolCall("get_weather", {"city": "Zürich", "days": 3}), ToolCall("noop", {})]
    text = fmt.render(calls)
    parsed = fmt.parse(text if name == "llama3" else "Let me check.\n" + text)
    assert parsed.ok and list(parsed.calls) == calls
    assert parsed.content == ("" if name == "llama3" else "Let me check.")


@pytest.mark.parametrize("name", list(FORMATS))
def test_line_separators_inside_arguments_stay_in_them(name):
    # U+2028 / U+2029 / U+0085 are text, not line ends: a call's argument keeps them
    calls = [ToolCall("note", {"text": "a\u2028b\u2029c\x85d"})]
    parsed = FORMATS[name].parse(FORMATS[name].render(calls))
    assert parsed.ok and list(parsed.calls) == calls


@pytest.mark.parametrize(
    "name,text,kind",
    [
        ("hermes", '<tool_call>{"name": "x", "arguments": {oops}}</tool_call>', "invalid_json"),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>', "missing_name"),
        ("hermes", '<tool_call>{"name": "x"', "unterminated"),
        ("hermes", '<tool_call>["x"]</tool_call>', "not_an_object"),
        ("hermes", '<tool_call>{"name": "x", "arguments": 3}</tool_call>', "bad_arguments"),
        ("llama3", '{"name": "x", "parameters": {', "invalid_json"),
        ("mistral", "[TOOL_CALLS][{bad", "invalid_json"),
        ("mistral", "[TOOL_CALLS]get_weather", "unterminated"),
        ("gemma", "```tool_code\nf(x=\n```", "invalid_syntax"),
    ],
)  # fmt: skip
def test_malformed_calls_are_typed(name, text, kind):
    parsed = FORMATS[name].parse(text)
    assert not parsed.ok and parsed.errors[0].kind == kind


def test_plain_text_has_no_calls():
    for fmt in FORMATS.values():
        assert fmt.parse("Just prose.").calls == () and fmt.parse("Just prose.").ok


def test_format_detection():
    assert detect_format("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert detect_format("<tool_call>").name == "hermes"
    assert detect_format("<|start_header_id|>").name == "llama3"
    assert detect_format("nothing").name == "hermes"


def test_special_split_longest_first_like_llama_cpp():
    # "XAB" with tokens "XA" (shorter) and "AB": llama.cpp cuts the longer one first
    tokens = ["XA", "ABC", "A"]
    splitter = SpecialSplitter([1, 0, 2], tokens, [(False, False)] * 3)
    assert splitter.split("XABC") == ["X", 1]
    assert splitter.split("XAXA A") == [0, 0, " ", 2]


def test_special_split_rstrip():
    splitter = SpecialSplitter([0], ["<|end|>"], [(False, True)])
    assert splitter.split("a<|end|>\n  b") == ["a", 0, "b"]
