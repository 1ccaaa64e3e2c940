"""The vocabulary of a GGUF file as llama.cpp reads it: tokens, attributes, special ids, flags.

A port of `llama_vocab::impl::load` (llama.cpp src/llama-vocab.cpp): default special ids per
tokenizer model, metadata overrides, the text-based detection of end-of-generation tokens and
the attribute fix-ups llama.cpp applies. It knows nothing about how text becomes ids; the
tokenizer builds on this record. Invariant: every field here equals what llama.cpp derives
from the same metadata, so `eog_ids`, `add_bos` and the special-token set match the server.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from retrograd.errors import UnsupportedError
from retrograd.tokenizer import pretokenizers

# llama_token_attr bits
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8

# llama_token_type (GGUF tokenizer.ggml.token_type) -> attribute
_TYPE_TO_ATTR = {
    0: ATTR_UNDEFINED,
    1: ATTR_NORMAL,
    2: ATTR_UNKNOWN,
    3: ATTR_CONTROL,
    4: ATTR_USER_DEFINED,
    5: ATTR_UNUSED,
    6: ATTR_BYTE,
}

NULL = -1
_K = "tokenizer.ggml."

# Texts llama.cpp treats as end of generation (llama_vocab::impl::load).
_EOG_TEXTS = frozenset(
    "<|eot_id|> <|im_end|> <|end|> <|return|> <|call|> <|flush|> <|calls|> <end_of_turn> "
    "<|endoftext|> </s> <|eom_id|> <EOT> _<EOT> [EOT] [EOS] <|end_of_text|> <end_of_utterance> "
    "<eos> <turn|> <|tool_response> <｜end▁of▁sentence｜> [e~[".split()
)
_EOT_TEXTS = frozenset(
    "<|eot_id|> <|im_end|> <|end|> <end_of_turn> <|endoftext|> <|end_of_text|> <EOT> _<EOT> "
    "[EOT] <｜end▁of▁sentence｜> <end_of_utterance>".split()
)
_FIM_TEXTS = {
    "fim_pad": frozenset({"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"}),
    "fim_rep": frozenset({"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"}),
    "fim_sep": frozenset({"<|file_sep|>"}),
}
_SPECIAL_KEYS = (
    "bos", "eos", "eot", "eom", "unknown", "seperator", "padding", "fim_pad", "fim_rep", "fim_sep",
)  # fmt: skip


@dataclass(frozen=True)
class Vocab:
    """What llama.cpp knows about a vocabulary after loading it.

    `kind` is "spm" (tokenizer model `llama`) or "bpe" (`gpt2`, `gemma4`); `pre_type` is the
    llama.cpp pre-tokenizer type (BPE only). Ids are -1 where the vocabulary has none.
    """

    model: str
    kind: str
    pre: str
    pre_type: str
    tokens: list[str]
    scores: np.ndarray  # (n_vocab,) float32
    attrs: np.ndarray  # (n_vocab,) int32, llama_token_attr bits
    merges: list[str]
    bos_id: int
    eos_id: int
    eot_id: int
    eom_id: int
    unk_id: int
    sep_id: int
    pad_id: int
    eog_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    clean_spaces: bool
    escape_whitespaces: bool
    ignore_merges: bool

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def special_ids(self, parse_special: bool) -> list[int]:
        """Ids split out of raw text before tokenization, longest text first (as llama.cpp).

        User-defined tokens are always split out; control and unknown tokens only when
        `parse_special` is set.
        """
        special = (self.attrs & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)) != 0
        if not parse_special:
            special &= (self.attrs & (ATTR_CONTROL | ATTR_UNKNOWN)) == 0
        ids = np.nonzero(special)[0].tolist()
        # NOTE: llama.cpp's std::sort is not stable; for equal lengths we keep id order.
        ids.sort(key=lambda i: -len(self.tokens[i].encode()))
        return ids


def load_vocab(metadata: dict, name: str = "GGUF") -> Vocab:
    """Build the Vocab of a GGUF's metadata; `name` (the file name) goes into error messages."""
    model = str(metadata.get(_K + "model", ""))
    if not model:
        raise UnsupportedError(f"{name}: no tokenizer (missing {_K}model)")
    tokens = metadata.get(_K + "tokens")
    if not isinstance(tokens, list) or not tokens:
        raise UnsupportedError(f"{name}: missing tokenizer vocabulary ({_K}tokens)")
    n = len(tokens)
    pre = str(metadata.get(_K + "pre", "") or "")
    flags = _model_flags(model, pre, name)
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    scores = _array(metadata, "scores", n, np.float32, 0.0)
    types = _array(metadata, "token_type", n, np.int32, 1)
    attrs = np.array([_TYPE_TO_ATTR.get(int(t), ATTR_UNDEFINED) for t in types], dtype=np.int32)
    merges = list(metadata.get(_K + "merges") or [])
    if flags["kind"] == "bpe" and not merges:
        raise UnsupportedError(f"{name}: BPE tokenizer {model!r} without {_K}merges")

    ids = _special_ids(metadata, flags, n)
    for key in ("add_bos", "add_eos", "add_space_prefix"):
        meta_key = {"add_bos": "add_bos_token", "add_eos": "add_eos_token"}.get(key, key)
        if _K + meta_key in metadata:
            flags[key] = bool(metadata[_K + meta_key])
    if flags["pre_type"] == "GEMMA4":
        flags["add_bos"] = True  # llama.cpp overrides it for Gemma 4

    text_to_id = {t: i for i, t in enumerate(tokens)}
    eog = _detect_eog(tokens, attrs, ids, text_to_id)
    _fix_attrs(metadata, tokens, attrs, text_to_id, eog)
    return Vocab(
        model=model,
        kind=flags["kind"],
        pre=pre,
        pre_type=flags["pre_type"],
        tokens=tokens,
        scores=scores,
        attrs=attrs,
        merges=merges,
        bos_id=ids["bos"],
        eos_id=ids["eos"],
        eot_id=ids["eot"],
        eom_id=ids["eom"],
        unk_id=ids["unknown"],
        sep_id=ids["seperator"],
        pad_id=ids["padding"],
        eog_ids=frozenset(eog),
        add_bos=flags["add_bos"],
        add_eos=flags["add_eos"],
        add_space_prefix=flags["add_space_prefix"],
        clean_spaces=flags["clean_spaces"],
        escape_whitespaces=flags["escape_whitespaces"],
        ignore_merges=flags["ignore_merges"],
    )


