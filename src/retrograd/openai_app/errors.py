"""OpenAI's error document and model entry, without the rest of the protocol (no torch), so
that the run server can answer its OpenAI routes' errors and listings before loading a model."""

from __future__ import annotations

from typing import Any

from retrograd.text import not_text_at


class ApiError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


def too_deep(limit: int, what: str = "the body") -> ApiError:
    """`what` nests arrays and objects deeper than nesting.py allows."""
    return ApiError(
        400, f"{what} nests arrays and objects deeper than {limit}", None, "invalid_json"
    )


def check_text(data: Any) -> None:
    """ApiError 400 naming the field of the first string in a parsed request that holds a lone
    surrogate (a `\\ud800` escape: JSON, but no template, tokenizer or answer takes it)."""
    where = not_text_at(data)
    if where is not None:
        place = ".".join(str(p) for p in where) or "body"
        message = f"{place}: holds a lone surrogate, which is not text"
        raise ApiError(400, message, str(where[0]) if where else None, "invalid_value")


def model_entry(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "retrograd"}
