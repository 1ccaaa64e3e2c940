"""Plans without a server: SFT's step count as its loop takes the steps, the memory posts and
their levers, and the budget check's refusal."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from retrograd.algorithms.sft import total_steps
from retrograd.config.load import parse_toml
from retrograd.data.sft import Example, SFTDataset
from retrograd.server import plans
from retrograd.server.config import load_server_config
from retrograd.server.documents import prepare
from retrograd.server.problems import Problem
from tests.factories.run_server import sft_toml
from tests.factories.tiny_gguf import write_tiny


def test_sft_steps_are_counted_as_the_loop_groups_them():
    rng = random.Random(0)
    for _ in range(200):
        examples = []
        for _ in range(rng.randint(1, 4)):
            n = rng.randint(2, 90)
            mask = (0,) + tuple(
                int(rng.random() < rng.choice((0.0, 0.1, 0.9))) for _ in range(n - 1)
            )
            examples.append(Example(tuple(range(n)), mask, "x"))
        data = SFTDataset(None, "jsonl", tuple(examples), "", len(examples), 0, 0)
        mb, acc = rng.choice((1, 4, 16, 32)), rng.choice((1, 2, 3))
        training = SimpleNamespace(micro_batch=mb, gradient_accumulation=acc, epochs=2)
        assert plans._sft_total(data, training) == total_steps(data, training)


@pytest.fixture
def prepared(tmp_path):
    model = write_tiny(tmp_path / "tiny.gguf", "llama")
    document = parse_toml(sft_toml(model, tmp_path / "data.txt"), "the test")
    return lambda params=None: prepare(
        document, params, load_server_config(None, environ={}), tmp_path / "run"
    )


def test_memory_posts_follow_the_knobs(prepared):
    base = prepared()
    plan = plans.build_plan(base.config, base.provenance)
    posts = {p["post"]: p["bytes"] for p in plan["memory"]["posts"]}
    assert plan["memory"]["ram_bytes"] == sum(posts.values()) and plan["memory"]["vram_bytes"] == 0
    # SGD keeps no state: the adapter's weights and gradients alone, 8 bytes a parameter
    sgd = prepared({"training": {"optimizer": "sgd"}})
    posts_sgd = {p["post"]: p["bytes"] for p in plans.build_plan(sgd.config, {})["memory"]["posts"]}
    assert posts["adapters_and_optimizer"] == 2 * posts_sgd["adapters_and_optimizer"]
    # a wider adapter costs proportionally more
    wide = prepared({"lora": {"rank": 8}})
    posts_wide = {
        p["post"]: p["bytes"] for p in plans.build_plan(wide.config, {})["memory"]["posts"]
    }
    assert posts_wide["adapters_and_optimizer"] == 2 * posts["adapters_and_optimizer"]
    # every lever saves what it says
    for lever in plan["levers"]:
        assert lever["saves_bytes"] > 0
    assert plan["levers"][0]["path"] == "training.micro_batch"


def test_a_plan_over_budget_names_its_posts_and_what_unlocks_it(prepared, tmp_path):
    base = prepared()
    plan = plans.build_plan(base.config, {})
    need = plan["memory"]["ram_bytes"]
    server = load_server_config(None, overrides={"ram_budget": need, "margin": 0.5}, environ={})
    with pytest.raises(Problem) as refused:
        plans.check_budget(plan, server)
    meta = refused.value.meta
    assert refused.value.kind == "insufficient-memory"
    assert meta["overflow_bytes"] == need - need // 2 and meta["ram_budget_bytes"] == need // 2
    assert meta["unlocks"] == []  # the levers save far less than half
    assert [p["post"] for p in meta["dominant_posts"]][0] == "base_weights"
    roomy = load_server_config(None, overrides={"ram_budget": 2 * need}, environ={})
    plans.check_budget(plan, roomy)  # fits: nothing raised
