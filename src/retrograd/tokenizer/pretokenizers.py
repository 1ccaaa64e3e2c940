"""Pre-tokenizer regexes of llama.cpp's BPE vocabularies, keyed by its LLAMA_VOCAB_PRE_TYPE.

Copied from `llm_tokenizer_bpe` in llama.cpp's src/llama-vocab.cpp (the tree vendored in
llama-cpp-python 0.3.36). llama.cpp splits a text fragment with each regex of a list in turn,
keeping both the matches and the text between them; HF `tokenizers` does the same with one
`Split(..., behavior="isolated")` per regex. This module knows nothing about merges or ids.
A value that is a string names another pre-type whose regexes it shares.
"""

from __future__ import annotations

# fmt: off
_REGEXES: dict[str, tuple[str, ...] | str] = {
    'LLAMA3': (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    'JAIS2': (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)|\\s{64}(?!\\S)|\\s{32}(?!\\S)|\\s{16}(?!\\S)|\\s{8}(?!\\S)|\\s{4}(?!\\S)|\\s{1,2}(?!\\S)|\\s{1}",
    ),
    'DBRX': 'LLAMA3',
    'SMAUG': 'LLAMA3',
    'DEEPSEEK_LLM': (
        '[\r\n]',
        '\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+',
        '\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+',
        '\\s+$',
        '[一-龥ࠀ-一가-\ud7ff]+',
        '\\p{N}+',
    ),
    'DEEPSEEK3_LLM': (
        '\\p{N}{1,3}',
        '[一-龥\u3040-ゟ゠-ヿ]+',
        '[!"#$%&\'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+',
    ),
    'HUNYUAN_DENSE': 'DEEPSEEK3_LLM',
    'JOYAI_LLM': 'DEEPSEEK3_LLM',
    'HY_V4': 'DEEPSEEK3_LLM',
    'SPARK2_5': (
        '\\p{N}{1,3}',
        '[一-龥\u3040-ゟ゠-ヿ]+',
        '[!"#$%&\'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+',
        '\\p{N}',
    ),
    'YOUTU': (
        '[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥\u3040-ゟ゠-ヿ]+',
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    'DEEPSEEK_CODER': (
        '[\r\n]',
        '\\s?\\p{L}+',
        '\\s?\\p{P}+',
        '[一-龥ࠀ-一가-\ud7ff]+',
        '\\p{N}',
    ),
    'FALCON': (
        '[\\p{P}\\$\\+<=>\\^~\\|`]+',
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
        '[0-9][0-9][0-9]',
    ),
    'STARCODER': (
        '\\p{N}',
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    ),
    'REFACT': 'STARCODER',
    'COMMAND_R': 'STARCODER',
    'SMOLLM': 'STARCODER',
    'CODESHELL': 'STARCODER',
    'EXAONE': 'STARCODER',
    'MINERVA': 'STARCODER',
    'MELLUM2': 'STARCODER',
    'GPT2': (
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    ),
    'MPT': 'GPT2',
    'OLMO': 'GPT2',
    'JAIS': 'GPT2',
    'TRILLION': 'GPT2',
    'GRANITE_DOCLING': 'GPT2',
    'STABLELM2': (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    'QWEN2': 'STABLELM2',
    'HUNYUAN': 'STABLELM2',
    'SOLAR_OPEN': 'STABLELM2',
    'QWEN35': (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    'PORO': (
        ' ?[^(\\s|.,!?…。，、।۔،)]+',
    ),
    'BLOOM': 'PORO',
    'GPT3_FINNISH': 'PORO',
    'CHATGLM4': 'LLAMA3',
    'VIKING': (
        ' ?[^(\\s|.,!?…。，、।۔،)]+',
        '\\p{N}',
    ),
    'TEKKEN': (
        '[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
    ),
    'CHAMELEON': (
        '<sentinel:[0-9]+>',
        '(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z',
        '([\\t\\n]|    |  )',
        '\\p{N}',
        '[\\p{P}!-/:-@\\[-`{-~]',
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    ),
    'GPT4O': (
        "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    'MINIMAX_M2': 'GPT4O',
    'GRANITE_EMB_MULTI': (
        "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))*((?=[\\p{L}\\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))+((?=[\\p{L}\\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    'TINY_AYA': (
        '\\d{1,3}(?=(?:\\d{3})*\\b)',
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    'KIMI_K2': (
        '\\p{Han}+',
    ),
    'SUPERBPE': (
        '\\p{N}+',
        '(?=(\\d{3})+(?!\\d))',
    ),
    'BAILINGMOE': (
        "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
    ),
    'SEED_CODER': (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    'UFAKZEKA': (
        '[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
    ),
    'GROK_2': 'STABLELM2',
    'AFMOE': (
        '\\p{AFMoE_digits}',
        '[一-鿿㐀-䶿豈-\ufaff\u3040-ゟ゠-ヿ･-ﾟ⼀-\u2fdfเ-\u0e7f\u0e80-\u0effក-\u17ffက-႟ꩠ-ꩿꧠ-\ua9ff가-\ud7afᄀ-ᇿ]+',
        '[!"#$%&\'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
    ),
    'LAGUNA': (
        '[^\\n]+|[\\n]+',
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    'EXAONE_MOE': (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
    ),
    'GEMMA4': (
        '[^\\n]+|[\\n]+',
    ),
    'SARVAM_MOE': 'GEMMA4',
    'MINICPM5': (
        '\\p{N}{1,3}',
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    'WHITESPACE': (
        '\\S+',
    ),
    'DEFAULT': (
        '[\\p{P}\\$\\+<=>\\^~\\|]+',
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
        '\\p{N}+',
        '[0-9][0-9][0-9]',
    ),
}
# fmt: on


def regexes(pre_type: str) -> tuple[str, ...]:
    """The regex list of a pre-type, following shared entries."""
    value = _REGEXES[pre_type]
    return _REGEXES[value] if isinstance(value, str) else value  # type: ignore[return-value]


# Pre-types llama.cpp implements with hand-written code instead of a regex; HF's regex engine
# cannot reproduce them, so they are refused by name.
CUSTOM_PRE_TYPES = frozenset({"KIMI_K2", "AFMOE", "SUPERBPE", "WHITESPACE"})

# tokenizer.ggml.pre -> (pre-type, flags), from llama_vocab::impl::load. The flags override the
# BPE defaults: clean_spaces=True, ignore_merges=False, escape_whitespaces=False, and add_bos
# left to the metadata (False when absent).
_C = {"clean_spaces": False}
PRE_NAMES: dict[str, tuple[str, dict[str, bool]]] = {
    "default": ("DEFAULT", {}),
    "minicpm5": ("MINICPM5", {"ignore_merges": True}),
    **{
        n: ("LLAMA3", {"ignore_merges": True, "add_bos": True})
        for n in (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        )
    },
    "deepseek-llm": ("DEEPSEEK_LLM", _C),
    "deepseek-coder": ("DEEPSEEK_CODER", _C),
    "deepseek-v3": ("DEEPSEEK3_LLM", _C),
    "spark2_5": ("SPARK2_5", _C),
    "youtu": ("YOUTU", {"clean_spaces": False, "ignore_merges": True}),
    "falcon": ("FALCON", {}),
    "mpt": ("MPT", {}),
    "starcoder": ("STARCODER", {}),
    **{
        n: ("GPT2", {})
        for n in (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "exaone4",
        )
    },
    "jais-2": ("JAIS2", {}),
    "gemma4": ("GEMMA4", {"escape_whitespaces": True}),
    "granite-embed-multi-311m": ("GEMMA4", {"escape_whitespaces": True}),
    "sarvam-moe": ("SARVAM_MOE", {"escape_whitespaces": True, "clean_spaces": False}),
    **{n: ("GPT2", {"add_sep": True}) for n in ("jina-v1-en", "jina-v2-code", "roberta-bpe")},
    "whitespace": ("WHITESPACE", {}),
    "refact": ("REFACT", {}),
    "command-r": ("COMMAND_R", _C),
    **{n: ("QWEN2", _C) for n in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2")},
    "qwen35": ("QWEN35", _C),
    "stablelm2": ("STABLELM2", {}),
    "olmo": ("OLMO", {}),
    "dbrx": ("DBRX", {}),
    "smaug-bpe": ("SMAUG", {}),
    "poro-chat": ("PORO", _C),
    "chatglm-bpe": ("CHATGLM4", {"no_bos": True}),
    "glm4": ("CHATGLM4", {"no_bos": True, "ignore_merges": True}),
    "glm5": ("CHATGLM4", {"no_bos": True, "ignore_merges": True}),
    "viking": ("VIKING", _C),
    "jais": ("JAIS", {}),
    "tekken": ("TEKKEN", {"clean_spaces": False, "ignore_merges": True, "add_bos": True}),
    "smollm": ("SMOLLM", _C),
    "codeshell": ("CODESHELL", {}),
    "bloom": ("BLOOM", {}),
    "gpt3-finnish": ("GPT3_FINNISH", {}),
    "exaone": ("EXAONE", {}),
    "exaone-moe": ("EXAONE_MOE", {}),
    "chameleon": ("CHAMELEON", {"add_bos": True, "clean_spaces": False}),
    "minerva-7b": ("MINERVA", {}),
    "megrez": ("QWEN2", {}),
    **{n: ("GPT4O", _C) for n in ("gpt-4o", "llama4", "kanana2", "talkie")},
    "granite-embed-multi-97m": (
        "GRANITE_EMB_MULTI",
        {"clean_spaces": False, "ignore_merges": True},
    ),
    "tiny_aya": ("TINY_AYA", _C),
    "cohere2moe": ("TINY_AYA", _C),
    "superbpe": ("SUPERBPE", _C),
    "trillion": ("TRILLION", _C),
    "granite-docling": ("GRANITE_DOCLING", _C),
    **{n: ("BAILINGMOE", _C) for n in ("bailingmoe", "bailingmoe2", "llada-moe")},
    "seed-coder": ("SEED_CODER", _C),
    "hunyuan": ("HUNYUAN", _C),
    "hunyuan-dense": ("HUNYUAN_DENSE", _C),
    "hy_v4": ("HY_V4", _C),
    "joyai-llm": ("JOYAI_LLM", _C),
    "kimi-k2": ("KIMI_K2", _C),
    "ufakzeka": ("UFAKZEKA", _C),
    "grok-2": ("GROK_2", _C),
    "afmoe": ("AFMOE", _C),
    "laguna": ("LAGUNA", _C),
    "minimax-m2": ("MINIMAX_M2", _C),
    "solar-open": ("SOLAR_OPEN", _C),
    "mellum2": ("MELLUM2", {}),
}

# Pre-types whose words are raw UTF-8 with spaces escaped as U+2581 (no GPT-2 byte map).
RAW_UTF8_PRE_TYPES = frozenset({"GEMMA4", "SARVAM_MOE", "WHITESPACE"})
