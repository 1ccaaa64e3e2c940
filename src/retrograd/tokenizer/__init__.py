"""Tokens identical to llama.cpp: vocabulary from GGUF metadata, chat templates, conversations
rendered to (ids, train mask), and tool-call formats."""

from retrograd.tokenizer.codec import Tokenizer, load_tokenizer
from retrograd.tokenizer.conversation import ChatFormat, EncodedConversation, encode_conversation
from retrograd.tokenizer.fallbacks import chat_template
from retrograd.tokenizer.records import validate_record
from retrograd.tokenizer.template import ChatTemplate, TemplateError
from retrograd.tokenizer.toolcalls import CallError, ParsedTurn, ToolCall

__all__ = [
    "CallError",
    "ChatFormat",
    "ChatTemplate",
    "EncodedConversation",
    "ParsedTurn",
    "TemplateError",
    "ToolCall",
    "Tokenizer",
    "chat_template",
    "encode_conversation",
    "load_tokenizer",
    "validate_record",
]