def _model_flags(model: str, pre: str, name: str) -> dict:
    """Vocabulary type, pre-tokenizer and default flags, as llama.cpp derives them."""
    if model == "llama":
        return dict(
            kind="spm", pre_type="DEFAULT", add_space_prefix=True, clean_spaces=False,
            add_bos=True, add_eos=False, escape_whitespaces=True, ignore_merges=False,
            defaults={"bos": 1, "eos": 2, "unknown": 0},
        )  # fmt: skip
    if model not in ("gpt2", "gemma4"):
        raise UnsupportedError(
            f"{name}: tokenizer model {model!r} is not supported "
            "(supported: 'llama' (SentencePiece), 'gpt2' (byte-level BPE), 'gemma4')"
        )
    if model == "gemma4":
        pre = "gemma4"
    if not pre:
        warnings.warn(
            f"{name}: no {_K}pre in the file; using llama.cpp's 'default' pre-tokenizer, as "
            "llama.cpp does (it warns that generation quality will be degraded)",
            stacklevel=3,
        )
        pre = "default"
    if pre not in pretokenizers.PRE_NAMES:
        raise UnsupportedError(f"{name}: pre-tokenizer {pre!r} ({_K}pre) is not known to llama.cpp")
    pre_type, overrides = pretokenizers.PRE_NAMES[pre]
    if pre_type in pretokenizers.CUSTOM_PRE_TYPES:
        raise UnsupportedError(
            f"{name}: pre-tokenizer {pre!r} is implemented by hand in llama.cpp and not supported"
        )
    flags = dict(
        kind="bpe", pre_type=pre_type, add_space_prefix=False, clean_spaces=True, add_bos=False,
        add_eos=False, escape_whitespaces=False, ignore_merges=False,
        defaults={"bos": 11, "eos": 11} if model == "gpt2" else {},
    )  # fmt: skip
    flags.update({k: v for k, v in overrides.items() if k not in ("no_bos", "add_sep")})
    if overrides.get("no_bos"):
        flags["defaults"] = {"eos": 11}
    return flags


