"""Tool calls a hostile or broken model writes: parsing never raises, whatever the text, and
arguments no tool could take (nested past the limit, a lone surrogate, a number that is not
finite, a value JSON cannot hold) are typed errors beside the calls that did parse."""

from __future__ import annotations

import math

import pytest

from retrograd.tokenizer.toolcalls import (
    FORMATS,
    MAX_ARGUMENT_DEPTH,
    ToolCall,
    argument_problem,
    normalize_arguments,
)

DEEP = 100_000


def json_call(name: str, body: str, args: str) -> str:
    """A call with `args` (raw JSON text) as its arguments, in format `name`'s markup."""
    if name == "hermes":
        return f'<tool_call>{{"name": "{body}", "arguments": {args}}}</tool_call>'
    if name == "llama3":
        return f'<|python_tag|>{{"name": "{body}", "parameters": {args}}}'
    if name == "mistral":
        return f'[TOOL_CALLS][{{"name": "{body}", "arguments": {args}}}]'
    raise AssertionError(name)


# raw JSON arguments -> the kind of error
HOSTILE_JSON = {
    "arrays 100,000 deep": ('{"a": ' + "[" * DEEP + "]" * DEEP + "}", "invalid_json"),
    "objects 100,000 deep, unclosed": ('{"a": ' + '{"b": ' * DEEP, "invalid_json"),
    "a 5,000-digit integer": ('{"a": ' + "7" * 5000 + "}", "invalid_json"),
    "a lone high surrogate": ('{"a": "x\\ud800y"}', "bad_arguments"),
    "a lone low surrogate": ('{"a": "\\udc80"}', "bad_arguments"),
    "a lone surrogate in a key": ('{"\\udfff": 1}', "bad_arguments"),
    "NaN": ('{"a": NaN}', "bad_arguments"),
    "-Infinity": ('{"a": [-Infinity]}', "bad_arguments"),
    "a float past the range": ('{"a": 1e999}', "bad_arguments"),
    "nested one past the limit": (
        '{"a": ' + "[" * MAX_ARGUMENT_DEPTH + "]" * MAX_ARGUMENT_DEPTH + "}",
        "bad_arguments",
    ),
}


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral"])
@pytest.mark.parametrize("case", list(HOSTILE_JSON))
def test_hostile_json_arguments_are_typed_errors(name, case):
    args, kind = HOSTILE_JSON[case]
    parsed = FORMATS[name].parse(json_call(name, "write_file", args))
    assert parsed.calls == ()
    assert [e.kind for e in parsed.errors] == [kind]


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral"])
def test_a_call_after_a_hostile_one_still_parses(name):
    fmt = FORMATS[name]
    good = fmt.render([ToolCall("ok", {"a": "\x00 is data"})])
    deep = json_call(name, "x", "[" * DEEP)
    if name == "hermes":  # every <tool_call> block is read on its own
        parsed = fmt.parse(deep + "</tool_call>" + good)
        assert list(parsed.calls) == [ToolCall("ok", {"a": "\x00 is data"})]
        assert [e.kind for e in parsed.errors] == ["invalid_json"]
    else:  # one call list per turn: the rest of it is malformed
        assert not fmt.parse(deep + good).ok


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral"])
def test_a_name_that_is_not_text_is_refused(name):
    parsed = FORMATS[name].parse(json_call(name, "bash\\ud800", "{}"))
    assert parsed.calls == () and [e.kind for e in parsed.errors] == ["bad_name"]


def test_mistral_args_form_and_a_deep_array_of_calls():
    fmt = FORMATS["mistral"]
    for text in (
        "[TOOL_CALLS]" + "[" * DEEP,
        "[TOOL_CALLS]f[ARGS]" + "[" * DEEP + "]" * DEEP,
        "[TOOL_CALLS]f[ARGS]{" + '"a": {' * DEEP,
        '[TOOL_CALLS]f[ARGS]{"a": ' + "9" * 5000 + "}",
        '[TOOL_CALLS]f[ARGS]{"a": "\\ud800"}',
    ):
        parsed = fmt.parse(text)
        assert parsed.calls == () and not parsed.ok, text[:40]


GEMMA = {
    "brackets 100,000 deep": "f(a=" + "[" * DEEP + "]" * DEEP + ")",
    "100,000 unary minus signs": "f(a=" + "-" * DEEP + "1)",
    "parentheses 100,000 deep": "f(a=" + "(" * DEEP + "1" + ")" * DEEP + ")",
    "a 5,000-digit integer": "f(a=" + "7" * 5000 + ")",
    "a float past the range": "f(a=1e999)",
    "a lone surrogate": "f(a='\\ud800')",
    "bytes": "f(a=b'x')",
    "a set": "f(a={1, 2})",
    "a complex number": "f(a=1j)",
    "nested one past the limit": "f(a=" + "[" * MAX_ARGUMENT_DEPTH + "]" * MAX_ARGUMENT_DEPTH + ")",
}


@pytest.mark.parametrize("case", list(GEMMA))
def test_hostile_gemma_calls_are_typed_errors(case):
    parsed = FORMATS["gemma"].parse("```tool_code\n" + GEMMA[case] + "\n```")
    assert parsed.calls == () and not parsed.ok
    assert parsed.errors[0].kind in ("invalid_syntax", "bad_arguments")


def test_gemma_tuples_are_arrays():
    parsed = FORMATS["gemma"].parse("```tool_code\nf(a=(1, 2), b=[(3,)])\n```")
    assert list(parsed.calls) == [ToolCall("f", {"a": [1, 2], "b": [[3]]})]


def test_arguments_a_tool_can_take_have_no_problem():
    ok = {"s": "é \x00 \u2028", "n": [1, -2.5, 10**4000, None, True], "o": {"k": {}}}
    assert argument_problem(ok) is None
    nested = {"a": 1}
    for _ in range(MAX_ARGUMENT_DEPTH - 1):
        nested = {"a": nested}
    assert argument_problem(nested) is None
    assert "deep" in argument_problem({"a": nested})


@pytest.mark.parametrize(
    "value,words",
    [
        ([], "must be an object"),
        ({"a": "\ud800"}, "lone surrogate"),
        ({"\udc80": 1}, "lone surrogate"),
        ({"a": math.nan}, "not finite"),
        ({"a": [math.inf]}, "not finite"),
        ({"a": b"x"}, "bytes value, which JSON cannot carry"),
        ({1: "x"}, "int key, which JSON cannot carry"),
    ],
)
def test_argument_problems_say_what_is_wrong(value, words):
    assert words in argument_problem(value)


@pytest.mark.parametrize(
    "text",
    ["[" * DEEP, '{"a": ' * DEEP, '{"a": ' + "1" * 5000 + "}", '{"a": "\\ud800"}', '{"a": NaN}'],
)
def test_normalize_arguments_raises_only_value_error(text):
    with pytest.raises(ValueError):
        normalize_arguments(text)
