"""Tools through serve, with the openai SDK: catalog in the prompt, calls parsed back, auth.

The model's words are scripted here (a base model does not call tools on request: a
ScriptedBatch stands in for the live batch), so that the test checks what serve does around
generation: the prompt it renders with the model's
chat format (Gemma's fallback: Hermes catalog in the system prompt), and how it turns the
generated text into `tool_calls`.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch
from fastapi.testclient import TestClient
from openai import OpenAI

import retrograd
from retrograd.openai_app import app as serve_app
from retrograd.openai_app.weights import Loaded
from retrograd.tokenizer import ChatFormat, chat_template
from tests.unit.openai_app.scripted import ScriptedBatch

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def chat_format(gemma_path):
    from retrograd.gguf import GGUFFile

    tok = retrograd.load_tokenizer(gemma_path)
    return ChatFormat(tok, chat_template(tok, GGUFFile(gemma_path).metadata))


@pytest.fixture
def scripted(chat_format):
    """A loaded model whose answers come from a ScriptedBatch (`.sampler` here)."""
    model = type("M", (), {"decoder": torch.nn.Module()})()
    loaded = Loaded(model, chat_format, ScriptedBatch(chat_format.tokenizer, CALL), 2048, None)
    return loaded


def create_app(loaded, name, **kw):
    return serve_app.create_app(loaded, name, batch=loaded.sampler, **kw)


def sdk(app, key="unused") -> OpenAI:
    client = TestClient(app, base_url="http://127.0.0.1")  # a key-less app answers this machine
    return OpenAI(base_url="http://127.0.0.1/v1", api_key=key, http_client=client)


def test_tools_reach_the_prompt_and_calls_come_back(scripted):
    client = sdk(create_app(scripted, "gemma"))
    scripted.sampler.text = CALL
    r = client.chat.completions.create(
        model="gemma", messages=[{"role": "user", "content": "Paris?"}], tools=[WEATHER]
    )
    prompt = scripted.sampler.prompts[-1]
    assert "<tools>" in prompt and '"get_weather"' in prompt
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert not choice.message.content


def test_tool_results_are_rendered_back(scripted):
    client = sdk(create_app(scripted, "gemma"))
    scripted.sampler.text = "It is sunny."
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = client.chat.completions.create(model="gemma", messages=messages, tools=[WEATHER])
    prompt = scripted.sampler.prompts[-1]
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert '"name": "get_weather"' in prompt  # the earlier call, written in Hermes form
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"


def test_tool_choice_none_leaves_the_catalog_out(scripted):
    client = sdk(create_app(scripted, "gemma"))
    scripted.sampler.text = CALL
    r = client.chat.completions.create(
        model="gemma",
        messages=[{"role": "user", "content": "Paris?"}],
        tools=[WEATHER],
        tool_choice="none",
    )
    assert "<tools>" not in scripted.sampler.prompts[-1]
    assert r.choices[0].message.content == CALL and not r.choices[0].message.tool_calls


def test_streamed_tool_calls(scripted):
    client = sdk(create_app(scripted, "gemma"))
    scripted.sampler.text = CALL
    chunks = list(
        client.chat.completions.create(
            model="gemma",
            messages=[{"role": "user", "content": "Paris?"}],
            tools=[WEATHER],
            stream=True,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    # with tools offered the text is parsed once whole: the call comes in one delta
    [with_calls] = [c for c in chunks if c.choices[0].delta.tool_calls]
    [call] = with_calls.choices[0].delta.tool_calls
    assert call.index == 0 and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert not any(c.choices[0].delta.content for c in chunks)  # no call text leaks out
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_api_key_is_required_as_bearer(scripted):
    app = create_app(scripted, "gemma", api_key="s3cret")
    with pytest.raises(openai.AuthenticationError):
        sdk(app, key="wrong").models.list()
    assert [m.id for m in sdk(app, key="s3cret").models.list().data] == ["gemma", "base"]
    r = TestClient(app).get("/v1/models")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_image_parts_and_unknown_roles_are_refused(scripted):
    client = sdk(create_app(scripted, "gemma"))
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="gemma", messages=[{"role": "user", "content": [image]}]
        )
    assert err.value.param == "messages[0].content"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="gemma", messages=[{"role": "robot", "content": "x"}])
    assert err.value.param == "messages[0].role"
