"""Split raw text on special-token strings exactly as llama.cpp's `tokenizer_st_partition`.

llama.cpp takes the special tokens longest first and cuts every raw fragment at each
occurrence of the current one, honouring lstrip/rstrip attributes. Doing that literally costs
one scan of the text per special token (6,400 for Gemma). We scan once with a trie regex
(leftmost, longest at each position), which gives the same cuts unless an occurrence crosses
the end of an earlier match while being at least as long: such texts, and vocabularies with
strip attributes, take the literal port. This module knows nothing about how raw text becomes
ids.
"""

from __future__ import annotations

import re

# C's isspace() in the "C" locale: what llama.cpp strips next to lstrip/rstrip tokens.
_C_SPACE = " \t\n\v\f\r"

Fragment = str | int  # raw text, or a special token id


def trie_regex(words: list[str]) -> re.Pattern:
    """One regex matching any of `words`, preferring the longest at a position."""
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = True

    def build(node: dict) -> str:
        end = "" in node
        branches = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if end:  # a word ends here: try the longer ones first, then stop
            return "(?:" + body + ")?"
        return body

    # NOTE: deep recursion for long tokens; Python's limit (1000) is far above token lengths.
    return re.compile(build(trie), re.DOTALL)


class SpecialSplitter:
    """Cuts text into raw fragments and special token ids for one set of special tokens."""

    def __init__(self, ids: list[int], tokens: list[str], attrs: list[tuple[bool, bool]]):
        # `ids` longest first; `attrs[k]` is (lstrip, rstrip) of ids[k]
        self.ids = ids
        self.texts = [tokens[i] for i in ids]
        self.strip = attrs
        self.by_text = {}
        for i, t in zip(ids, self.texts, strict=True):
            self.by_text.setdefault(t, i)  # first in llama.cpp's order wins
        self.rank = {t: k for k, t in reversed(list(enumerate(self.texts)))}
        self.any_strip = any(lstrip or rstrip for lstrip, rstrip in attrs)
        self.pattern = trie_regex(list(self.by_text)) if ids else None

    def split(self, text: str) -> list[Fragment]:
        if self.pattern is None or not text:
            return [text] if text else []
        matches = [(m.start(), m.end()) for m in self.pattern.finditer(text)]
        if not matches:
            return [text]
        if self.any_strip or self._crossing(text, matches):
            return self._literal(text, self._candidates(text, matches))
        out: list[Fragment] = []
        pos = 0
        for s, e in matches:
            if s > pos:
                out.append(text[pos:s])
            out.append(self.by_text[text[s:e]])
            pos = e
        if pos < len(text):
            out.append(text[pos:])
        return out

    def _crossing(self, text: str, matches: list[tuple[int, int]]) -> bool:
        """Whether an occurrence starting inside a match outranks it (llama.cpp would cut it)."""
        match = self.pattern.match
        for s, e in matches:
            here = self.rank[text[s:e]]
            for p in range(s + 1, e):
                m = match(text, p)
                if m and m.end() > e and self.rank[m.group()] <= here:
                    return True
        return False

    def _candidates(self, text: str, matches: list[tuple[int, int]]) -> set[str]:
        """Every special text that occurs in `text` (a superset is fine)."""
        found = set()
        match = self.pattern.match
        for s, e in matches:
            found.add(text[s:e])
            for p in range(s + 1, e):
                m = match(text, p)
                if m:
                    found.add(m.group())
        return {w[:k] for w in found for k in range(1, len(w) + 1) if w[:k] in self.by_text}

    def _literal(self, text: str, candidates: set[str]) -> list[Fragment]:
        """The literal port of tokenizer_st_partition, over the tokens that occur."""
        frags: list[Fragment] = [text]
        for tid, tok, (lstrip, rstrip) in zip(self.ids, self.texts, self.strip, strict=True):
            if tok not in candidates:
                continue
            new: list[Fragment] = []
            for frag in frags:
                if isinstance(frag, int) or tok not in frag:
                    new.append(frag)
                    continue
                _cut(frag, tok, tid, lstrip, rstrip, new)
            frags = new
        return frags


def _cut(frag: str, tok: str, tid: int, lstrip: bool, rstrip: bool, out: list) -> None:
    start, end = 0, len(frag)
    while True:
        m = frag.find(tok, start, end)
        if m < 0:
            if start < end:
                out.append(frag[start:end])
            return
        left_end = m
        if lstrip:
            while left_end > start and frag[left_end - 1] in _C_SPACE:
                left_end -= 1
        if left_end > start:
            out.append(frag[start:left_end])
        out.append(tid)
        start = m + len(tok)
        if rstrip:
            while start < end and frag[start] in _C_SPACE:
                start += 1
