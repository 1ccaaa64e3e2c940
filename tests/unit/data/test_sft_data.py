"""SFT datasets: formats, windows, masks, truncation and errors that name file and line."""

from __future__ import annotations

import json

import pytest

import retrograd
from retrograd.data.sft import infer_format, load_sft_data
from retrograd.errors import DataError
from retrograd.tokenizer.conversation import ChatFormat
from retrograd.tokenizer.fallbacks import chat_template


@pytest.fixture(scope="module")
def gemma_chat(gemma_path):
    from retrograd.gguf import GGUFFile

    tok = retrograd.load_tokenizer(gemma_path)
    return tok, ChatFormat(tok, chat_template(tok, GGUFFile(gemma_path).metadata))


def chat(q: str, a: str) -> str:
    return json.dumps(
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
    )


def test_format_inference(tmp_path):
    for name, body, fmt in [
        ("a.jsonl", "x", "jsonl"),
        ("a.txt", "{", "text"),
        ("a.md", "{", "text"),
        ("a.data", '  {"messages": []}', "jsonl"),
        ("a.data", "hello", "text"),
    ]:
        p = tmp_path / name
        p.write_text(body)
        assert infer_format(p) == fmt
    assert infer_format(tmp_path / "a.txt", "jsonl") == "jsonl"
    with pytest.raises(DataError, match="must be text or jsonl"):
        infer_format(tmp_path / "a.txt", "csv")


def test_text_windows_overlap_by_one_so_every_token_is_predicted_once(tiny_model, tmp_path):
    tok = retrograd.load_tokenizer(tiny_model("llama"))
    p = tmp_path / "t.txt"
    p.write_text("the quick brown fox jumps over the lazy dog " * 5)
    ids = tok.tokenize(p.read_text(), add_bos=True)
    ds = load_sft_data(p, tok, ctx=16)
    assert all(len(e.ids) <= 16 for e in ds.examples)
    predicted = [t for e in ds.examples for t, m in zip(e.ids, e.mask, strict=True) if m]
    assert predicted == ids[1:]
    assert ds.format == "text" and ds.n_targets == len(ids) - 1


def test_chat_masks_train_only_the_assistant(gemma_chat, tmp_path):
    tok, fmt = gemma_chat
    p = tmp_path / "c.jsonl"
    p.write_text(chat("Hi", "Hello there!") + "\n\n" + chat("Bye", "See you.") + "\n")
    ds = load_sft_data(p, tok, ctx=64, chat=fmt)
    assert [e.where for e in ds.examples] == ["c.jsonl:1", "c.jsonl:3"]
    trained = tok.detokenize(
        [t for t, m in zip(ds.examples[0].ids, ds.examples[0].mask, strict=True) if m], special=True
    )
    assert trained == "Hello there!<end_of_turn>"


def test_long_rows_are_truncated_and_empty_ones_dropped(gemma_chat, tmp_path):
    tok, fmt = gemma_chat
    p = tmp_path / "c.jsonl"
    long_q = "word " * 40
    p.write_text(
        "\n".join(
            [
                chat("Hi", "Hello there, friend."),
                chat(long_q, "Yes."),
                chat("Hi", "A " + "long answer " * 30),
            ]
        )
        + "\n"
    )
    ds = load_sft_data(p, tok, ctx=24, chat=fmt)
    assert ds.truncated == 2 and ds.dropped == 1  # the long question leaves nothing to train
    assert [e.where for e in ds.examples] == ["c.jsonl:1", "c.jsonl:3"]
    assert len(ds.examples[1].ids) == 24 and sum(ds.examples[1].mask) > 0
    assert "truncated" in ds.describe() and "dropped" in ds.describe()


@pytest.mark.parametrize(
    "line, message",
    [
        ("{oops", "c.jsonl:2: invalid JSON"),
        (  # not a RecursionError: named like any other bad line
            '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}",
            r"c.jsonl:2: invalid JSON \(nested more than 64 levels deep at column 77\)",
        ),
        (  # not a TypeError from the tokenizer: a lone surrogate is no text to train on
            '{"messages": [{"role": "user", "content": "hi \\ud800"}, '
            '{"role": "assistant", "content": "ok"}]}',
            r"c.jsonl:2: a lone surrogate \(a \\ud800 escape\), which is not text",
        ),
        ('{"messages": []}', 'c.jsonl:2: "messages" must be a non-empty list'),
        (
            '{"messages": [{"role": "user", "content": "only a question"}]}',
            "c.jsonl:2: no assistant message",
        ),
    ],
)
def test_bad_records_name_file_and_line(gemma_chat, tmp_path, line, message):
    tok, fmt = gemma_chat
    p = tmp_path / "c.jsonl"
    p.write_text(chat("Hi", "Hello") + "\n" + line + "\n")
    with pytest.raises(DataError, match=message):
        load_sft_data(p, tok, ctx=64, chat=fmt)


