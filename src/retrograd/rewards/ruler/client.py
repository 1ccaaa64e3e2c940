"""The judge's HTTP side: one OpenAI-compatible endpoint, spoken to with the official SDK.

`complete_json` asks for one JSON object: the first attempt with a strict JSON-schema response
format, retries with plain `json_object` (endpoints that refuse or botch strict schemas still
answer), each retry after 0.1 * 2**attempt seconds. Timeouts, lost connections, 5xx, 408, 429,
replies that hold no JSON (or JSON nested deeper than nesting.py allows, in the verdict or
the HTTP body around it) and replies `validate` refuses are retried; a reply over REPLY_BYTES
(16 MiB) fails the call at once, naming the limit (replies.py); any other 4xx (a bad key,
an unknown model) is not, since asking again cannot help. An endpoint that refuses response
formats with a 400 (`retrograd serve` does) is asked again without them, from then on: the
prompt spells out the schema itself, and the schema goes as vLLM's `guided_json` extension
(which `retrograd serve` follows with constrained decoding) unless that is refused too. When the tries run out it raises JudgeError.
`complete_text` asks for prose at temperature 0 (compaction summaries).

The client knows nothing about rubrics, strategies or what a verdict means: `validate` turns a
reply object into the caller's value, or raises ValueError.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import openai

from retrograd import nesting
from retrograd.errors import JudgeError
from retrograd.replies import ReplyTooLarge, cap_replies
from retrograd.rewards.ruler.cache import JudgeCache, cache_key
from retrograd.rewards.ruler.prompt import extract_json
from retrograd.text import as_text

T = TypeVar("T")
BACKOFF_SECS = 0.1
REPLY_BYTES = 16 << 20  # the most one reply may hold: past it the call fails, not retried


@dataclass
class ClientStats:
    """Counters since the last `take`: HTTP requests sent, retries, their latency, cache hits."""

    requests: int = 0
    retries: int = 0
    latency_ms_total: float = 0.0
    cache_hits: int = 0


class Refused(Exception):
    """A reply that asking again cannot fix (a 4xx other than 408 and 429)."""


class JudgeClient:
    """One judge endpoint and model; at most `max_concurrency` requests in flight."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str,
        temperature: float | None = None,
        max_concurrency: int = 4,
        timeout: float = 120.0,
        max_retries: int = 2,
        cache: JudgeCache | None = None,
        where: str = "[grpo.judge]",
        key_hint: str = "",
    ) -> None:
        self.base_url, self.model, self.api_key = base_url, model, api_key
        self.temperature = temperature
        self.max_concurrency = max_concurrency
        self.timeout = timeout
        self.max_retries = max_retries
        self.cache = cache
        self.where = where
        self.key_hint = key_hint  # added to a 401: where the key came from
        self.stats = ClientStats()
        self.plain = False  # set when the endpoint refuses response formats
        self.guided = True  # in plain mode: send the schema as guided_json until refused
        self._loop: asyncio.AbstractEventLoop | None = None

    def _bind(self) -> tuple[openai.AsyncOpenAI, asyncio.Semaphore]:
        # NOTE: the SDK's connection pool and the semaphore belong to one event loop; a sync
        # caller runs one loop per group, so both are made again when the loop changes.
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop = loop
            self._api = openai.AsyncOpenAI(
                base_url=self.base_url,
                api_key=self.api_key,
                timeout=self.timeout,
                max_retries=0,  # our own retries: they switch the response format
                http_client=cap_replies(
                    openai.DefaultAsyncHttpxClient(timeout=self.timeout), REPLY_BYTES, self.where
                ),
            )
            self._gate = asyncio.Semaphore(self.max_concurrency)
        return self._api, self._gate

    async def complete_json(
        self,
        prompt: str,
        schema_name: str,
        schema: dict,
        validate: Callable[[dict], T],
        guided: dict | None = None,
    ) -> T:
        """The validated verdict of one prompt, from the cache when it holds one. `guided`: the
        schema sent as guided_json (default `schema`), tighter where a grammar can say more.
        A lone surrogate of a trajectory reaches the judge as U+FFFD (no request carries one)."""
        prompt = as_text(prompt)
        key = cache_key(self.model, prompt)
        row = self.cache.get(key) if self.cache else None
        if row is not None and "scores" in row:
            try:
                value = validate(row["scores"])
            except ValueError:
                pass  # a row this prompt's validation refuses: ask the judge again
            else:
                self.stats.cache_hits += 1
                return value

        strict = {
            "type": "json_schema",
            "json_schema": {"name": schema_name, "strict": True, "schema": schema},
        }

        def accept(text: str) -> tuple[dict, T]:
            obj = extract_json(text)
            return obj, validate(obj)

        obj, value = await self._ask(
            prompt, self.temperature, accept, strict, {"type": "json_object"}, guided or schema
        )
        if self.cache is not None:
            self.cache.put(key, scores=obj)
        return value

    async def complete_text(self, prompt: str) -> str:
        """A prose answer at temperature 0 (a compaction summary), from the cache when it can."""
        prompt = as_text(prompt)
        key = cache_key(self.model, prompt)
        row = self.cache.get(key) if self.cache else None
        if row is not None and isinstance(row.get("text"), str):
            self.stats.cache_hits += 1
            return row["text"]

        def accept(text: str) -> tuple[str, str]:
            if not text.strip():
                raise ValueError("an empty reply")
            return text, text

        text, _ = await self._ask(prompt, 0.0, accept, None, None)
        if self.cache is not None:
            self.cache.put(key, text=text)
        return text

    async def _ask(
        self,
        prompt: str,
        temperature: float | None,
        accept: Callable[[str], tuple[Any, Any]],
        first_format: dict | None,
        retry_format: dict | None,
        schema: dict | None = None,
    ) -> tuple[Any, Any]:
        api, gate = self._bind()
        failures: list[str] = []
        attempt = 0
        while attempt <= self.max_retries:
            if attempt:
                self.stats.retries += 1
                await asyncio.sleep(BACKOFF_SECS * 2 ** (attempt - 1))

            def build(attempt: int = attempt) -> dict[str, Any]:
                # NOTE: built once a place is free: requests queued behind max_concurrency
                # learn from the first refusal instead of each being refused in turn
                request: dict[str, Any] = {
                    "model": self.model,
                    "messages": [{"role": "user", "content": prompt}],
                }
                response_format = first_format if attempt == 0 else retry_format
                if response_format is not None and not self.plain:
                    request["response_format"] = response_format
                elif schema is not None and self.plain and self.guided:
                    request["extra_body"] = {"guided_json": schema}
                if temperature is not None:
                    request["temperature"] = temperature
                return request

            request: dict[str, Any] = {}
            try:
                text = await self._post(api, gate, build, request)
                return accept(text)
            except Refused as e:
                if "response_format" in request and _refuses_field(e.__cause__, "response_format"):
                    # The prompt itself asks for the schema: go on without response formats
                    # (as `retrograd serve` and other plain endpoints need), not counted a try.
                    self.plain = True
                    continue
                if "extra_body" in request and _refuses_field(e.__cause__, "guided_json"):
                    self.guided = False  # nor guided_json: the prompt alone asks
                    continue
                failures.append(str(e))
                break
            except ReplyTooLarge as e:  # asked again, it would read as much
                raise JudgeError(f"{e} from judge {self.model!r} at {self.base_url}") from None
            except (openai.APIConnectionError, openai.APIStatusError, ValueError) as e:
                if isinstance(e.__cause__, ReplyTooLarge):
                    raise JudgeError(f"{e.__cause__} from judge {self.model!r}") from None
                failures.append(_describe(e))
            attempt += 1
        raise JudgeError(
            f"{self.where}: judge {self.model!r} at {self.base_url} gave no valid reply in "
            f"{len(failures)} attempt(s): " + "; ".join(failures)
        )

    async def _post(
        self,
        api: openai.AsyncOpenAI,
        gate: asyncio.Semaphore,
        build: Callable[[], dict[str, Any]],
        sent: dict[str, Any],
    ) -> str:
        """Post the request `build` makes once a place is free; `sent` receives it."""
        async with gate:
            request = build()
            sent.update(request)
            start = time.perf_counter()
            self.stats.requests += 1
            try:
                raw = await api.chat.completions.with_raw_response.create(**request)
            except openai.APIStatusError as e:
                if e.status_code < 500 and e.status_code not in (408, 429):
                    hint = self.key_hint if e.status_code == 401 else ""
                    raise Refused(_describe(e) + hint) from e
                raise
            finally:
                self.stats.latency_ms_total += (time.perf_counter() - start) * 1000
        nesting.check_json(raw.text)  # TooDeep (a ValueError): the SDK's parse recurses
        response = raw.parse()
        content = response.choices[0].message.content if response.choices else None
        if not content:
            raise ValueError("a reply without content")
        return content

    async def aclose(self) -> None:
        """Close the connections of the current event loop; the next request opens new ones."""
        if self._loop is not None:
            self._loop = None
            await self._api.close()

    def take_stats(self) -> ClientStats:
        """The counters so far, reset for the next update."""
        stats, self.stats = self.stats, ClientStats()
        return stats


def _refuses_field(error: BaseException | None, field: str) -> bool:
    """A 400 that names `field`."""
    if not isinstance(error, openai.APIStatusError) or error.status_code != 400:
        return False
    return getattr(error, "param", None) == field or field in str(error.message)


def _describe(error: Exception) -> str:
    if isinstance(error, openai.APITimeoutError):
        return "timed out"
    if isinstance(error, openai.APIStatusError):
        return f"HTTP {error.status_code}: {error.message}"
    if isinstance(error, openai.APIConnectionError):
        return f"connection failed: {error}"
    return f"bad reply: {error}"
