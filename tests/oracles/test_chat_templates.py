"""Chat templates: every real template of llama.cpp's models/templates renders as
llama-cpp-python's own jinja renderer renders it; our fallbacks equal llama.cpp's built-in
formats; conversations of real templates get the right masks and llama.cpp's ids."""

from __future__ import annotations

import ctypes
import functools
import warnings
from pathlib import Path

import pytest

from retrograd.errors import ConfigError, TokenizerError
from retrograd.gguf import GGUFFile
from retrograd.tokenizer import Tokenizer
from retrograd.tokenizer.conversation import ChatFormat
from retrograd.tokenizer.fallbacks import FALLBACKS, chat_template, detect_family, special_text
from retrograd.tokenizer.records import validate_record
from retrograd.tokenizer.template import ChatTemplate, TemplateError
from tests.oracles.test_tokenizer_parity import theirs

pytestmark = pytest.mark.oracle

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
]
# Templates that need inputs no chat record has; each fails with an error naming the construct.
NEEDS_MORE = {"fireworks-ai-llama-3-firefunction-v2.jinja": "'functions' is undefined"}


@functools.cache
def tokenizer(path: str) -> Tokenizer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Tokenizer.from_gguf(GGUFFile(path))


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
        },
    }
]
TOOL_CHAT = [
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call0", "type": "function",
     "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
    {"role": "tool", "tool_call_id": "call0", "name": "add", "content": "5"},
    {"role": "assistant", "content": "It is 5."},
]  # fmt: skip
# llama-cpp-python passes tools=None where we leave `tools` undefined; these templates iterate
# `tools` unchecked, which fails on None: they get the empty catalog undefined iterates as.
ITERATE_TOOLS = {
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
}


class Both:
    """One template compiled by us and by llama-cpp-python's Jinja2ChatFormatter."""

    def __init__(self, path: Path):
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        source = path.read_text()
        self.name = path.name
        self.ours = ChatTemplate(source, "<s>", "</s>", name=path.name)
        self.theirs = Jinja2ChatFormatter(source, "</s>", "<s>")

    def render(self, messages: list[dict], gen: bool, tools=None) -> tuple[str | None, ...]:
        """(ours, theirs); None where one refuses."""
        try:
            ours = self.ours.render(messages, tools=tools, add_generation_prompt=gen)
        except TemplateError:
            ours = None
        their_tools = tools if tools or self.name not in ITERATE_TOOLS else []
        try:
            self.theirs.add_generation_prompt = gen  # read at each call
            theirs_text = self.theirs(messages=messages, tools=their_tools).prompt
        except Exception:  # whatever the oracle raises is a refusal
            theirs_text = None
        return ours, theirs_text


def test_every_real_template_renders_as_llama_cpp_python(llama_vendor):
    """The same text as llama-cpp-python's renderer (transformers' conventions, in code we did
    not write), or a refusal by both: with and without a system message and the generation
    prompt, and a tool conversation with its catalog."""
    paths = sorted((llama_vendor / "templates").glob("*.jinja"))
    assert len(paths) >= 60
    with_tools = 0
    for path in paths:
        t = Both(path)
        rendered = []
        for messages in (CHAT, CHAT[1:]):  # some templates refuse a system message
            for gen in (True, False):
                ours, theirs_text = t.render(messages, gen)
                assert ours == theirs_text, (path.name, len(messages), gen)
                rendered.append(ours)
        if path.name in NEEDS_MORE:
            assert rendered == [None] * 4, path.name
            with pytest.raises(TemplateError, match=NEEDS_MORE[path.name]):
                t.ours.render(CHAT[1:])
        else:
            text = rendered[0] or rendered[2]
            assert "What is 2+2?" in text and "Hello! How can I help?" in text, path.name
        ours, theirs_text = t.render(TOOL_CHAT, False, TOOLS)
        assert ours == theirs_text, (path.name, "tools")
        with_tools += ours is not None
        t.ours.supports_tools  # noqa: B018  (the probe must not raise)
    assert with_tools >= len(paths) - 12  # measured: 61 of 71 render the tool conversation