def test_missing_file_and_empty_data(tiny_model, tmp_path):
    tok = retrograd.load_tokenizer(tiny_model("llama"))
    with pytest.raises(DataError, match="no such data file"):
        load_sft_data(tmp_path / "absent.txt", tok, ctx=16)
    for name, body in [("e.txt", ""), ("w.txt", " \n\t\r\n  \n"), ("b.md", "\ufeff\n")]:
        (tmp_path / name).write_text(body, encoding="utf-8")
        with pytest.raises(DataError, match=f"{name}: no text to train on"):
            load_sft_data(tmp_path / name, tok, ctx=16)


# JSON allows these unescaped inside a string; str.splitlines() cuts a line at each of them
# (it also cuts at \x0b, \x0c and \x1c-\x1e, which JSON strings hold only escaped).
LINE_BREAKS_IN_STRINGS = ["\u2028", "\u2029", "\x85"]


def test_jsonl_records_end_at_newline_only(gemma_chat, tmp_path):
    tok, fmt = gemma_chat
    answers = [f"one{c}two" for c in LINE_BREAKS_IN_STRINGS]
    # ensure_ascii=False writes each character as itself; CRLF line ends.
    lines = [json.dumps({"messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": a}]},
        ensure_ascii=False) for a in answers]  # fmt: skip
    assert all(c in line for c, line in zip(LINE_BREAKS_IN_STRINGS, lines, strict=True))
    p = tmp_path / "c.jsonl"
    p.write_bytes("\r\n".join(lines).encode() + b"\r\n")
    ds = load_sft_data(p, tok, ctx=64, chat=fmt)
    assert [e.where for e in ds.examples] == [f"c.jsonl:{i + 1}" for i in range(len(answers))]
    for ex, answer in zip(ds.examples, answers, strict=True):
        trained = tok.detokenize([t for t, m in zip(ex.ids, ex.mask, strict=True) if m])
        assert trained.startswith(answer), (trained, answer)


def test_jsonl_line_numbers_count_newlines_only(gemma_chat, tmp_path):
    tok, fmt = gemma_chat
    good = json.dumps(
        {
            "messages": [
                {"role": "user", "content": "a\u2028b"},
                {"role": "assistant", "content": "c"},
            ]
        },
        ensure_ascii=False,
    )
    p = tmp_path / "c.jsonl"
    p.write_text(good + "\n" + good + "\n{oops\n", encoding="utf-8")
    with pytest.raises(DataError, match="c.jsonl:3: invalid JSON"):
        load_sft_data(p, tok, ctx=64, chat=fmt)


def test_invalid_utf8_names_file_line_and_byte(gemma_chat, tiny_model, tmp_path):
    tok, fmt = gemma_chat
    p = tmp_path / "c.jsonl"
    p.write_bytes(chat("Hi", "Hello").encode() + b"\n" + b'{"messages": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"^c.jsonl:2: not valid UTF-8 \(byte 18\)$"):
        load_sft_data(p, tok, ctx=64, chat=fmt)
    t = tmp_path / "t.txt"
    t.write_bytes(b"first line\nsecond \xff line\n")
    with pytest.raises(DataError, match=r"^t.txt:2: not valid UTF-8 \(byte 8\)$"):
        load_sft_data(t, retrograd.load_tokenizer(tiny_model("llama")), ctx=16)


def test_byte_order_mark_is_not_data(gemma_chat, tiny_model, tmp_path):
    tok, fmt = gemma_chat
    p = tmp_path / "c.data"  # no known extension: the sniff must see past the mark too
    p.write_bytes(b"\xef\xbb\xbf" + chat("Hi", "Hello").encode() + b"\n")
    assert infer_format(p) == "jsonl"
    assert len(load_sft_data(p, tok, ctx=64, chat=fmt).examples) == 1
    llama = retrograd.load_tokenizer(tiny_model("llama"))
    t = tmp_path / "t.txt"
    t.write_bytes(b"\xef\xbb\xbfthe cat sat")
    ids = load_sft_data(t, llama, ctx=64).examples[0].ids
    assert list(ids) == llama.tokenize("the cat sat", add_bos=True)


@pytest.mark.parametrize("name, out", [("d.json", "d.jsonl"), ("d.jsonl", "d-lines.jsonl")])
def test_json_array_gets_the_jsonl_hint(gemma_chat, tmp_path, name, out):
    tok, fmt = gemma_chat
    p = tmp_path / name
    p.write_text("  [\n" + chat("Hi", "Hello") + ",\n" + chat("Bye", "See you") + "\n]\n")
    with pytest.raises(DataError) as e:
        load_sft_data(p, tok, ctx=64, chat=fmt)
    assert str(e.value) == (
        f"{p}: a JSON array; JSONL is one JSON object per line "
        f"(convert it with: jq -c '.[]' {name} > {out})"
    )
