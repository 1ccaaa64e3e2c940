"""A small OpenAI-compatible chat completions client (httpx), for `collect --api` and
`scenarios generate`: one POST /chat/completions per call, retried with backoff on transient
failures (a lost connection, a timeout, 408, 429 and 5xx); a reply over 16 MiB is read no
further and fails at once (replies.py). Knows the wire format, not what the answers mean.
The API key is read from the environment variable the run file names, once, before any
request; the key itself never goes in a file.
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx

from retrograd import nesting
from retrograd.errors import ConfigError, RetrogradError
from retrograd.replies import ReplyTooLarge, cap_replies

TRANSIENT = (408, 409, 429)
REPLY_BYTES = 16 << 20  # the most one reply may hold: past it the request fails, not retried


class EndpointError(RetrogradError):
    """The endpoint refused a request, or kept failing after its retries."""


def api_key(variable: str, where: str) -> str:
    """The key in $variable; ConfigError naming the table when it is unset or empty."""
    key = os.environ.get(variable, "")
    if not key:
        raise ConfigError(
            f"{where}.api_key_env = {variable}: the environment variable is not set "
            f"(export {variable}=... before running; the key never goes in the file)"
        )
    return key


class ChatEndpoint:
    """POST {base_url}/chat/completions with `model` and the given body keys."""

    def __init__(
        self,
        base_url: str,
        model: str,
        key: str,
        timeout: float = 120.0,
        max_retries: int = 0,
        backoff: float = 1.0,
        where: str = "endpoint",
    ):
        self.base_url, self.model, self.where = base_url.rstrip("/"), model, where
        self.max_retries, self.backoff = max_retries, backoff
        self.client = cap_replies(
            httpx.Client(
                base_url=self.base_url,
                timeout=timeout,
                headers={"Authorization": f"Bearer {key}"},
            ),
            REPLY_BYTES,
            where,
        )

    def complete(self, messages: list[dict], **params: Any) -> dict:
        """The first choice's message ({"role", "content", "tool_calls"?}) plus the response's
        `usage` under "_usage"; parameters that are None are not sent."""
        body = {"model": self.model, "messages": messages}
        body.update({k: v for k, v in params.items() if v is not None})
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                reply = self.client.post("/chat/completions", json=body)
            except httpx.TransportError as e:  # connection refused or lost, timeouts
                last = f"{type(e).__name__}: {e}"
                continue
            except ReplyTooLarge as e:  # asked again, it would read as much
                raise EndpointError(f"{e} from {self.base_url}") from None
            if reply.status_code in TRANSIENT or reply.status_code >= 500:
                last = f"HTTP {reply.status_code}: {reply.text[:300]}"
                continue
            if reply.status_code >= 400:
                raise EndpointError(
                    f"{self.where}: {self.base_url} refused the request "
                    f"(HTTP {reply.status_code}): {reply.text[:500]}"
                )
            return self._message(reply)
        tries = self.max_retries + 1
        raise EndpointError(
            f"{self.where}: {self.base_url} failed {tries} time{'s' * (tries > 1)}; last: {last}"
        )

    def _message(self, reply: httpx.Response) -> dict:
        try:
            data = nesting.loads(reply.content)  # nested too deep: TooDeep, a ValueError
            message = dict(data["choices"][0]["message"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise EndpointError(
                f"{self.where}: {self.base_url} answered something that is not a chat "
                f"completion: {reply.text[:300]}"
            ) from None
        message["_usage"] = data.get("usage") or {}
        return message

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> ChatEndpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
