"""Tokens identical to llama.cpp: vocabulary from GGUF metadata, chat templates, conversations
rendered to (ids, train mask), and tool-call formats."""

from retrograd.tokenizer.codec import Tokenizer, load_tokenizer

__all__ = ["Tokenizer", "load_tokenizer"]
