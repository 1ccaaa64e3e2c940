"""The rollout loops under torchrun: 2 gloo ranks on a CPU against one process with the same run
file. Each rank samples and rewards a block of every update's groups (seeds per group, so the
groups are those of one process), scores and back-propagates its own answers, and the summed
gradients make the update of one process: the adapters agree within float tolerance. Rank 0
alone reports. Every launch has a hard timeout (tests/e2e/test_distributed.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e import test_train_distill, test_train_grpo, test_train_ppo
from tests.e2e.test_distributed import assert_same_adapter, kill_every_rank, launch, start, train
from tests.e2e.test_train_sft import CHAT_TEMPLATE

# the reference defaults (ctx 128, micro_batch 32): an update's answers take several passes
DEFAULTS = {"ctx": 128, "micro_batch": 32, "gradient_accumulation": None}
# f32 adapter weights: f16 ones round the two runs' last-bit differences apart at each step
LORA = {"rank": 4, "alpha": 8.0, "targets": ["q", "v", "ffn_down"], "dtype": "f32"}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    from tests.factories.tiny_gguf import write_tiny

    path = tmp_path_factory.mktemp("rl") / "tiny-chat.gguf"
    return write_tiny(path, "gemma3", chat_template=CHAT_TEMPLATE)


def _pair(tmp: Path, write) -> tuple[Path, Path]:
    out = []
    for name in ("one", "two"):
        (tmp / name).mkdir()
        out.append(write(tmp / name))
    return out[0], out[1]


def _both(one: Path, two: Path, atol: float = 1e-5) -> str:
    """One process trains `one`, two ranks `two`; -> the ranks' output."""
    done = launch(train(one, ranks=1), one.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    done = launch(train(two), two.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_same_adapter(one.parent / "out/adapter.gguf", two.parent / "out/adapter.gguf", atol)
    assert done.stdout.count("model: ") == 1  # rank 0 alone reports
    return done.stdout


def _observed(run: Path) -> list[dict]:
    return [
        json.loads(line)
        for f in sorted((run.parent / "obs").rglob("*.jsonl"))
        for line in f.read_text().splitlines()
    ]


@pytest.mark.slow
def test_grpo_on_two_ranks_trains_the_adapter_of_one_process(chat_model, tmp_path):
    """3 prompts an update on 2 ranks (blocks of 2 and 1), a KL term toward the reference and
    two passes an update; the observe feed holds every group once, from rank 0."""
    grpo = {"updates": 3, "prompts_per_update": 3, "group_size": 4, "kl_coefficient": 0.05}
    grpo["grpo_epochs"] = 2
    observe = 'directory = "obs"'

    def write(tmp):
        return test_train_grpo.write_run(
            tmp, chat_model, grpo, training=DEFAULTS, observe=observe, lora=LORA
        )

    one, two = _pair(tmp_path, write)
    _both(one, two)
    rollouts = [r for r in _observed(two) if r.get("type") == "rollout"]
    expected = [r for r in _observed(one) if r.get("type") == "rollout"]
    assert len(rollouts) == len(expected) == 3 * 3 * 4
    key = lambda r: (r["update"], r["group"], r["member"])  # noqa: E731
    assert sorted(map(key, rollouts)) == sorted(map(key, expected))


@pytest.mark.slow
def test_ppo_with_its_critic_on_two_ranks_trains_the_adapter_of_one_process(chat_model, tmp_path):
    """5 answers an update (blocks of 3 and 2), the value head's features and gradients on the
    rank that sampled. The policy steps by SGD; the head's AdamW turns the last bits of its
    summed gradients into slightly different values, hence a looser tolerance than GRPO's
    (without the critic the two runs agree exactly)."""
    ppo = {"updates": 3, "rollout_batch_size": 5, "ppo_epochs": 2}
    training = {**DEFAULTS, "optimizer": "sgd", "lr": 0.05}

    def write(tmp):
        return test_train_ppo.write_run(tmp, chat_model, ppo, training=training, lora=LORA)

    _both(*_pair(tmp_path, write), atol=2e-4)


@pytest.mark.slow
def test_on_policy_distillation_on_two_ranks_trains_the_adapter_of_one_process(
    chat_model, tmp_path
):
    """3 prompts of 2 answers an update, the teacher scoring each rank's own answers. SGD: an
    AdamW step turns a gradient that is zero but for float noise into a step of lr either way,
    and the two runs' noise differs (the sums run in another order)."""
    from tests.factories.tiny_gguf import write_tiny

    teacher = write_tiny(tmp_path / "teacher.gguf", "gemma3", seed=1, chat_template=CHAT_TEMPLATE)
    distill = {
        "prompts": "prompts.jsonl",
        "updates": 2,
        "prompts_per_update": 3,
        "samples_per_prompt": 2,
    }

    training = {**DEFAULTS, "optimizer": "sgd", "lr": 0.05}

    def write(tmp):
        return test_train_distill.write_run(
            tmp, (chat_model, teacher), distill, training=training, lora=LORA
        )

    _both(*_pair(tmp_path, write))


@pytest.mark.slow
def test_grpo_killed_on_every_rank_resumes_to_the_uninterrupted_adapter(chat_model, tmp_path):
    grpo = {"updates": 4, "prompts_per_update": 2, "group_size": 4}
    ck = 'directory = "ck"\nmode = "steps"\nevery_steps = 2'

    def write(tmp):
        return test_train_grpo.write_run(
            tmp, chat_model, grpo, training=DEFAULTS, checkpoint=ck, lora=LORA
        )

    whole, cut = _pair(tmp_path, write)
    done = launch(train(whole), whole.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resumed from" in _killed_then_resumed(cut, "step-000000000002.state")
    assert_same_adapter(whole.parent / "out/adapter.gguf", cut.parent / "out/adapter.gguf", 1e-7)


def _killed_then_resumed(run: Path, state: str) -> str:
    """Two ranks train `run` until checkpoint `state` lands, every rank is killed (SIGKILL),
    then two ranks resume it to the end; -> the resumed ranks' output."""
    kill_every_rank(start(train(run), run.parent), run.parent / "ck" / state)
    assert not (run.parent / "out/adapter.gguf").exists()
    resumed = launch(train(run, "--resume"), run.parent)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    return resumed.stdout