def _llama_builtin(name: str, messages: list[dict], add_ass: bool) -> str:
    import llama_cpp

    arr = (llama_cpp.llama_chat_message * len(messages))(
        *[llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages]
    )
    buf = ctypes.create_string_buffer(1 << 14)
    n = llama_cpp.llama_chat_apply_template(
        name.encode(), arr, len(messages), add_ass, buf, 1 << 14
    )
    assert 0 < n <= 1 << 14
    return buf.raw[:n].decode()


@pytest.mark.parametrize(
    "family,llama_name",
    [("chatml", "chatml"), ("gemma", "gemma"), ("llama3", "llama3"), ("phi3", "phi3"),
     ("mistral", "mistral-v3"), ("mistral-v7", "mistral-v7")],
)  # fmt: skip
def test_fallbacks_equal_llama_builtin_formats(family, llama_name):
    t = ChatTemplate(FALLBACKS[family], name=family)
    messages = [dict(m, content=f"  {m['content']} ") for m in CHAT]  # exercise trimming
    for n in (2, 3, 5):
        for gen in (False, True):
            if family.startswith("mistral") and gen:
                continue  # llama.cpp's mistral formats have no generation prompt
            assert t.render(messages[:n], add_generation_prompt=gen) == _llama_builtin(
                llama_name, messages[:n], gen
            ), (family, n, gen)


def test_gemma_model_gets_the_gemma_fallback(gemma_path):
    tok = tokenizer(str(gemma_path))
    g = GGUFFile(gemma_path)
    assert "tokenizer.chat_template" not in g.metadata
    assert detect_family(tok) == "gemma"
    t = chat_template(tok, g.metadata)
    assert t.name == "gemma" and t.bos_token == "<bos>" and t.eos_token == "<eos>"
    assert not t.supports_tools


def test_vocab_without_markers_is_a_clear_error(llama_vendor):
    tok = tokenizer(str(llama_vendor / "ggml-vocab-gpt-2.gguf"))
    with pytest.raises(TokenizerError, match="no chat template"):
        chat_template(tok, {})


def test_reserved_template_variables_are_refused():
    with pytest.raises(ConfigError, match="template_variables.messages: reserved"):
        ChatTemplate(FALLBACKS["chatml"], variables={"messages": []})
    t = ChatTemplate(
        "{{ 'on' if enable_thinking else 'off' }}", variables={"enable_thinking": False}
    )
    assert t.render([]) == "off"


# (template file, vocab file): real templates with a vocabulary of their family
REAL = [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "qwen2"),
    ("Qwen-Qwen3-0.6B.jinja", "qwen2"),
    ("Qwen3.5-4B.jinja", "qwen35"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama-bpe"),
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama-bpe"),
    ("meta-llama-Llama-3.3-70B-Instruct.jinja", "llama-bpe"),
    ("microsoft-Phi-3.5-mini-instruct.jinja", "phi-3"),
    ("google-gemma-2-2b-it.jinja", "gemma"),
    ("google-gemma-4-31B-it.jinja", "gemma-4"),
    ("HuggingFaceTB-SmolLM3-3B.jinja", "qwen2"),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "llama-spm"),
]


# Templates whose ids, tokenized turn by turn (conversation.py), differ from llama.cpp's
# tokenization of the whole rendered text; the value says whether they still spell that text.
PIECEWISE = {
    "Qwen3.5-4B.jinja": True,  # ">\n" + "\n" where the whole text has one ">\n\n" token
    # NOTE: a known defect: " \n" kept before each <|user|> after an assistant turn, which
    # llama.cpp strips after Phi-3's special tokens (the piece after a turn is tokenized alone)
    "microsoft-Phi-3.5-mini-instruct.jinja": False,
}


def _vocab_path(llama_vendor, gemma_path, name: str) -> Path:
    return gemma_path if name == "gemma" else llama_vendor / f"ggml-vocab-{name}.gguf"


def _vocab(llama_vendor, gemma_path, name: str) -> Tokenizer:
    return tokenizer(str(_vocab_path(llama_vendor, gemma_path, name)))


