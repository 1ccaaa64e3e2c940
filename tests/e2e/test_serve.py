"""`retrograd serve` as a user runs it, driven by the official openai SDK and by raw HTTP.

One server process (real Gemma 3 270M with a small adapter) serves the module; it binds
127.0.0.1 on a free port and is stopped at the end.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from retrograd.cli.main import main
from tests.factories.adapters import write_adapter

HELLO = [{"role": "user", "content": "Write one word."}]


def write_run(directory: Path, adapter: Path | None = None) -> Path:
    (directory / "data.jsonl").write_text("")
    out = adapter.name if adapter else "adapter.gguf"
    run = directory / "run.toml"
    run.write_text(
        f'[run]\nalgorithm = "sft"\n[output]\npath = "{out}"\n[lora]\nrank = 4\n'
        '[sft]\ndata = "data.jsonl"\n'
    )
    return run


def gemma_adapter(gemma_path, path: Path) -> Path:
    targets = [f"blk.{i}.attn_output.weight" for i in range(18)]
    return write_adapter(path, gemma_path, targets, rank=4, alpha=8.0, seed=1)


@pytest.fixture(scope="module")
def server(gemma_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    adapter = gemma_adapter(gemma_path, root / "tuned.gguf")
    run = write_run(root, adapter)
    cmd = [sys.executable, "-m", "retrograd.cli.main", "serve", str(run)]
    cmd += ["--model", str(gemma_path), "--device", "cpu", "--port", "0", "--ctx", "512"]
    cmd += ["--model-name", "tuned"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # printed once the model is loaded and the port bound
        assert "serving tuned and base at http://127.0.0.1:" in line, proc.stderr.read()
        url = line.split(" at ")[1].split()[0]
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server, api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_adapter_and_base(client):
    assert [m.id for m in client.models.list().data] == ["tuned", "base"]
    assert client.models.retrieve("base").id == "base"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_greedy_answers_repeat_and_the_adapter_changes_them(client):
    def ask(model):
        r = client.chat.completions.create(
            model=model, messages=HELLO, temperature=0, max_tokens=8, seed=1
        )
        return r

    first, again, base = ask("tuned"), ask("tuned"), ask("base")
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.choices[0].message.content != base.choices[0].message.content
    assert first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.completion_tokens <= 8 and first.usage.prompt_tokens > 5
    assert ask("tuned").choices[0].message.content == first.choices[0].message.content


def test_streaming_sends_the_same_answer(client):
    kw = dict(model="tuned", messages=HELLO, temperature=0, max_tokens=8)
    plain = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == plain.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_streaming_sends_tokens_as_they_are_generated(client):
    start = time.monotonic()
    stream = client.chat.completions.create(
        model="base",
        messages=HELLO,
        temperature=0,
        max_tokens=24,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    arrivals = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic())
    # one chunk per token or few, spread over the generation (a finished answer sent in one
    # piece, or buffered chunks, would arrive within milliseconds of each other)
    assert len(arrivals) >= 8
    assert arrivals[-1] - arrivals[0] > 0.25 * (arrivals[-1] - start)


def test_an_answer_does_not_depend_on_its_batch_mates(client):
    """The same requests alone, then joining a running batch of other lengths and settings."""
    kw = dict(model="base", max_tokens=10, seed=7, extra_body={"ignore_eos": True})
    asks = [
        dict(messages=HELLO, temperature=0),
        dict(messages=[{"role": "user", "content": "Name a colour."}], temperature=0.8),
    ]
    alone = [client.chat.completions.create(**kw, **a).choices[0].message.content for a in asks]
    decoding = [threading.Event() for _ in range(3)]

    def other(i: int):
        stream = client.chat.completions.create(
            model="base",
            messages=[{"role": "user", "content": "Tell me a long story. " * (i + 1)}],
            temperature=0.4 * i,
            top_p=0.9,
            max_tokens=24 + 4 * i,
            seed=i,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                decoding[i].set()

    others = [threading.Thread(target=other, args=(i,)) for i in range(3)]
    for t in others:
        t.start()
    for d in decoding:
        assert d.wait(timeout=120)
    # the others are decoding: ours join mid-way
    with ThreadPoolExecutor(2) as pool:
        together = list(
            pool.map(lambda a: client.chat.completions.create(**kw, **a).choices[0].message, asks)
        )
    for t in others:
        t.join(timeout=300)
    assert [m.content for m in together] == alone and all(alone)


def test_a_tiny_temperature_answers_greedily(client):
    kw = dict(model="base", messages=HELLO, max_tokens=8)
    greedy = client.chat.completions.create(**kw, temperature=0)
    tiny = client.chat.completions.create(**kw, temperature=1e-39)
    assert tiny.choices[0].message.content == greedy.choices[0].message.content != ""
    assert tiny.usage.completion_tokens == greedy.usage.completion_tokens


def test_bodies_a_new_user_might_send(server, client):
    url = server + "/chat/completions"
    deep = '{"model": "base", "messages": ' + "[" * 50_000 + "]" * 50_000 + "}"
    r = httpx.post(url, content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="base", messages=HELLO, max_tokens=True)
    assert err.value.param == "max_tokens"
    for messages, where in (
        ([{"role": "assistant", "content": "Hi."}, *HELLO], "message 0"),
        ([*HELLO, *HELLO], "message 1"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="base", messages=messages)
        assert err.value.param == "messages" and where in err.value.message


def test_stop_strings_cut_the_answer(client):
    kw = dict(model="base", messages=HELLO, temperature=0, max_tokens=12)
    text = client.chat.completions.create(**kw).choices[0].message.content
    cut = text[2:4]
    r = client.chat.completions.create(**kw, stop=[cut])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[: text.index(cut)]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"temperature": 3.0}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_refusals_are_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tuned", messages=HELLO, **extra)
    assert err.value.param == param
    assert param in err.value.message


def test_tool_refusals_name_the_field(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for extra, param in (
        ({"tool_choice": "required"}, "tool_choice"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tuned", messages=HELLO, tools=tools, **extra)
        assert err.value.param == param


def test_unknown_model_and_bad_messages(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=HELLO)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tuned", messages=[])
    assert err.value.param == "messages"
    long = [{"role": "user", "content": "word " * 2000}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tuned", messages=long)
    assert err.value.code == "context_length_exceeded"


def test_malformed_and_oversized_requests_get_clear_json(server):
    url = server + "/chat/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url, content=b"x" * (5 << 20))
    assert r.status_code == 413 and "bytes" in r.json()["error"]["message"]
    r = httpx.post(url, json={"messages": HELLO})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = httpx.get(server + "/nowhere")
    assert r.status_code == 404 and "error" in r.json()


def test_concurrent_clients_are_all_answered(client):
    results: dict[int, str] = {}
    errors: list[Exception] = []

    def ask(i: int):
        try:
            r = client.chat.completions.create(
                model="tuned" if i % 3 else "base",
                messages=[{"role": "user", "content": "Count to three." if i % 2 else "Hi"}],
                temperature=0.8,
                max_tokens=6,
                seed=i,
            )
            results[i] = r.choices[0].message.content
        except Exception as e:  # noqa: BLE001 - collected and reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(10)]
    start = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert len(results) == 10 and all(isinstance(v, str) for v in results.values())
    assert time.time() - start < 300


def test_serve_refuses_an_open_bind_without_a_key(tmp_path, capsys):
    run = write_run(tmp_path)
    assert main(["serve", str(run), "--model", "x.gguf", "--host", "0.0.0.0", "--base-only"]) == 1
    assert "requires --api-key" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value"), [("--max-sequences", "0"), ("--max-queue", "-1")])
def test_serve_refuses_batch_flags_out_of_range(tmp_path, capsys, flag, value):
    run = write_run(tmp_path)
    assert main(["serve", str(run), "--model", "x.gguf", "--base-only", flag, value]) == 1
    assert f"{flag} {value}: must be at least" in capsys.readouterr().err


def test_serve_checkpoint_names_the_exported_adapter(tmp_path, capsys, gemma_path):
    run = write_run(tmp_path)
    ckpt = tmp_path / "ckpt" / "best.state"
    code = main(["serve", str(run), "--model", str(gemma_path), "--checkpoint", str(ckpt)])
    assert code == 1
    assert str(tmp_path / "ckpt" / "best.gguf") in capsys.readouterr().err


def test_sse_frames_are_json_then_done(server):
    body = {"model": "base", "messages": HELLO, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server + "/chat/completions", json=body, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    assert all(json.loads(f)["object"] == "chat.completion.chunk" for f in frames[:-1])


def test_tools_reach_the_real_models_prompt(client):
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    kw = dict(model="tuned", messages=HELLO, temperature=0, max_tokens=2)
    with_tools = client.chat.completions.create(**kw, tools=[tool])
    without = client.chat.completions.create(**kw, tools=[tool], tool_choice="none")
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 20


VERDICT = {
    "type": "object",
    "properties": {
        "winner": {"type": "string", "enum": ["a", "b", "tie"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "reasons": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 2},
    },
    "required": ["winner", "confidence", "reasons"],
    "additionalProperties": False,
}


def test_guided_json_answers_follow_the_schema(client):
    """vLLM's guided_json on the real vocabulary: greedy and sampled answers close their object
    and validate; streaming sends the same text."""
    import jsonschema

    ask = [{"role": "user", "content": "Is answer a or b better? a: 2+2=4. b: 2+2=5."}]
    kw = dict(model="base", messages=ask, max_tokens=300, extra_body={"guided_json": VERDICT})
    greedy = client.chat.completions.create(**kw, temperature=0)
    assert greedy.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(greedy.choices[0].message.content), VERDICT)
    stream = client.chat.completions.create(**kw, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == greedy.choices[0].message.content
    as_text = dict(kw, extra_body={"guided_json": json.dumps(VERDICT)})
    for seed in (1, 2):
        r = client.chat.completions.create(**as_text, temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), VERDICT)


def test_guided_json_refusals_name_the_field(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for extra, where in (
        ({"guided_json": {"type": "string", "pattern": "a+"}}, "guided_json.pattern"),
        ({"guided_json": "{not json"}, "guided_json: not JSON"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="base", messages=HELLO, extra_body=extra)
        assert err.value.param == "guided_json" and where in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="base", messages=HELLO, tools=tools, extra_body={"guided_json": VERDICT}
        )
    assert err.value.param == "guided_json"
