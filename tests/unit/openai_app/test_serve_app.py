"""serve's queue, weights, streaming, disconnects and request edges, without a model.

The app runs under uvicorn with a scripted batch (tests/unit/openai_app/scripted.py) in place of
the model's live batch, driven by the openai SDK and raw HTTP: what serve does around
generation, not generation itself (tests/e2e/test_serve.py runs the real model).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import torch
from openai import OpenAI

import retrograd
from retrograd.openai_app.app import create_app
from retrograd.openai_app.weights import Loaded
from retrograd.tokenizer import ChatFormat, chat_template
from tests.unit.openai_app.scripted import ScriptedBatch, serving

HI = [{"role": "user", "content": "Hi"}]


class _Lora:
    enabled = True


@pytest.fixture(scope="module")
def chat_format(gemma_path):
    from retrograd.gguf import GGUFFile

    tok = retrograd.load_tokenizer(gemma_path)
    return ChatFormat(tok, chat_template(tok, GGUFFile(gemma_path).metadata))


def make(chat_format, text="Hello there.", adapter=False, **kw):
    """(app, its scripted batch); the served name `tuned` is the adapter when `adapter`."""
    decoder = torch.nn.Module()
    decoder.blk = torch.nn.Linear(1, 1)
    decoder.blk.lora = _Lora()
    model = type("M", (), {"decoder": decoder})()
    loaded = Loaded(model, chat_format, None, 2048, "tuned.gguf" if adapter else None)
    batch = ScriptedBatch(chat_format.tokenizer, text, step_seconds=kw.pop("step_seconds", 0))
    batch.decoder = decoder
    return create_app(loaded, "tuned", batch=batch, **kw), batch


def sdk(url: str, key: str = "unused", timeout: float = 30) -> OpenAI:
    return OpenAI(base_url=url, api_key=key, max_retries=0, timeout=timeout)


def wait_for(condition, seconds: float = 60) -> None:
    end = time.time() + seconds
    while not condition():
        assert time.time() < end, "timed out"
        time.sleep(0.01)


def test_past_the_queue_requests_get_503_with_retry_after(chat_format):
    app, batch = make(chat_format, max_sequences=1, max_queue=1)
    batch.paused = True
    worker = app.state.worker
    with serving(app) as url:
        answers: list[str] = []
        errors: list[Exception] = []

        def ask():
            try:
                r = sdk(url, timeout=120).chat.completions.create(model="tuned", messages=HI)
                answers.append(r.choices[0].message.content)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=ask) for _ in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: batch.size == 1 and len(worker._queue) == 1)
        with pytest.raises(openai.InternalServerError) as err:
            sdk(url).chat.completions.create(model="tuned", messages=HI)
        assert err.value.status_code == 503 and err.value.code == "server_busy"
        assert int(err.value.response.headers["retry-after"]) >= 1
        assert err.value.body["type"] == "server_error"
        batch.paused = False
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    assert answers == ["Hello there."] * 2


def test_the_other_weights_wait_until_the_batch_drains(chat_format):
    app, batch = make(chat_format, adapter=True, max_sequences=4, step_seconds=0.002)
    with serving(app) as url:
        client = sdk(url)
        done: list[str] = []

        def ask(model):
            r = client.chat.completions.create(model=model, messages=HI)
            done.append(r.choices[0].message.content)

        threads = [
            threading.Thread(target=ask, args=("tuned" if i % 2 else "base",)) for i in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    assert len(done) == 8  # ScriptedBatch.step asserts the switch never moved under an answer
    assert batch.weights.count(True) == 4 and batch.weights.count(False) == 4


def test_a_stream_arrives_as_it_is_made(chat_format):
    text = "one two three four five six seven eight"
    app, batch = make(chat_format, text, step_seconds=0.05)
    with serving(app) as url:
        stream = sdk(url).chat.completions.create(
            model="tuned", messages=HI, stream=True, stream_options={"include_usage": True}
        )
        arrivals, chunks = [], []
        for chunk in stream:
            arrivals.append(time.monotonic())
            chunks.append(chunk)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert "".join(pieces) == text and len(pieces) >= 5
    # ten steps of 50 ms: the first words came long before the last
    assert arrivals[-1] - arrivals[1] > 0.25
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == len(batch.tokenizer.tokenize(text, add_bos=False))


def test_a_client_that_leaves_frees_its_row(chat_format):
    app, batch = make(chat_format, "word " * 400, step_seconds=0.01)
    with serving(app) as url:
        body = {"model": "tuned", "messages": HI, "stream": True}
        with httpx.stream("POST", url + "/chat/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # the role
            wait_for(lambda: batch.size == 1)
        wait_for(lambda: len(batch.cancelled) == 1 and batch.idle)
        batch.paused = True  # a plain request whose client gives up waiting
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                url + "/chat/completions", json={"model": "tuned", "messages": HI}, timeout=0.5
            )
        wait_for(lambda: len(batch.cancelled) == 2 and batch.idle)


def test_every_route_asks_for_the_key_when_one_is_set(chat_format):
    app, _ = make(chat_format, api_key="s3cret")
    with serving(app) as url:
        root = url.removesuffix("/v1")
        for path in ("/openapi.json", "/docs", "/v1/models", "/nowhere"):
            r = httpx.get(root + path)
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.get(root + "/openapi.json", headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and "/v1/chat/completions" in r.json()["paths"]


def test_without_a_key_only_this_machine_is_answered(chat_format):
    # a web page the browser shows must not drive the model: by rebinding its own name to
    # 127.0.0.1 (Host), or by posting to 127.0.0.1 from elsewhere (Origin)
    app, _ = make(chat_format)
    with serving(app) as url:
        port = url.split(":")[2].split("/")[0]
        ask = {"model": "tuned", "messages": HI, "max_tokens": 2}
        for headers, allowed in (
            ({}, True),
            ({"Host": f"localhost:{port}"}, True),
            ({"Origin": f"http://127.0.0.1:{port}"}, True),
            ({"Host": f"evil.example:{port}"}, False),
            ({"Origin": "https://evil.example"}, False),
            ({"Origin": "null"}, False),
        ):
            r = httpx.post(url + "/chat/completions", json=ask, headers=headers)
            if allowed:
                assert r.status_code == 200, (headers, r.text)
            else:
                assert r.status_code == 403, (headers, r.text)
                assert r.json()["error"]["code"] == "not_from_this_machine"
                assert httpx.get(url + "/models", headers=headers).status_code == 403
    app, _ = make(chat_format, api_key="s3cret")  # with a key, the key decides
    with serving(app) as url:
        key = {"Authorization": "Bearer s3cret", "Origin": "https://elsewhere.example"}
        assert httpx.get(url + "/models", headers=key).status_code == 200


def test_a_deeply_nested_body_is_a_400_in_openai_shape(chat_format):
    app, _ = make(chat_format)
    with serving(app) as url:
        for depth in (100, 100_000):  # past our limit; past Python's own parser
            raw = '{"model": "tuned", "messages": ' + "[" * depth + "]" * depth + "}"
            r = httpx.post(
                url + "/chat/completions",
                content=raw,
                headers={"content-type": "application/json"},
            )
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "invalid_json" and "deeper than 64" in error["message"]
        # JSON inside strings of the body: a schema given as text, a tool call's arguments
        deep = "[" * 100_000 + "]" * 100_000
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
        for extra in (
            {"guided_json": deep},
            {"messages": HI + [{"role": "assistant", "content": "", "tool_calls": [call]}]},
        ):
            r = httpx.post(
                url + "/chat/completions", json={"model": "tuned", "messages": HI} | extra
            )
            assert r.status_code == 400, r.text
            assert "deep" in r.json()["error"]["message"], r.text  # deeper than 64, too deeply


def test_a_guided_schema_that_would_hang_the_server_is_a_400_and_the_server_answers_on(chat_format):
    """A schema referring to itself before any text (it killed the generation thread), one
    of 2^40 ways to one stack (it froze every route), one of 4 million rules (a gigabyte
    each): each a 400 naming guided_json, and the next plain request is answered."""
    app, _ = make(chat_format)
    chain = {"d0": {"type": "string"}}
    for i in range(1, 41):
        chain[f"d{i}"] = {"anyOf": [{"$ref": f"#/$defs/d{i - 1}"}] * 2}
    big = {f"p{i}": {"type": "string", "maxLength": 4096} for i in range(1000)}
    with serving(app) as url:
        for schema, why in [
            ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "refers to itself"),
            ({"type": "object", "properties": big}, "more than 131072 grammar rules"),
        ]:
            r = httpx.post(
                url + "/chat/completions",
                json={"model": "tuned", "messages": HI, "guided_json": schema},
                timeout=60,
            )
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "guided_json" and why in error["message"], error
        r = httpx.post(
            url + "/chat/completions",
            json={
                "model": "tuned",
                "messages": HI,
                "guided_json": {"$defs": chain, "$ref": "#/$defs/d40"},
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        answer = sdk(url).chat.completions.create(model="tuned", messages=HI, max_tokens=2)
        assert answer.choices[0].message.content is not None


def test_a_refusal_quotes_what_was_sent_without_echoing_megabytes(chat_format):
    app, _ = make(chat_format)
    choice = {"type": "function", "function": {"name": "x" * 1_000_000}}
    with serving(app) as url:
        r = httpx.post(
            url + "/chat/completions",
            json={"model": "tuned", "messages": HI, "tool_choice": choice},
            timeout=60,
        )
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "tool_choice" and len(error["message"]) < 400, len(r.text)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "seed", "temperature"])
def test_a_boolean_is_not_a_number(chat_format, field):
    app, _ = make(chat_format)
    with serving(app) as url:
        with pytest.raises(openai.BadRequestError) as err:
            sdk(url).chat.completions.create(model="tuned", messages=HI, **{field: True})
    assert err.value.param == field


@pytest.mark.parametrize(
    ("messages", "where"),
    [
        ([{"role": "assistant", "content": "Hello."}, *HI], "message 0"),
        ([*HI, {"role": "user", "content": "Again?"}], "message 1"),
        ([*HI, {"role": "assistant", "content": "Yes."}, {"role": "system", "content": "x"}], "2"),
    ],
)
def test_a_conversation_training_refuses_is_refused(chat_format, messages, where):
    app, batch = make(chat_format)
    with serving(app) as url:
        with pytest.raises(openai.BadRequestError) as err:
            sdk(url).chat.completions.create(model="tuned", messages=messages)
        assert err.value.param == "messages" and where in err.value.message
        ok = [*HI, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "?"}]
        r = sdk(url).chat.completions.create(model="tuned", messages=ok)
    assert r.choices[0].message.content == "Hello there." and len(batch.prompts) == 1


def test_sse_frames_share_one_id_and_end_with_done(chat_format):
    app, _ = make(chat_format, "abc")
    with serving(app) as url:
        body = {"model": "tuned", "messages": HI, "stream": True}
        with httpx.stream("POST", url + "/chat/completions", json=body, timeout=30) as r:
            frames = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1


def test_a_failed_generation_is_an_openai_error_streamed_or_not(chat_format):
    app, batch = make(chat_format)
    batch.paused = True
    with serving(app) as url:
        stream = sdk(url).chat.completions.create(model="tuned", messages=HI, stream=True)
        first = next(iter(stream))
        assert first.choices[0].delta.role == "assistant"
        batch.fail = RuntimeError("out of memory")
        with pytest.raises(openai.APIError, match="out of memory"):
            list(stream)
        with pytest.raises(openai.InternalServerError) as err:
            sdk(url).chat.completions.create(model="tuned", messages=HI)
        assert err.value.code == "server_error" and "out of memory" in err.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_in_a_request_is_a_400_naming_the_field(chat_format, stream):
    """A `\\ud800` escape is JSON, but no template, tokenizer or UTF-8 answer takes it."""
    app, batch = make(chat_format)
    with serving(app) as url:
        for field, body in (
            (
                "messages",
                '{"model": "tuned", "messages": [{"role": "user", "content": "a\\ud800"}]',
            ),
            ("model", '{"model": "\\udfff", "messages": [{"role": "user", "content": "hi"}]'),
        ):
            raw = body + (', "stream": true}' if stream else "}")
            r = httpx.post(
                url + "/chat/completions", content=raw, headers={"content-type": "application/json"}
            )
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == field and "lone surrogate" in error["message"], error
        nul = [{"role": "user", "content": "a\x00b"}]  # a NUL is text: answered
        r = sdk(url).chat.completions.create(model="tuned", messages=nul)
    assert r.choices[0].message.content == "Hello there." and len(batch.prompts) == 1