@pytest.mark.parametrize("template,vocab", REAL)
def test_real_template_masks(llama_vendor, gemma_path, template, vocab):
    """Trained tokens are exactly each assistant reply and the end-of-turn token after it; the
    ids are llama.cpp's tokenization of the rendered text, except where PIECEWISE says."""
    tok = _vocab(llama_vendor, gemma_path, vocab)
    source = (llama_vendor / "templates" / template).read_text()
    bos, eos = special_text(tok, tok.bos_id), special_text(tok, tok.eos_id)
    fmt = ChatFormat(tok, ChatTemplate(source, bos, eos, name=template))
    record = {"messages": CHAT if "gemma-2" not in template else CHAT[1:]}
    messages, _ = validate_record(record, "t.jsonl:1")
    enc = fmt.encode(messages)
    assert len(enc.ids) == len(enc.train_mask)
    trained = tok.detokenize(
        [i for i, m in zip(enc.ids, enc.train_mask, strict=True) if m], special=True
    )
    assert "Hello! How can I help?" in trained and "4" in trained
    assert "Hi there" not in trained and "What is 2+2?" not in trained
    eog = [i for i, m in zip(enc.ids, enc.train_mask, strict=True) if m and tok.is_eog(i)]
    assert len(eog) == 2, template  # one end-of-turn per assistant reply
    llama_ids = theirs(str(_vocab_path(llama_vendor, gemma_path, vocab))).tokenize(
        enc.text.encode(), add_bos=True, special=True
    )
    assert tok.tokenize(enc.text, add_bos=True, parse_special=True) == llama_ids, template
    assert enc.whole_text_equal == (enc.ids == llama_ids), template
    assert (enc.ids == llama_ids) == (template not in PIECEWISE), template
    same_text = tok.detokenize(enc.ids, special=True) == tok.detokenize(llama_ids, special=True)
    assert same_text == PIECEWISE.get(template, True), template


TOOL_RECORD = {
    "tools": [{"name": "add", "description": "Add two numbers", "parameters": {"type": "object"}}],
    "messages": [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
    ],
}  # fmt: skip


@pytest.mark.parametrize("raw", [False, True])
def test_tool_record_through_a_tool_template(llama_vendor, raw):
    """Qwen 2.5 renders tools itself: calls are trained in its markup, results are context."""
    tok = tokenizer(str(llama_vendor / "ggml-vocab-qwen2.gguf"))
    source = (llama_vendor / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    fmt = ChatFormat(tok, ChatTemplate(source, "", "<|endoftext|>"))
    assert fmt.template.supports_tools and fmt.tool_format.name == "hermes"
    record = TOOL_RECORD
    if raw:
        call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        msgs = [dict(m) for m in TOOL_RECORD["messages"]]
        msgs[1] = dict(msgs[1], raw=True, content=call)
        record = dict(TOOL_RECORD, messages=msgs)
    messages, tools = validate_record(record, "t.jsonl:1", fmt.tool_format)
    enc = fmt.encode(messages, tools)
    trained = tok.detokenize(
        [i for i, m in zip(enc.ids, enc.train_mask, strict=True) if m], special=True
    )
    assert '"name": "add"' in trained and "It is 5.<|im_end|>" in trained
    assert "What is 2+3?" not in trained and "Add two numbers" not in trained
    assert "<tool_response>\n5\n</tool_response>" in enc.text  # Qwen's own framing of results
    turn = [i for i, m in zip(enc.ids, enc.train_mask, strict=True) if m]
    call_text = tok.detokenize(turn[: turn.index(tok.token_id("<|im_end|>"))], special=True)
    assert [c.name for c in fmt.parse(call_text).calls] == ["add"]


def test_gemma_conversation_ids_equal_llama(gemma_path):
    """Prompt ids for the Gemma fallback are what llama.cpp makes of the same text."""
    tok = tokenizer(str(gemma_path))
    fmt = ChatFormat(tok, chat_template(tok, GGUFFile(gemma_path).metadata))
    messages, tools = validate_record(TOOL_RECORD, "t.jsonl:1", fmt.tool_format)
    enc = fmt.encode(messages, tools)
    llm = theirs(str(gemma_path))
    assert enc.prefix_stable and enc.whole_text_equal
    assert enc.ids == llm.tokenize(enc.text.encode(), add_bos=True, special=True)
    prompt = fmt.prompt_ids(messages[:1], tools)
    assert prompt == llm.tokenize(
        fmt.render(messages[:1], tools, True).encode(), add_bos=True, special=True
    )
    assert tok.detokenize(prompt, special=True).endswith("<start_of_turn>model\n")
