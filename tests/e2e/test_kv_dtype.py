"""[training].kv_dtype reaches the key/value caches each loop builds, end to end on tiny models:
the sampler's cache in ppo, grpo, on-policy distillation and agent_grpo (fast_sampling_context
on) and in bench, chat and serve, the cache of a window's earlier passes in sft and offline distillation; a preference run
builds no cache, and with fast_sampling_context = false the sampler's cache is float32 whatever
the key says (exact sampling); the run server's live chat samples with the run's key too. Observed through KVCache.update, which every cache's first pass
goes through, on a bf16 compute path: there sft's "f16" is not the float32 fallback of an f32
path, and the sampler's 16-bit cache is the compute type, bf16 (docs/configuration.md)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from retrograd.cli.main import main
from retrograd.model.kv_cache import KVCache
from tests.e2e import test_train_agent as agent
from tests.e2e import test_train_distill as distill
from tests.e2e import test_train_grpo as grpo
from tests.e2e import test_train_ppo as ppo
from tests.e2e import test_train_preference as preference
from tests.e2e import test_train_sft as sft
from tests.e2e.test_train_distill import models  # noqa: F401  (a fixture)
from tests.factories.agents import CHAT_TEMPLATE as AGENT_TEMPLATE
from tests.factories.tiny_gguf import write_tiny

pytestmark = pytest.mark.slow  # sixteen one-update runs


@pytest.fixture
def caches(monkeypatch) -> list[torch.dtype]:
    """The dtype of every cache a pass writes into, in order, on a bf16 compute path."""
    monkeypatch.setenv("RETRO_DTYPE", "bfloat16")
    seen: list[torch.dtype] = []
    real = KVCache.update

    def update(self, layer, k, v, start):
        seen.append(self.k[layer].dtype)
        return real(self, layer, k, v, start)

    monkeypatch.setattr(KVCache, "update", update)
    return seen


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return write_tiny(
        tmp_path_factory.mktemp("kv") / "chat.gguf", "gemma3", chat_template=sft.CHAT_TEMPLATE
    )


def _grpo(tmp: Path, chat: Path, **t) -> list[str]:
    run = grpo.write_run(
        tmp, chat, {"updates": 1, "prompts_per_update": 1, "group_size": 2}, training=t
    )
    return ["train", str(run)]


def _ppo(tmp: Path, chat: Path, **t) -> list[str]:
    run = ppo.write_run(tmp, chat, {"updates": 1, "rollout_batch_size": 2}, training=t)
    return ["train", str(run)]


def _sft(tmp: Path, chat: Path, **t) -> list[str]:
    run = sft.write_run(tmp, chat, training={"epochs": 1, **t})
    return ["train", str(run)]


def _preference(tmp: Path, chat: Path, **t) -> list[str]:
    run = preference.write_run(tmp, chat, training={"epochs": 1, **t})
    return ["train", str(run)]


def _agent(tmp: Path, chat: Path, **t) -> list[str]:
    model = write_tiny(tmp / "agent.gguf", "gemma3", chat_template=AGENT_TEMPLATE)
    agent_run = {
        "updates": 1,
        "scenarios_per_update": 1,
        "group_size": 2,
        "epochs_per_update": 1,
        "max_dropped_fraction": 1.0,  # a random tiny model's turns run out of tokens
        "skip_empty_updates": True,
    }
    run = agent.write_run(tmp, model, agent_run, env=False, training=t)
    return ["train", str(run)]


def _on_policy(tmp: Path, pair, **t) -> list[str]:
    d = {"prompts": "prompts.jsonl", "updates": 1, "prompts_per_update": 1, "samples_per_prompt": 2}
    return ["train", str(distill.write_run(tmp, pair, d, training=t))]


def _offline(tmp: Path, pair, **t) -> list[str]:
    run = distill.write_run(tmp, pair, dict(distill.OFFLINE, offline_epochs=1), training=t)
    assert main(["distill-teacher", str(run), "--k", "4"]) == 0  # the teacher builds no cache
    return ["train", str(run)]


# algorithm -> (the command of a one-update run with these [training] keys, the model fixture)
RUNS: dict[str, tuple[Callable[..., list[str]], str]] = {
    "grpo": (_grpo, "chat_model"),
    "ppo": (_ppo, "chat_model"),
    "distill on_policy": (_on_policy, "models"),
    "agent_grpo": (_agent, "chat_model"),
    "sft": (_sft, "chat_model"),
    "distill topk_offline": (_offline, "models"),
    "preference": (_preference, "chat_model"),
}


@pytest.mark.parametrize("kv", ["f16", "f32"])
@pytest.mark.parametrize("algorithm", list(RUNS))
def test_kv_dtype_is_the_type_of_every_cache_the_loop_builds(
    algorithm, kv, caches, tmp_path, request
):
    command, fixture = RUNS[algorithm]
    argv = command(tmp_path, request.getfixturevalue(fixture), kv_dtype=kv)
    caches.clear()
    assert main(argv) == 0
    if algorithm == "preference":  # scores whole sequences, prompt passes keep their graph
        assert caches == []
        return
    # the sampler's 16 bits are the compute type's; a window's earlier passes keep float16
    sixteen = torch.float16 if algorithm in ("sft", "distill topk_offline") else torch.bfloat16
    expected = {sixteen} if kv == "f16" else {torch.float32}
    assert caches and set(caches) == expected, set(caches)


@pytest.mark.parametrize("algorithm", ["grpo", "agent_grpo"])
def test_exact_sampling_keeps_a_float32_cache_whatever_kv_dtype_says(
    algorithm, caches, tmp_path, chat_model
):
    command, _ = RUNS[algorithm]
    argv = command(tmp_path, chat_model, kv_dtype="f16", fast_sampling_context=False)
    caches.clear()
    assert main(argv) == 0
    assert caches and set(caches) == {torch.float32}, set(caches)


@pytest.mark.parametrize("kv", ["f16", "f32"])
def test_bench_chat_and_serve_sample_with_the_runs_kv_dtype(kv, caches, tmp_path, chat_model):
    """`bench` of a grpo run, and the sampler `chat` and `serve` load (openai_app/weights.py)."""
    from retrograd.config import load_run
    from retrograd.openai_app.weights import load_for_generation
    from retrograd.sampling import SampleRequest, SamplingParams

    expected = {torch.bfloat16} if kv == "f16" else {torch.float32}
    run = grpo.write_run(tmp_path, chat_model, training={"kv_dtype": kv})
    caches.clear()
    data = str(tmp_path / "prompts.jsonl")
    assert main(["bench", str(run), "--data", data, "--limit", "1"]) == 0
    assert caches and set(caches) == expected, set(caches)
    caches.clear()
    loaded = load_for_generation(load_run(run), None, 64, None)
    loaded.sampler.generate([SampleRequest((2, 5, 6), SamplingParams(max_new_tokens=2))])
    assert caches and set(caches) == expected, set(caches)


@pytest.mark.parametrize("kv", ["f16", "f32"])
def test_the_run_servers_live_chat_samples_with_the_runs_kv_dtype(kv, caches, tmp_path, chat_model):
    """The run server's answers from the training model between steps (server/child.py)."""
    from retrograd.config import load_run
    from retrograd.model.model import load
    from retrograd.server.child import LiveModel

    cfg = load_run(grpo.write_run(tmp_path, chat_model, training={"kv_dtype": kv}))
    live = LiveModel(cfg, load(cfg.model.path), plan=None)
    caches.clear()
    out = live.generate({"prompt": "hi", "max_new_tokens": 2, "chat": False})
    assert out["prompt_tokens"] > 0
    expected = {torch.bfloat16} if kv == "f16" else {torch.float32}
    assert caches and set(caches) == expected, set(caches)
