"""`retrograd train` for PPO, end to end on tiny models: the reward rises with and without the
critic, the reference defaults give the whole-context update, a real kill -9 resumes to the
same adapter and value head, the value head never reaches the adapter, and bad input is
refused before the model loads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from retrograd.cli.main import main
from retrograd.config import load_run
from retrograd.errors import ConfigError
from tests.e2e.test_train_grpo import PROMPTS, REWARD, _train, sinks
from tests.e2e.test_train_sft import CHAT_TEMPLATE, scalars
from tests.factories.run_files import write_run_file


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    from tests.factories.tiny_gguf import write_tiny

    path = tmp_path_factory.mktemp("ppo") / "tiny-chat.gguf"
    return write_tiny(path, "gemma3", chat_template=CHAT_TEMPLATE)


def write_run(tmp: Path, model: Path, ppo: dict | None = None, **sections) -> Path:
    (tmp / "reward.py").write_text(REWARD)
    lines = [json.dumps({"messages": [{"role": "user", "content": p}]}) for p in PROMPTS]
    (tmp / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    p = {
        "prompts": "prompts.jsonl",
        "reward_command": [sys.executable, str(tmp / "reward.py")],
        "updates": 8,
        "rollout_batch_size": 16,
        "ppo_epochs": 2,
        "clip_range": 0.2,
        "kl_coefficient": 0.0,
    }
    p.update(ppo or {})
    critic = sections.pop("critic", {})
    t = {"lr": 2e-2, "ctx": 64, "micro_batch": 64, "gradient_accumulation": 1}
    t.update(sections.pop("training", {}))  # None: leave the key out
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8, "seed": 3}
    sampling.update(sections.pop("sampling", {}))
    tables = {"training": t, "ppo": p, "ppo.critic": critic, "ppo.sampling": sampling}
    return write_run_file(tmp, "ppo", model, tables, sections)


@pytest.mark.parametrize("enabled", [True, False], ids=["critic", "no-critic"])
def test_reward_rises_on_a_task_with_an_obvious_signal(chat_model, tmp_path, enabled):
    from retrograd.algorithms.ppo import run_ppo

    run = write_run(
        tmp_path,
        chat_model,
        {"updates": 8},
        critic={"enabled": enabled},
        metrics='tensorboard_dir = "tb"',
    )
    result = run_ppo(load_run(run), run_file=run, sinks=sinks())
    rewards = result.curve
    # two optimizer steps an update with signal; once every answer scores alike, none
    assert len(rewards) == 8 and result.global_step % 2 == 0 and 6 <= result.global_step <= 16
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert last > first + 0.1, rewards
    assert (tmp_path / "out" / "adapter.gguf").exists()
    tb = tmp_path / "tb"
    steps = set(range(2, result.global_step + 1, 2))
    assert set(scalars(tb, "reward/mean")) == steps  # a skipped update reports at its step
    for tag in ("policy/surrogate_loss", "policy/kl", "policy/clip_fraction"):
        assert set(scalars(tb, tag)) == steps, tag
    # the second pass of each update has moved away from the sampler: KL > 0, some clipping
    assert max(scalars(tb, "policy/kl").values()) > 0
    assert max(scalars(tb, "policy/clip_fraction").values()) > 0
    critic_tags = ("policy/value_loss", "critic/feature_mib", "critic/explained_variance")
    for tag in critic_tags:
        assert bool(scalars(tb, tag)) == enabled, tag
    if enabled:
        # the 16 answers' tokens x n_embd float32 features
        n_embd = _n_embd(chat_model)
        mib, length = scalars(tb, "critic/feature_mib"), scalars(tb, "completions/length_mean")
        for step, v in mib.items():
            assert v == pytest.approx(16 * length[step] * n_embd * 4 / 2**20), (step, v)
        losses = list(scalars(tb, "policy/value_loss").values())
        assert all(np.isfinite(losses))
        # the head starts at zero: its first values explain nothing, later ones something
        explained = scalars(tb, "critic/explained_variance")
        assert explained[min(explained)] == pytest.approx(0.0, abs=1e-9)
        assert all(np.isfinite(list(explained.values()))) and len(set(explained.values())) > 1


def test_the_first_pass_ratios_are_exactly_one(chat_model, tmp_path):
    """ppo_epochs = 1 with the critic's scoring pass: every ratio is 1 (nothing clipped, KL 0
    toward the sampling policy), feature_dtype bf16 halves the features."""
    from retrograd.algorithms.ppo import run_ppo

    mib = {}
    for dtype in ("f32", "bf16"):
        tmp = tmp_path / dtype
        tmp.mkdir()
        run = write_run(
            tmp,
            chat_model,
            {"updates": 2, "ppo_epochs": 1, "clip_range": 1e-6, "kl_coefficient": 0.1},
            critic={"feature_dtype": dtype},
            metrics='tensorboard_dir = "tb"',
            training={"lr": 1e-3},
        )
        run_ppo(load_run(run), run_file=run, sinks=sinks())
        clipped = scalars(tmp / "tb", "policy/clip_fraction")
        assert clipped and all(v == 0.0 for v in clipped.values())
        kl = scalars(tmp / "tb", "policy/kl")
        assert kl and all(v == 0.0 for v in kl.values())
        mib[dtype] = scalars(tmp / "tb", "critic/feature_mib")[1]
    assert mib["bf16"] == pytest.approx(mib["f32"] / 2)


def default_and_wide_passes(chat_model, tmp_path, ppo: dict, metric: str, **write) -> tuple:
    """The same PPO run at ctx 128 with the reference's micro_batch (32, gradient_accumulation
    left out: one answer a pass) and with passes of several answers (128): each one's adapter
    tensors and `metric` by step."""
    from gguf import GGUFReader

    from retrograd.algorithms.ppo import run_ppo

    adapters, figures = [], []
    for name, micro in (("default", None), ("wide", 128)):
        tmp = tmp_path / name
        tmp.mkdir()
        training = {"ctx": 128, "micro_batch": micro, "gradient_accumulation": None, "lr": 1e-3}
        run = write_run(
            tmp, chat_model, ppo, metrics='tensorboard_dir = "tb"', training=training, **write
        )
        cfg = load_run(run)
        if micro is None:
            assert cfg.training.micro_batch == 32
        run_ppo(cfg, run_file=run, sinks=sinks())
        reader = GGUFReader(tmp / "out" / "adapter.gguf")
        adapters.append({t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors})
        figures.append(scalars(tmp / "tb", metric))
    return adapters, figures


def test_the_reference_default_passes_give_the_whole_context_update(chat_model, tmp_path):
    """ctx 128 with the reference's micro_batch (32, gradient_accumulation left out): an
    update's answers go one a pass and give the update of passes of several answers (128)."""
    adapters, figures = default_and_wide_passes(
        chat_model,
        tmp_path,
        {"updates": 1, "ppo_epochs": 1},
        "policy/surrogate_loss",
        sampling={"max_new_tokens": 12},
    )
    losses = [f[1] for f in figures]
    default, wide = adapters
    assert default.keys() == wide.keys() and default
    assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-7)
    moved = sum(float(np.abs(v).sum()) for k, v in wide.items() if k.endswith(".lora_b"))
    assert moved > 0
    diff = sum(float(np.abs(default[k] - wide[k]).sum()) for k in wide)
    assert diff < 1e-3 * moved, (diff, moved)


