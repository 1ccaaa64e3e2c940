"""The judge client against a real HTTP server speaking the OpenAI API (the scripted one), with
the official SDK on our side: response formats, retries, backoff, refusals and the cache."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from retrograd.errors import JudgeError
from retrograd.rewards.ruler.cache import JudgeCache, cache_key
from retrograd.rewards.ruler.client import JudgeClient
from tests.factories.scripted_openai import delay, raw, reply, scripted_openai, status

SCHEMA = {
    "type": "object",
    "properties": {"winner": {"type": "string", "enum": ["a", "b", "tie"]}},
    "required": ["winner"],
    "additionalProperties": False,
}
GOOD = '{"winner": "b", "explanation": "b finished"}'


def winner(obj: dict) -> str:
    if obj.get("winner") not in ("a", "b", "tie"):
        raise ValueError(f"winner {obj.get('winner')!r}")
    return obj["winner"]


def client(api, **kw) -> JudgeClient:
    kw.setdefault("max_retries", 2)
    return JudgeClient(api.base_url, "judge-model", kw.pop("key", "test-key"), **kw)


def ask(judge: JudgeClient, prompt: str = "which?"):
    async def once():
        try:
            return await judge.complete_json(prompt, "ruler_pair", SCHEMA, winner)
        finally:
            await judge.aclose()

    return asyncio.run(once())


def test_strict_schema_first_then_json_object_with_prose_and_fences():
    script = [reply("I think b."), reply(f"Verdict:\n```json\n{GOOD}\n```\nDone.")]
    with scripted_openai(script) as api:
        judge = client(api, temperature=0.3)
        assert ask(judge) == "b"
    first, second = api.requests
    assert first["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "ruler_pair", "strict": True, "schema": SCHEMA},
    }
    assert second["response_format"] == {"type": "json_object"}
    assert first["messages"] == [{"role": "user", "content": "which?"}]
    assert first["model"] == "judge-model" and first["temperature"] == 0.3
    assert (judge.stats.requests, judge.stats.retries) == (2, 1)


def test_no_temperature_key_when_left_to_the_endpoint():
    with scripted_openai([reply(GOOD)]) as api:
        assert ask(client(api)) == "b"
    assert "temperature" not in api.requests[0]


def test_timeouts_5xx_429_and_refused_verdicts_are_retried_after_backoff():
    script = [status(503), delay(3.0, reply(GOOD)), status(429), reply('{"winner": "c"}')]
    script.append(reply(GOOD))
    with scripted_openai(script) as api:
        judge = client(api, timeout=0.5, max_retries=4)
        start = time.monotonic()
        assert ask(judge) == "b"
        elapsed = time.monotonic() - start
    assert len(api.requests) == 5 and judge.stats.retries == 4
    # backoff 0.1 + 0.2 + 0.4 + 0.8 seconds, plus one 0.5 s timeout
    assert elapsed >= 1.5 + 0.5


def test_out_of_tries_raises_judge_error():
    with scripted_openai([status(500), reply("{not json"), reply('{"winner": 1}')]) as api:
        judge = client(api, max_retries=2)
        with pytest.raises(JudgeError, match=r"3 attempt\(s\): HTTP 500.*bad reply.*bad reply"):
            ask(judge)
    assert len(api.requests) == 3


def test_a_judge_nesting_its_reply_too_deep_is_a_judge_error_not_a_crash():
    # the verdict's text, and the HTTP body around it: both are the judge's to write
    deep = "[" * 100_000 + "]" * 100_000
    body = '{"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": '
    script = [reply('{"winner": ' + deep + "}"), raw(body + deep + "}"), reply(GOOD)]
    with scripted_openai(script) as api:
        judge = client(api, max_retries=1)
        with pytest.raises(JudgeError) as caught:
            ask(judge)
        assert str(caught.value).count("nested more than 64 levels deep") == 2, caught.value
        assert ask(client(api)) == "b"  # the same client code, a sane reply


@pytest.mark.parametrize("code", [400, 404, 422])
def test_client_errors_are_not_retried(code):
    with scripted_openai([status(code, "no such model"), reply(GOOD)]) as api:
        judge = client(api)
        with pytest.raises(JudgeError, match=f"1 attempt\\(s\\): HTTP {code}"):
            ask(judge)
    assert len(api.requests) == 1 and judge.stats.retries == 0


def test_a_bad_key_is_not_retried():
    with scripted_openai([reply(GOOD)]) as api:
        judge = client(api, key="wrong")
        with pytest.raises(JudgeError, match="HTTP 401"):
            ask(judge)
    assert judge.stats.requests == 1 and len(api.script) == 1  # 401 before the script


def test_concurrency_is_bounded():
    script = [delay(0.4, reply(GOOD)) for _ in range(4)]

    async def four(judge):
        verdicts = await asyncio.gather(
            *(judge.complete_json(f"p{i}", "ruler_pair", SCHEMA, winner) for i in range(4))
        )
        await judge.aclose()
        return verdicts

    with scripted_openai(script) as api:
        judge = client(api, max_concurrency=2)
        start = time.monotonic()
        assert asyncio.run(four(judge)) == ["b"] * 4
        assert time.monotonic() - start >= 0.8  # two waves of two, not one of four


def test_the_cache_answers_without_the_server(tmp_path):
    path = tmp_path / "cache" / "judge.jsonl"
    with scripted_openai([reply(GOOD)]) as api:
        assert ask(client(api, cache=JudgeCache(path))) == "b"
        again = client(api, cache=JudgeCache(path), max_retries=0)
        assert ask(again) == "b"  # the script is used up: the server would answer 500
        assert again.stats.cache_hits == 1 and again.stats.requests == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"key": cache_key("judge-model", "which?"), "scores": json.loads(GOOD)}]


def test_the_cache_key_is_model_and_prompt(tmp_path):
    assert cache_key("m", "p") != cache_key("m", "q") != cache_key("n", "p")
    assert cache_key("ab", "c") != cache_key("a", "bc")
    assert len(cache_key("m", "p")) == 64


def test_a_torn_last_line_is_ignored_and_cut_off(tmp_path):
    path = tmp_path / "judge.jsonl"
    good = json.dumps({"key": "k1", "text": "summary"})
    path.write_text(good + "\n" + '{"key": "k2", "sco')
    cache = JudgeCache(path)
    assert len(cache) == 1 and cache.get("k1")["text"] == "summary" and cache.get("k2") is None
    cache.put("k3", scores={"winner": "a"})
    lines = path.read_text().splitlines()
    assert [json.loads(line)["key"] for line in lines] == ["k1", "k3"]
    assert JudgeCache(path).get("k3")["scores"] == {"winner": "a"}


def test_complete_text_is_greedy_free_form_and_cached(tmp_path):
    cache = JudgeCache(tmp_path / "c.jsonl")
    with scripted_openai([reply(""), reply("They listed files, then failed.")]) as api:
        judge = client(api, temperature=0.7, cache=cache)

        async def twice():
            first, second = await judge.complete_text("s"), await judge.complete_text("s")
            await judge.aclose()
            return first, second

        text, again = asyncio.run(twice())
        assert text == again == "They listed files, then failed."
    assert len(api.requests) == 2  # the empty reply was retried; the second call was a hit
    for body in api.requests:
        assert body["temperature"] == 0.0 and "response_format" not in body
    assert judge.stats.cache_hits == 1


def test_an_endpoint_without_response_formats_is_asked_plainly_from_then_on():
    refusal = status(400, "response_format: response_format type 'json_schema' is not supported")
    with scripted_openai([refusal, reply(GOOD), reply(GOOD)]) as api:
        judge = client(api, max_retries=0)  # the refusal does not spend a try
        assert ask(judge) == "b" and ask(judge, "again?") == "b"
    assert "response_format" in api.requests[0]
    assert all("response_format" not in body for body in api.requests[1:])
    assert (judge.stats.requests, judge.stats.retries) == (3, 0)
    # the schema goes as vLLM's guided_json instead (retrograd serve decodes under it)
    schema = api.requests[0]["response_format"]["json_schema"]["schema"]
    assert all(body["guided_json"] == schema for body in api.requests[1:])


def test_an_endpoint_refusing_guided_json_too_gets_the_prompt_alone():
    refusals = [
        status(400, "response_format: response_format type 'json_schema' is not supported"),
        status(400, "guided_json: unknown field"),
    ]
    with scripted_openai([*refusals, reply(GOOD), reply(GOOD)]) as api:
        judge = client(api, max_retries=0)
        assert ask(judge) == "b" and ask(judge, "again?") == "b"
    assert "guided_json" in api.requests[1]
    assert all("guided_json" not in b and "response_format" not in b for b in api.requests[2:])


def test_a_killed_writer_leaves_a_readable_cache(tmp_path):
    """SIGKILL a process appending rows as fast as it can: every row it finished reads back,
    and the next row lands on a line of its own."""
    import os
    import signal
    import subprocess
    import sys

    path = tmp_path / "judge.jsonl"
    writer = (
        "import sys\n"
        "from retrograd.rewards.ruler.cache import JudgeCache\n"
        "cache = JudgeCache(sys.argv[1])\n"
        "for i in range(10**9):\n"
        "    cache.put(f'k{i}', text='x' * 5000)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", writer, str(path)])
    deadline = time.monotonic() + 30
    while (not path.exists() or path.stat().st_size < 200_000) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    cache = JudgeCache(path)
    assert len(cache) >= 40 and all(row["text"] == "x" * 5000 for row in cache.rows.values())
    keys = sorted(int(k[1:]) for k in cache.rows)
    assert keys == list(range(len(keys)))  # rows land in order, none lost before the last
    cache.put("after", text="y")
    rows = [json.loads(line) for line in path.read_text().splitlines()]  # every line parses
    assert rows[-1] == {"key": "after", "text": "y"} and len(rows) == len(keys) + 1


def test_a_reply_past_the_cap_is_a_failed_judge_call_naming_it():
    """A judge's reply had no size limit: 17 MiB were read, parsed and judged. Past
    REPLY_BYTES (16 MiB) the call fails at once, not asked again (a retry reads as much)."""
    script = [reply(GOOD + " " * (17 << 20)), reply(GOOD)]
    with scripted_openai(script) as api:
        judge = client(api)
        with pytest.raises(JudgeError, match=r"\[grpo\.judge\]: a reply over 16777216 bytes"):
            ask(judge)
    assert len(api.requests) == 1
