"""`bench`'s data for a distillation run: a chat file or a file of prompts, told apart by the
first line, which is read as hostile (nested too deep) without crashing the command."""

from __future__ import annotations

import pytest

from retrograd.cli.bench import _distill_data
from retrograd.errors import DataError
from retrograd.tokenizer import ChatFormat, chat_template
from tests.factories.agents import CHAT_TEMPLATE
from tests.factories.tiny_gguf import write_tiny

DEEP = 100_000


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> ChatFormat:
    import retrograd
    from retrograd.gguf import GGUFFile

    path = write_tiny(
        tmp_path_factory.mktemp("bench") / "t.gguf", "gemma3", chat_template=CHAT_TEMPLATE
    )
    tok = retrograd.load_tokenizer(path)
    return ChatFormat(tok, chat_template(tok, GGUFFile(path).metadata))


@pytest.mark.parametrize(
    ("first", "message"),
    [
        (
            '{"messages": ' + "[" * DEEP + "]" * DEEP + "}",
            "data.jsonl:1: invalid JSON (nested more than 64",
        ),
        ("[" * DEEP + "]" * DEEP, "data.jsonl: a JSON array; JSONL is one JSON object per line"),
    ],
)
def test_a_first_line_nested_too_deep_is_a_data_error_naming_the_file(
    tmp_path, chat, first, message
):
    data = tmp_path / "data.jsonl"
    data.write_text(first + "\n")
    with pytest.raises(DataError) as error:
        _distill_data(None, str(data), None, chat, None, 64)
    assert message in str(error.value)
