"""HF `tokenizers` models that reproduce llama.cpp's SPM and BPE merge loops on raw fragments.

The Rust model sees only raw text between special tokens (special.py cuts those out first) and
returns ids; it knows nothing of BOS/EOS, special tokens or detokenization.

- SPM (`llama`): llama.cpp merges the adjacent pair whose joined text is a token with the
  highest score (ties: leftmost). A BPE model whose merge list holds every split (a, b) of
  every token, ranked by the token's score, makes the same choices when scores are distinct
  (they are in Llama 2, Mistral, Phi-3 and Gemma vocabularies). Pieces no merge reaches fall
  back to <0xXX> byte tokens, as in llama.cpp's resegment.
- BPE (`gpt2`): the GGUF's merges and the pre-tokenizer regexes llama.cpp uses for
  `tokenizer.ggml.pre`, then the GPT-2 byte map.
- Gemma 4 (`gemma4`): BPE on raw UTF-8 with spaces escaped as U+2581.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from retrograd.errors import UnsupportedError
from retrograd.tokenizer import pretokenizers
from retrograd.tokenizer.vocab import Vocab

SPACE = "\u2581"  # ▁, SentencePiece's escaped space


def build_backend(vocab: Vocab) -> Tokenizer:
    if vocab.kind == "spm":
        return _spm(vocab)
    return _bpe(vocab)


def _spm(vocab: Vocab) -> Tokenizer:
    tokens, scores = vocab.tokens, vocab.scores.tolist()
    ids = {t: i for i, t in enumerate(tokens)}
    merges = []
    for i, t in enumerate(tokens):
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in ids and b in ids:
                merges.append((-scores[i], i, k, a, b))
    merges.sort()
    model = models.BPE(
        vocab=ids, merges=[(a, b) for *_, a, b in merges], byte_fallback=True, fuse_unk=False
    )
    hf = Tokenizer(model)
    hf.normalizer = normalizers.Replace(" ", SPACE)
    # Cut before a run of ▁ wherever no token spans that boundary: the merge loop can never
    # join across it, and HF then encodes the words in parallel.
    before = sorted({t[k - 1] for t in tokens for k in _space_starts(t)})
    guard = "".join(_class_escape(c) for c in before + [SPACE])
    hf.pre_tokenizer = pre_tokenizers.Split(
        Regex(f"(?<![{guard}]){SPACE}"), behavior="merged_with_next"
    )
    return hf


def _space_starts(t: str) -> list[int]:
    """Positions in `t` where a ▁ follows another character than ▁."""
    if SPACE not in t[1:]:
        return []
    return [k for k in range(1, len(t)) if t[k] == SPACE and t[k - 1] != SPACE]


def _class_escape(c: str) -> str:
    return "\\" + c if c in "\\]^-[" else c


def _bpe(vocab: Vocab) -> Tokenizer:
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    merges = []
    for m in vocab.merges:
        pos = m.find(" ", 1)
        if pos < 0:
            continue
        a, b = m[:pos], m[pos + 1 :]
        # NOTE: llama.cpp would apply a merge whose result is not a token and then emit the
        # piece as bytes; HF cannot hold such merges. Converted vocabularies have none.
        if a in ids and b in ids and a + b in ids:
            merges.append((a, b))
    raw_utf8 = vocab.pre_type in pretokenizers.RAW_UTF8_PRE_TYPES
    model = models.BPE(
        vocab=ids, merges=merges, ignore_merges=vocab.ignore_merges, byte_fallback=raw_utf8
    )
    hf = Tokenizer(model)
    try:
        splits = [
            pre_tokenizers.Split(Regex(rx), behavior="isolated")
            for rx in pretokenizers.regexes(vocab.pre_type)
        ]
    except Exception as e:  # the regex engine refuses a construct
        raise UnsupportedError(
            f"pre-tokenizer {vocab.pre!r}: its regex cannot be compiled here: {e}"
        ) from None
    if raw_utf8:
        hf.normalizer = normalizers.Replace(" ", SPACE)
        hf.pre_tokenizer = pre_tokenizers.Sequence(splits)
    else:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        hf.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
        hf.decoder = decoders.ByteLevel()
    return hf
