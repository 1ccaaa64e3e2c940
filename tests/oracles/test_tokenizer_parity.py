"""Our ids, pieces and detokenized text against llama.cpp (llama-cpp-python) and its test files.

Vocabularies: the real Gemma 3 model and llama.cpp's vocab-only GGUFs from the
llama-cpp-python sdist (`ggml-vocab-*.gguf` with `.inp`/`.out`, the expected tokenizations
llama.cpp's own test-tokenizer-0 checks). Each tokenizer is built once per module.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import random
import warnings

import pytest

from retrograd.errors import UnsupportedError
from retrograd.tokenizer import load_tokenizer
from tests.oracles.llama_oracle import quiet

pytestmark = pytest.mark.oracle

# vocab files with .inp/.out (SPM, byte-level BPE with many pre-tokenizers, Gemma 4)
WITH_TESTS = [
    "llama-spm", "phi-3", "llama-bpe", "qwen2", "qwen35", "gpt-2", "deepseek-llm",
    "deepseek-coder", "falcon", "starcoder", "refact", "mpt", "command-r", "gemma-4",
]  # fmt: skip
WITHOUT_TESTS = ["baichuan", "aquila", "gpt-neox"]  # no .inp; aquila/gpt-neox lack a pre name

CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock, isn't it?",
    "Le renard brun saute par-dessus le chien paresseux. Les élèves étudient à l'école.",
    "Der schnelle braune Fuchs springt über den faulen Hund. Straße, Größe, Übung.",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "素早い茶色の狐が怠け者の犬を飛び越える。快速的棕色狐狸跳过了懒狗。한국어 텍스트",
    "ελληνικά العربية עברית हिन्दी ไทย",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }\n\t// tab-indented',
    "3.14159 2.71828 1,000,000 and 42; 2026-11-29 13:45:07 0x1F 1e-9 123456789012",
    "Emoji: 🎉🚀🔥 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ✅ and symbols ∑∫√∞ ≠ ≤ ≥",
    "   leading spaces and trailing   ",
    "a  b   c    d     e" + " " * 40 + "f",
    "\n\n\n\nnewlines\n\n\t\t\ttabs\t \t\r\nCRLF\r\n",
    "I'm don't you'll we've they're it's 'tis ' quoted ' , . ! ?",
    "<s>[INST] hi [/INST]</s> <unk>",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n<eos>",
    "<table><tr><td>1</td></tr></table> <unused5> <mask> [multimodal] <|endoftext|>",
    "",
    " ",
    "\u00a0non-breaking\u2003em-space\u200bzero-width e\u0301",
]

_POOL = list(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'\"()[]{}<>/\\|-_=+*&^%"
    "$#@~`\n\t\r"
) + list(
    "éüßçñøåæœ日本語中文한국어Привет ελληνικάالعربيةעבריתहिन्दीไทย🤖👍🏽✅€£¥§°±µ\u00a0\u200b\u0301"
)
_SPECIALS = [
    "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>", "<|eot_id|>",
    "[INST]", "<unk>", "<|endoftext|>", "<bos>", "<eos>", "  ", "\n\n", "<b>", "</td>", "<mask>",
    "<|end|>", "<|user|>",
]  # fmt: skip


def fuzz(n: int, seed: int = 0) -> list[str]:
    """Random texts mixing characters of many scripts, whitespace runs and special strings."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(r.randint(1, 12)):
            k = r.random()
            if k < 0.15:
                parts.append(r.choice(_SPECIALS))
            elif k < 0.3:
                parts.append(" " * r.randint(1, 6))
            else:
                parts.append("".join(r.choice(_POOL) for _ in range(r.randint(1, 15))))
        out.append("".join(parts))
    return out