def _n_embd(model: Path) -> int:
    from retrograd.gguf import GGUFFile

    return int(GGUFFile(model).get("gemma3.embedding_length"))


def _final_state(directory: Path):
    from retrograd.checkpoint import latest_checkpoint, load_checkpoint

    return load_checkpoint(latest_checkpoint(directory))


@pytest.mark.slow
def test_resume_after_kill_is_byte_identical(chat_model, tmp_path):
    """A run killed (SIGKILL) after its checkpoint at step 4 and resumed ends with the
    uninterrupted run's adapter and value head, bit for bit; the adapter GGUF holds no value
    head."""
    from gguf import GGUFReader

    from retrograd.algorithms.ppo import VALUE_HEAD
    from retrograd.trainable.value_head import ValueHead

    ppo = {"updates": 4, "ppo_epochs": 2, "kl_coefficient": 0.05}
    sections = {
        "critic": {"gamma": 0.95, "gae_lambda": 0.9, "feature_dtype": "bf16"},
        "checkpoint": 'directory = "ck"\nmode = "steps"\nevery_steps = 4',
    }
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for d in (whole, cut):
        d.mkdir()
        write_run(d, chat_model, dict(ppo), **dict(sections))
    done = _train(whole / "run.toml")
    assert done.returncode == 0, done.stderr
    _train(cut / "run.toml", wait_for=cut / "ck" / "step-000000000004.state")
    assert not (cut / "out" / "adapter.gguf").exists()
    resumed = _train(cut / "run.toml", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    a = (whole / "out" / "adapter.gguf").read_bytes()
    b = (cut / "out" / "adapter.gguf").read_bytes()
    assert a == b
    heads = []
    for d in (whole, cut):
        state = _final_state(d / "ck")
        assert state.global_step == 8
        heads.append(ValueHead.weights_of(state.artifacts[VALUE_HEAD]))
    assert heads[0].keys() == heads[1].keys()
    for k in heads[0]:
        assert heads[0][k].numpy().tobytes() == heads[1][k].numpy().tobytes(), k
    assert torch.any(heads[0]["linear.weight"] != 0)  # the head trained
    names = [t.name for t in GGUFReader(whole / "out" / "adapter.gguf").tensors]
    assert names and all(n.endswith((".lora_a", ".lora_b")) for n in names), names


def test_cli_trains_ppo_with_observe_and_evaluation(chat_model, tmp_path, capsys):
    (tmp_path / "held.jsonl").write_text(
        "\n".join(json.dumps({"messages": [{"role": "user", "content": p}]}) for p in PROMPTS[:3])
        + "\n"
    )
    run = write_run(
        tmp_path,
        chat_model,
        {"updates": 2, "rollout_batch_size": 4},
        observe='directory = "obs"',
        evaluation='data = "held.jsonl"\nevery_iterations = 1',
        metrics='tensorboard_dir = "tb"',
    )
    assert main(["train", str(run)]) == 0
    out = capsys.readouterr().out
    assert "update 2/2" in out and "mean reward, first -> last update" in out
    assert (tmp_path / "out" / "adapter.gguf").exists()
    records = [json.loads(x) for x in (tmp_path / "obs" / "observe.jsonl").read_text().splitlines()]
    kinds = [r["type"] for r in records]
    assert kinds[0] == "run" and kinds.count("update") == 2 and kinds.count("outcome") == 2
    rollouts = [r for r in records if r["type"] == "rollout"]
    assert len(rollouts) == 2 * 4
    assert all(isinstance(r["completion"], str) and r["reward"] is not None for r in rollouts)
    for tag in ("eval/mean_reward", "eval/reward_min", "eval/reward_max"):
        assert len(scalars(tmp_path / "tb", tag)) == 2, tag


def test_bench_reports_rewards_of_base_and_adapter(chat_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    run = write_run(tmp_path, chat_model, {"updates": 1, "rollout_batch_size": 4})
    assert main(["train", str(run)]) == 0
    capsys.readouterr()
    adapter = str(tmp_path / "out" / "adapter.gguf")
    data = str(tmp_path / "prompts.jsonl")
    assert main(["bench", str(run), "--data", data, "--adapter", adapter, "--limit", "4"]) == 0
    out = capsys.readouterr().out
    assert "ppo bench" in out and "base" in out and "adapter.gguf" in out


def test_bad_values_are_refused_naming_the_key(chat_model, tmp_path):
    run = write_run(tmp_path, chat_model, {"clip_range": 1.5}, critic={"gae_lambda": 2.0})
    with pytest.raises(ConfigError) as caught:
        load_run(run)
    text = str(caught.value)
    assert "[ppo].clip_range = 1.5" in text
    assert "[ppo.critic].gae_lambda = 2.0" in text or "[ppo.critic].gae_lambda = 2" in text


def test_the_reference_kl_term_holds_the_policy_near_the_reference(chat_model, tmp_path):
    """reference_kl_coefficient > 0: the KL toward the base model (the adapter off) is 0 at
    the first pass (a fresh adapter is the base model), is reported each update after, acts
    from the first pass (unlike kl_coefficient, toward the sampler), and a large coefficient
    ends nearer the reference than a negligible one on the same seeds."""
    from retrograd.algorithms.ppo import run_ppo

    final = {}
    for coef in (1e-9, 5.0):
        tmp = tmp_path / str(coef)
        tmp.mkdir()
        run = write_run(
            tmp,
            chat_model,
            {"updates": 6, "ppo_epochs": 1, "reference_kl_coefficient": coef},
            metrics='tensorboard_dir = "tb"',
        )
        result = run_ppo(load_run(run), run_file=run, sinks=sinks())
        kl = scalars(tmp / "tb", "policy/reference_kl")
        assert sorted(kl) == list(range(1, result.global_step + 1)), kl
        assert kl[1] == pytest.approx(0.0, abs=1e-6)  # the first pass: adapter B = 0
        assert all(v >= 0 for v in kl.values()) and max(kl.values()) > 0
        # toward the sampler: 0 on every first pass, whatever the reference's term does
        assert all(v == 0.0 for v in scalars(tmp / "tb", "policy/kl").values())
        final[coef] = np.mean([kl[s] for s in sorted(kl)[-3:]])
    assert final[5.0] < 0.5 * final[1e-9], final


def test_reference_section_needs_a_term_that_reads_it(chat_model, tmp_path):
    """[reference] with PPO is refused unless reference_kl_coefficient > 0 reads it."""
    ref = f'model = "{chat_model}"'
    run = write_run(tmp_path, chat_model, reference=ref)
    with pytest.raises(ConfigError, match=r"\[reference\].*refused: no KL term"):
        load_run(run)
    run = write_run(tmp_path, chat_model, {"reference_kl_coefficient": 0.1}, reference=ref)
    assert load_run(run).ppo.reference_kl_coefficient == 0.1
    run = write_run(tmp_path, chat_model, {"reference_kl_coefficient": -1})
    with pytest.raises(ConfigError, match=r"\[ppo\]\.reference_kl_coefficient = -1"):
        load_run(run)


def test_the_reference_kl_term_at_the_reference_defaults(chat_model, tmp_path):
    """ctx 128 with the reference's micro_batch (32): with reference_kl_coefficient on, the
    term is summed over the update's tokens whatever the pieces, so one answer a pass gives
    the reference KL and the adapter of passes of several answers (128)."""
    adapters, kls = default_and_wide_passes(
        chat_model,
        tmp_path,
        {"updates": 2, "ppo_epochs": 1, "reference_kl_coefficient": 0.5},
        "policy/reference_kl",
    )
    assert sorted(kls[0]) == [1, 2] and kls[0][2] > 0
    # a KL of ~4e-5 after one small step: the packings' log-probabilities differ by float32
    # rounding (~1e-6), which moves k3 by ~x * dx, far below 1e-6 absolute
    assert kls[0][2] == pytest.approx(kls[1][2], rel=0.05, abs=1e-6), kls
    default, wide = adapters
    moved = sum(float(np.abs(v).sum()) for k, v in wide.items() if k.endswith(".lora_b"))
    diff = sum(float(np.abs(default[k] - wide[k]).sum()) for k in wide)
    assert moved > 0 and diff < 1e-3 * moved, (diff, moved)