def _array(metadata: dict, key: str, n: int, dtype, fill) -> np.ndarray:
    value = metadata.get(_K + key)
    if value is None:
        return np.full(n, fill, dtype=dtype)
    arr = np.asarray(value, dtype=dtype)
    if len(arr) < n:
        raise UnsupportedError(f"{_K}{key} has {len(arr)} entries for {n} tokens")
    return arr[:n]


def _special_ids(metadata: dict, flags: dict, n: int) -> dict[str, int]:
    ids = {k: NULL for k in _SPECIAL_KEYS}
    for key, default in flags["defaults"].items():
        ids[key] = default if 0 <= default < n else NULL
    for key in _SPECIAL_KEYS:
        value = metadata.get(f"{_K}{key}_token_id")
        if value is not None and 0 <= int(value) < n:
            ids[key] = int(value)
    return ids


def _detect_eog(tokens, attrs, ids, text_to_id) -> set[int]:
    """End-of-generation ids and the EOT/FIM ids llama.cpp finds by token text."""
    # NOTE: llama.cpp walks an unordered_map, so which of several EOT candidates it keeps as
    # `eot_id` is unspecified; every candidate is an EOG token either way.
    if ids["eot"] == NULL:
        found = sorted(text_to_id[t] for t in _EOT_TEXTS if t in text_to_id)
        if found:
            ids["eot"] = found[0]
            attrs[found[0]] |= ATTR_CONTROL
    for key, texts in _FIM_TEXTS.items():
        if ids[key] == NULL:
            found = sorted(text_to_id[t] for t in texts if t in text_to_id)
            if found:
                ids[key] = found[0]
                attrs[found[0]] |= ATTR_CONTROL
    for i, t in enumerate(tokens):
        if attrs[i] & ATTR_CONTROL and "unused" in t:
            attrs[i] |= ATTR_UNUSED
    eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if ids[k] != NULL}
    for t in _EOG_TEXTS:
        if t in text_to_id:
            eog.add(text_to_id[t])
            attrs[text_to_id[t]] |= ATTR_CONTROL
    for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
        if t in text_to_id:
            attrs[text_to_id[t]] = ATTR_USER_DEFINED
    eog |= {ids[k] for k in ("eos", "eot", "eom") if ids[k] != NULL}
    texts = {tokens[i]: i for i in eog}
    if "<|end|>" in texts and (
        ("<|return|>" in texts and "<|call|>" in texts)
        or ("<|calls|>" in texts and "<|flush|>" in texts)
    ):
        eog.discard(texts["<|end|>"])
        attrs[texts["<|end|>"]] = ATTR_USER_DEFINED
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(texts["</s>"])
        attrs[texts["</s>"]] = ATTR_NORMAL
    return eog


def _fix_attrs(metadata, tokens, attrs, text_to_id, eog) -> None:
    """Per-model lstrip/rstrip attributes llama.cpp sets by model name."""
    model_name = str(metadata.get("general.name", "")).lower()
    if "phi-3" in model_name or "phi3" in model_name:
        special = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
        attrs[(attrs & special) != 0] |= ATTR_RSTRIP
        if "</s>" in text_to_id:
            attrs[text_to_id["</s>"]] |= ATTR_RSTRIP
        for t in ("<unk>", "<s>", "<|endoftext|>"):
            if t in text_to_id:
                attrs[text_to_id[t]] &= ~ATTR_RSTRIP
