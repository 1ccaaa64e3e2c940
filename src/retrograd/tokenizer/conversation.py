"""Conversations -> (ids, train mask): the ids a model sees when served, trained where it writes.

`ChatFormat` joins a tokenizer, a chat template and a tool-call format; `serve`, agent
rollouts, `collect` and SFT all go through it. Rendering: tools go through the template when
it renders them (probed once), otherwise the catalog is described in the system prompt, calls
are written and parsed in the Hermes convention and results become user turns.

Masks: for assistant message i the prompt P = render(messages[:i], generation prompt) and the
turn Q = render(messages[:i+1]) give the text the model writes, Q minus P. It is trained up to
and including the first end-of-generation token in it; what follows (a newline after
<end_of_turn>) is template framing. Each span is located in the full render; a template that
renders earlier messages differently once later ones follow is "not prefix-stable": the spans
are then found by search (masks stay right) and the condition is reported. Pieces are
tokenized on their own, as a prompt and the tokens generated after it are; whether that equals
tokenizing the whole text is reported too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from retrograd.errors import TokenizerError
from retrograd.tokenizer.codec import Tokenizer
from retrograd.tokenizer.template import ChatTemplate
from retrograd.tokenizer.toolcalls import (
    FORMATS,
    ParsedTurn,
    ToolFormat,
    describe_tools,
    detect_format,
)

_SENTINEL = "\u2063retrograd-content\u2063"


@dataclass(frozen=True)
class EncodedConversation:
    ids: list[int]
    train_mask: list[int]  # 1 where the model writes (assistant text and its end-of-turn token)
    text: str  # the full render, BOS string removed where the tokenizer adds BOS
    prefix_stable: bool
    whole_text_equal: bool  # the ids equal tokenizing `text` in one go
    notes: tuple[str, ...] = ()

    def __iter__(self):  # ids, train_mask = encode_conversation(...)
        yield self.ids
        yield self.train_mask


class ChatFormat:
    """How one model reads and writes conversations: tokenizer, template, tool-call format."""

    def __init__(
        self, tokenizer: Tokenizer, template: ChatTemplate, tool_format: ToolFormat | None = None
    ):
        self.tokenizer = tokenizer
        self.template = template
        if tool_format is None:
            native = template.supports_tools
            tool_format = detect_format(template.source) if native else FORMATS["hermes"]
        self.tool_format = tool_format

    # -- rendering -------------------------------------------------------------------------

    def template_messages(
        self, messages: list[dict], tools: list[dict] | None
    ) -> tuple[list[dict], list | None]:
        """Messages and tools as the template receives them (see the module docstring)."""
        if not tools or self.template.supports_tools:
            return [_plain(m) for m in messages], (tools or None)
        fmt = FORMATS["hermes"]
        out: list[dict] = []
        catalog = describe_tools(tools)
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + catalog})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": catalog})
        for m in messages:
            if m["role"] == "tool":
                block = f"<tool_response>\n{m['content']}\n</tool_response>"
                if out[-1].get("_tool"):
                    out[-1]["content"] += "\n" + block
                else:
                    out.append({"role": "user", "content": block, "_tool": True})
            elif m["role"] == "assistant" and m.get("tool_calls") and not m.get("raw"):
                calls = [_to_call(c) for c in m["tool_calls"]]
                text = (m["content"] + "\n" if m["content"] else "") + fmt.render(calls)
                out.append({"role": "assistant", "content": text})
            else:
                out.append(_plain(m))
        return [{k: v for k, v in m.items() if k != "_tool"} for m in out], None

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        msgs, tmpl_tools = self.template_messages(messages, tools)
        return self.template.render(
            msgs, tools=tmpl_tools, add_generation_prompt=add_generation_prompt
        )

    def _strip_bos(self, text: str) -> str:
        bos = self.template.bos_token
        if self.tokenizer.add_bos and bos and text.startswith(bos):
            return text[len(bos) :]  # llama.cpp does the same before tokenizing with BOS
        return text

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Ids of the prompt a model continues (generation prompt appended), as llama.cpp."""
        text = self._strip_bos(self.render(messages, tools, add_generation_prompt=True))
        return self.tokenizer.tokenize(text, add_bos=True, parse_special=True)

    def parse(self, text: str) -> ParsedTurn:
        """Calls in a generated turn, in this model's convention."""
        return self.tool_format.parse(text)

    # -- encoding --------------------------------------------------------------------------

    def encode(self, messages: list[dict], tools: list[dict] | None = None) -> EncodedConversation:
        msgs, tmpl_tools = self.template_messages(messages, tools)
        render = self.template.render
        full = render(msgs, tools=tmpl_tools)
        notes: list[str] = []
        spans: list[tuple[int, int]] = []
        prefix_stable, pos = True, 0
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            prompt = render(msgs[:i], tools=tmpl_tools, add_generation_prompt=True)
            turn = render(msgs[: i + 1], tools=tmpl_tools)
            c = _common_prefix(prompt, turn)
            content_at = self._content_start(msgs, i, turn, tmpl_tools)
            if c < len(prompt):
                notes.append(
                    f"message {i}: the generation prompt is not a prefix of the rendered turn"
                )
                c = content_at if content_at is not None else c
            written = turn[c:]
            if full.startswith(turn) and c >= pos:
                start = c
            else:
                prefix_stable = False
                start = full.find(written, pos) if written else -1
                # e.g. an empty <think> block, or an EOS, rendered only on the last turn
                tries = [written, self._through_eog(written)]
                if content_at is not None and content_at > c:
                    tries += [turn[content_at:], self._through_eog(turn[content_at:])]
                for cand in tries:
                    start = full.find(cand, pos) if cand else -1
                    if start >= 0:
                        written = cand
                        break
                if start < 0:
                    raise TokenizerError(
                        f"message {i}: the chat template renders this assistant turn differently "
                        "once later messages follow, and the turn cannot be found in the full text"
                    )
            spans.append((start, start + len(written)))
            pos = start + len(written)
        if not prefix_stable:
            notes.append(
                "the template is not prefix-stable: earlier turns change when later ones follow"
            )
        return self._tokenize_spans(full, spans, prefix_stable, notes)

    def _through_eog(self, text: str) -> str:
        """`text` up to and including its first end-of-generation token text."""
        tok = self.tokenizer
        ends = [
            k + len(t)
            for t in (
                tok.token_to_piece(i, special=True).decode("utf-8", "replace") for i in tok.eot_ids
            )
            if t and (k := text.find(t)) >= 0
        ]
        return text[: min(ends)] if ends else ""

    def _content_start(self, msgs, i, turn, tools) -> int | None:
        """Where message i's content starts in `turn`, found with a sentinel content."""
        probe = [*msgs[:i], dict(msgs[i], content=_SENTINEL)]
        try:
            text = self.template.render(probe, tools=tools)
        except TokenizerError:
            return None
        at = text.find(_SENTINEL)
        return at if at >= 0 and text[:at] == turn[:at] else None

    def _tokenize_spans(
        self, full: str, spans, prefix_stable: bool, notes: list[str]
    ) -> EncodedConversation:
        tok = self.tokenizer
        text = self._strip_bos(full)
        shift = len(full) - len(text)
        pieces, trained, pos = [], [], 0
        for s, e in spans:
            s, e = max(s - shift, 0), e - shift
            if s > pos:
                pieces.append(text[pos:s])
                trained.append(False)
            pieces.append(text[s:e])
            trained.append(True)
            pos = e
        if pos < len(text):
            pieces.append(text[pos:])
            trained.append(False)
        ids: list[int] = []
        mask: list[int] = []
        if tok.add_bos and tok.bos_id >= 0:
            ids.append(tok.bos_id)
            mask.append(0)
        for piece_ids, is_trained in zip(tok.tokenize_pieces(pieces), trained, strict=True):
            ids += piece_ids
            mask += _turn_mask(tok, piece_ids, notes) if is_trained else [0] * len(piece_ids)
        whole = tok.tokenize(text, add_bos=True, parse_special=True)
        return EncodedConversation(ids, mask, text, prefix_stable, whole == ids, tuple(notes))


def _turn_mask(tok: Tokenizer, ids: list[int], notes: list[str]) -> list[int]:
    for k, t in enumerate(ids):
        if tok.is_eog(t):
            return [1] * (k + 1) + [0] * (len(ids) - k - 1)
    notes.append("an assistant turn has no end-of-generation token; all of it is trained")
    return [1] * len(ids)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


def _to_call(c: dict):
    from retrograd.tokenizer.toolcalls import ToolCall

    return ToolCall(c["function"]["name"], c["function"]["arguments"], c.get("id"))


def _plain(m: dict) -> dict[str, Any]:
    """A message without our record-only keys (raw, is_error), which templates do not know."""
    out = {k: v for k, v in m.items() if k not in ("raw", "is_error")}
    if m.get("raw"):
        out.pop("tool_calls", None)  # the raw content already holds the call markup
    return out


def encode_conversation(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    messages: list[dict],
    tools: list[dict] | None = None,
) -> EncodedConversation:
    """(ids, train_mask) of a validated conversation; see `ChatFormat.encode`."""
    return ChatFormat(tokenizer, template).encode(messages, tools)
