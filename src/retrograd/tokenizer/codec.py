"""Text <-> ids with llama.cpp's conventions: `Tokenizer` and `load_tokenizer`.

`tokenize` follows `llama_tokenize(text, add_special, parse_special)`: special strings are cut
out first (user-defined tokens always, control tokens only with `parse_special`), SPM
fragments get the space prefix after BOS or a special token, and BOS/EOS are added as the
vocabulary asks. `detokenize` follows `llama_detokenize(ids, remove_special, unparse_special)`
and `token_to_piece` follows `llama_token_to_piece(id, lstrip=0, special)`. Nothing here knows
about chat templates.
"""

from __future__ import annotations

import re
from pathlib import Path

from retrograd.errors import TokenizerError
from retrograd.tokenizer.backend import SPACE, build_backend
from retrograd.tokenizer.special import Fragment, SpecialSplitter
from retrograd.tokenizer.vocab import (
    ATTR_BYTE,
    ATTR_CONTROL,
    ATTR_LSTRIP,
    ATTR_NORMAL,
    ATTR_RSTRIP,
    ATTR_UNKNOWN,
    ATTR_USER_DEFINED,
    Vocab,
    load_vocab,
)

_HIDDEN = ATTR_UNKNOWN | ATTR_CONTROL  # pieces shown only with special=True
_NEWLINE_RUNS = re.compile(r"(\n+)")