@functools.cache
def ours(path: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_tokenizer(path)


@functools.cache
def theirs(path: str):
    import llama_cpp

    quiet()
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    atexit.register(llm.close)  # before interpreter teardown, which breaks Llama.__del__
    return llm


def llama_detokenize(llm, ids: list[int], remove_special: bool, special: bool) -> bytes:
    import llama_cpp

    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 1 << 16
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(
        llm._model.vocab, arr, len(ids), buf, size, remove_special, special
    )
    assert 0 <= n <= size
    return buf.raw[:n]


def llama_piece(llm, token: int, special: bool) -> bytes:
    import llama_cpp

    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(llm._model.vocab, token, buf, 256, 0, special)
    assert 0 <= n <= 256
    return buf.raw[:n]


def vocab_path(vendor, name: str) -> str:
    return str(vendor / f"ggml-vocab-{name}.gguf")


def check_against_llama(path: str, texts: list[str]) -> None:
    tok, llm = ours(path), theirs(path)
    for text in texts:
        for add_bos, special in ((False, False), (True, False), (True, True)):
            expected = llm.tokenize(text.encode(), add_bos=add_bos, special=special)
            got = tok.tokenize(text, add_bos=add_bos, parse_special=special)
            assert got == expected, (text, add_bos, special)
            for remove_special in (False, True):
                want = llama_detokenize(llm, expected, remove_special, special)
                assert tok.detokenize_bytes(expected, special, remove_special) == want, text


@pytest.mark.parametrize("name", WITH_TESTS)
def test_llama_cpp_test_files(llama_vendor, name):
    """Every case of llama.cpp's own test-tokenizer-0 data gives the expected ids."""
    path = vocab_path(llama_vendor, name)
    inputs = open(path + ".inp", encoding="utf-8").read().split("\n__ggml_vocab_test__\n")
    outputs = open(path + ".out", encoding="utf-8").read().split("\n")
    tok = ours(path)
    assert len(inputs) >= 40
    for text, line in zip(inputs, outputs, strict=False):
        assert tok.tokenize(text, add_bos=False) == [int(x) for x in line.split()], text


@pytest.mark.parametrize("name", WITH_TESTS + WITHOUT_TESTS)
def test_corpus_and_fuzz_equal_llama(llama_vendor, name):
    path = vocab_path(llama_vendor, name)
    check_against_llama(path, CORPUS + fuzz(40, seed=len(name)))


def test_gemma_equals_llama(gemma_path):
    check_against_llama(str(gemma_path), CORPUS + fuzz(150))


def test_gemma_pieces_equal_llama(gemma_path):
    tok, llm = ours(str(gemma_path)), theirs(str(gemma_path))
    ids = list(range(0, 300)) + list(range(0, tok.n_vocab, 997)) + [tok.n_vocab - 1]
    for i in ids:
        for special in (False, True):
            assert tok.token_to_piece(i, special) == llama_piece(llm, i, special), i


@pytest.mark.parametrize("name", ["llama-spm", "qwen2", "gemma-4"])
def test_pieces_equal_llama(llama_vendor, name):
    path = vocab_path(llama_vendor, name)
    tok, llm = ours(path), theirs(path)
    for i in list(range(0, 400)) + list(range(400, tok.n_vocab, 331)):
        for special in (False, True):
            assert tok.token_to_piece(i, special) == llama_piece(llm, i, special), i


def test_gemma_special_ids_equal_llama(gemma_path):
    import llama_cpp

    tok, llm = ours(str(gemma_path)), theirs(str(gemma_path))
    vocab = llm._model.vocab
    assert tok.n_vocab == llama_cpp.llama_vocab_n_tokens(vocab) == 262144
    assert tok.bos_id == llama_cpp.llama_vocab_bos(vocab) == 2
    assert tok.eos_id == llama_cpp.llama_vocab_eos(vocab) == 1
    eog = {i for i in range(tok.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert tok.eot_ids == eog
    # <eos>, <end_of_turn>, and the HTML tag "</s>", which llama.cpp's text rule also marks
    assert eog == {1, 106, 212}


@pytest.mark.parametrize("name", ["qwen2", "llama-bpe", "phi-3", "command-r", "gemma-4"])
def test_eog_ids_equal_llama(llama_vendor, name):
    import llama_cpp

    path = vocab_path(llama_vendor, name)
    tok, llm = ours(path), theirs(path)
    vocab = llm._model.vocab
    eog = {i for i in range(tok.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert tok.eot_ids == eog
    assert tok.bos_id == llama_cpp.llama_vocab_bos(vocab)
    assert tok.add_bos == llama_cpp.llama_vocab_get_add_bos(vocab)


@pytest.mark.parametrize("name", ["bert-bge", "nomic-bert-moe"])
def test_unsupported_models_are_named(llama_vendor, name):
    with pytest.raises(UnsupportedError, match="tokenizer model '(bert|t5)' is not supported"):
        load_tokenizer(vocab_path(llama_vendor, name))


def test_batch_equals_single(gemma_path):
    tok = ours(str(gemma_path))
    texts = CORPUS + fuzz(20, seed=7)
    assert tok.tokenize_batch(texts) == [tok.tokenize(t) for t in texts]
    assert tok.tokenize_batch(texts, parse_special=True) == [
        tok.tokenize(t, parse_special=True) for t in texts
    ]
