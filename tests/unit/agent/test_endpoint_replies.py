"""The chat endpoint client of `collect --api` and `scenarios generate` against the scripted
OpenAI server: a reply past its cap fails the request, naming the cap, and is not asked again
(it had no size limit: 17 MiB were read and parsed)."""

from __future__ import annotations

import pytest

from retrograd.agent.endpoint import ChatEndpoint, EndpointError
from tests.factories.scripted_openai import reply, scripted_openai


def test_a_reply_past_the_cap_fails_naming_it():
    script = [reply("a" + " " * (17 << 20)), reply("fine")]
    with scripted_openai(script) as api:
        endpoint = ChatEndpoint(api.base_url, "m", "test-key", max_retries=2, backoff=0.01)
        with endpoint, pytest.raises(EndpointError, match=r"a reply over 16777216 bytes"):
            endpoint.complete([{"role": "user", "content": "hi"}])
        assert len(api.requests) == 1
        with ChatEndpoint(api.base_url, "m", "test-key") as again:
            assert again.complete([{"role": "user", "content": "hi"}])["content"] == "fine"