def _gpt2_unbytes() -> dict[str, int]:
    """The inverse of GPT-2's byte -> printable character map (llama.cpp unicode_utf8_to_byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class Tokenizer:
    """A GGUF vocabulary that turns text into the ids llama.cpp produces, and back."""

    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self._hf = build_backend(vocab)
        self._pieces = self._build_pieces()
        attrs = vocab.attrs.tolist()
        self._hidden = [bool(a & _HIDDEN) for a in attrs]
        self._splitters = {}
        for parse_special in (False, True):
            ids = vocab.special_ids(parse_special)
            strip = [(bool(attrs[i] & ATTR_LSTRIP), bool(attrs[i] & ATTR_RSTRIP)) for i in ids]
            self._splitters[parse_special] = SpecialSplitter(ids, vocab.tokens, strip)
        self._text_to_id = None

    @classmethod
    def from_gguf(cls, gguf) -> Tokenizer:
        """Build from an opened `retrograd.gguf.GGUFFile` (a model or a vocab-only file)."""
        return cls(load_vocab(gguf.metadata, gguf.path.name))

    # -- properties ------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return self.vocab.n_vocab

    @property
    def bos_id(self) -> int:
        """BOS id, -1 when the vocabulary has none."""
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int:
        return self.vocab.eos_id

    @property
    def eot_ids(self) -> frozenset[int]:
        """Every id that ends generation (llama.cpp's EOG set: EOS, EOT, EOM, <|im_end|>...)."""
        return self.vocab.eog_ids

    @property
    def add_bos(self) -> bool:
        """Whether `tokenize(..., add_bos=True)` prepends BOS (the vocabulary's add_bos)."""
        return self.vocab.add_bos

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.vocab.eog_ids

    def token_id(self, text: str) -> int | None:
        """The id whose token text is exactly `text` (for example "<end_of_turn>"), or None."""
        if self._text_to_id is None:
            self._text_to_id = {t: i for i, t in enumerate(self.vocab.tokens)}
        return self._text_to_id.get(text)

    # -- text -> ids -----------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool = True, parse_special: bool = False) -> list[int]:
        """Ids of `text`, as `llama_tokenize(text, add_special=add_bos, parse_special)`.

        `add_bos` adds the BOS (and EOS) the vocabulary asks for; a vocabulary whose
        add_bos_token is false gets none. `parse_special` turns control-token strings such
        as "<start_of_turn>" into their ids; without it they are tokenized as plain text.
        User-defined tokens are always recognized, as in llama.cpp.
        """
        v = self.vocab
        out = []
        if add_bos and v.add_bos:
            if v.bos_id < 0:
                raise TokenizerError("the vocabulary asks for BOS but has no BOS token")
            out.append(v.bos_id)
        out += self.tokenize_pieces([text], parse_special)[0]
        if add_bos and v.add_eos and v.eos_id >= 0:
            out.append(v.eos_id)
        return out

    def tokenize_batch(
        self, texts: list[str], add_bos: bool = True, parse_special: bool = False
    ) -> list[list[int]]:
        """`tokenize` of each text; the raw fragments of all texts go to HF in one parallel batch."""
        v = self.vocab
        bos = [v.bos_id] if add_bos and v.add_bos else []
        eos = [v.eos_id] if add_bos and v.add_eos and v.eos_id >= 0 else []
        if bos and v.bos_id < 0:
            raise TokenizerError("the vocabulary asks for BOS but has no BOS token")
        return [
            bos + ids + eos for ids in self.tokenize_pieces(texts, parse_special, independent=True)
        ]

    def tokenize_pieces(
        self, pieces: list[str], parse_special: bool = True, independent: bool = False
    ) -> list[list[int]]:
        """Ids of consecutive pieces of one text, each tokenized on its own (no BOS/EOS).

        A piece boundary is a merge boundary: this is how a prompt and the tokens a model
        generates after it line up. The SPM space prefix goes only where llama.cpp puts it
        in the whole text: at the start, and after a special token.
        """
        v = self.vocab
        prefix = v.add_space_prefix and v.kind == "spm"
        splitter = self._splitters[parse_special]
        frags_per_piece = [splitter.split(p) for p in pieces]
        raws = []
        prev_special = True
        for frags in frags_per_piece:
            prev_special = prev_special or independent  # each text of a batch starts fresh
            for f in frags:
                if isinstance(f, str):
                    raws.append(" " + f if prefix and prev_special else f)
                prev_special = not isinstance(f, str)
        encoded = iter(self._encode_raw(raws))
        out = []
        for frags in frags_per_piece:
            ids = []
            for f in frags:
                ids.extend(next(encoded) if isinstance(f, str) else [f])
            out.append(ids)
        return out

    def split_special(self, text: str, parse_special: bool = True) -> list[Fragment]:
        """`text` cut into raw strings and special token ids, as llama.cpp cuts it."""
        return self._splitters[parse_special].split(text)

    def _encode_raw(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        if self.vocab.pre_type == "GEMMA4":
            return [self._encode_gemma4(t) for t in texts]
        return [e.ids for e in self._hf.encode_batch_fast(texts, add_special_tokens=False)]

    def _encode_gemma4(self, text: str) -> list[int]:
        # llama.cpp emits a run of newlines as one token when the run is a token (PR 21343)
        words = [w for w in _NEWLINE_RUNS.split(text) if w]
        out = []
        rest = [w for w in words if w[0] != "\n" or self.token_id(w) is None]
        encoded = iter(self._hf.encode_batch_fast(rest, add_special_tokens=False))
        for w in words:
            tid = self.token_id(w) if w[0] == "\n" else None
            out.extend([tid] if tid is not None else next(encoded).ids)
        return out

    # -- ids -> text -----------------------------------------------------------------------

    def _build_pieces(self) -> list[bytes]:
        """Each token's piece with special=True (llama.cpp's token_to_piece cache)."""
        v = self.vocab
        unbytes = _gpt2_unbytes() if v.kind == "bpe" and not v.escape_whitespaces else None
        pieces = []
        for text, attr in zip(v.tokens, v.attrs.tolist(), strict=True):
            if attr & (_HIDDEN | ATTR_USER_DEFINED):
                pieces.append(text.encode())
            elif attr & ATTR_NORMAL:
                if unbytes is None:
                    pieces.append(text.replace(SPACE, " ").encode())
                else:
                    pieces.append(_decode_bytes(text, unbytes))
            elif attr & ATTR_BYTE:
                pieces.append(bytes([int(text[3:5], 16)]))
            else:
                pieces.append(b"")
        return pieces

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes of one token (may be part of a UTF-8 character).

        With `special=False`, control and unknown tokens give b"" (llama.cpp's convention).
        """
        if not 0 <= token_id < self.n_vocab:
            raise TokenizerError(
                f"token id {token_id} is outside the vocabulary (0..{self.n_vocab - 1})"
            )
        if not special and self._hidden[token_id]:
            return b""
        return self._pieces[token_id]

    def detokenize_bytes(
        self, ids: list[int], special: bool = False, remove_special: bool = False
    ) -> bytes:
        """`llama_detokenize(ids, remove_special, unparse_special=special)` as bytes."""
        v = self.vocab
        ids = list(ids)
        remove_space = v.add_space_prefix
        if remove_special and v.add_bos and ids and ids[0] == v.bos_id:
            remove_space = False
            ids = ids[1:]
        if remove_special and v.add_eos and ids and ids[-1] == v.eos_id:
            ids = ids[:-1]
        parts = [self.token_to_piece(i, special) for i in ids]
        if remove_space and parts and parts[0][:1] == b" ":
            parts[0] = parts[0][1:]
        out = b"".join(parts)
        return _clean_spaces(out) if v.clean_spaces else out

    def detokenize(
        self, ids: list[int], special: bool = False, remove_special: bool = False
    ) -> str:
        """Text of `ids` as llama.cpp's `common_detokenize(ids, special)`.

        Control tokens are hidden unless `special`; SPM vocabularies with a space prefix
        lose the leading space of the first piece; `remove_special` drops a leading BOS and
        trailing EOS the vocabulary adds. Invalid UTF-8 becomes U+FFFD.
        """
        return self.detokenize_bytes(ids, special, remove_special).decode("utf-8", "replace")


def _decode_bytes(text: str, unbytes: dict[str, int]) -> bytes:
    try:
        return bytes(unbytes[c] for c in text)
    except KeyError:
        # llama_decode_text: characters outside the byte map become a marker
        out = bytearray()
        for c in text:
            if c in unbytes:
                out.append(unbytes[c])
            else:
                hexed = "".join(f"{b:02x}" for b in c.encode())
                out += f"[UNK_BYTE_0x{hexed}{text}]".encode()
        return bytes(out)


def _clean_spaces(text: bytes) -> bytes:
    """llama.cpp's clean_spaces passes over detokenized BPE text."""
    if not text:
        return text
    text = _pass1(text)  # " ?", " !", " .", " ," lose the space
    text = _pass2(text)
    return _pass3(text)


def _pass1(t: bytes) -> bytes:
    out = bytearray(t[:1])
    for i in range(1, len(t)):
        x = t[i]
        if t[i - 1] == 0x20 and x in b"?!.,":
            out.pop()
        out.append(x)
    return bytes(out)


def _pass2(t: bytes) -> bytes:
    # " ' " -> "'" (both spaces around a lone apostrophe go)
    out = bytearray(t[:1])
    buf = bytearray(t)
    i = 1
    n = len(buf)
    while i < n:
        x = buf[i]
        if x == 0x27 and i + 1 < n and buf[i - 1] == 0x20 and buf[i + 1] == 0x20:
            out.pop()
            i += 1
            buf[i] = 0
            out.append(x)
            # the C code writes x, then skips the next byte (the space it zeroed)
            i += 1
            continue
        out.append(x)
        i += 1
    return bytes(out)


def _pass3(t: bytes) -> bytes:
    # " 's", " 'm", " 're", " 've" lose the space
    out = bytearray(t[:1])
    n = len(t)
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = t[i + 1]
            if x1 in b"sm":
                out.pop()
            elif x1 not in b"td" and i + 2 < n:
                x2 = t[i + 2]
                if (x1, x2) in ((ord("r"), ord("e")), (ord("v"), ord("e"))):
                    out.pop()
        out.append(x)
    return bytes(out)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer from any GGUF with a vocabulary, including llama.cpp's vocab-only files."""
    from retrograd.gguf import GGUFFile

    return Tokenizer.from_gguf(GGUFFile(path))
