"""OpenAI's error document and model entry, without the rest of the protocol (no torch), so
that the run server can answer its OpenAI routes' errors and listings before loading a model."""

from __future__ import annotations


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


def model_entry(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "retrograd"}
