"""retrograd.Trainer on tiny models: each fit_* writes the adapter `retrograd train` writes from
the equivalent run file, byte for byte (the seven run files of tests/invariants/
test_loops_pinned.py); a Python reward function equal to a reward program trains the same
adapter; errors name the argument as the run file names the key; a reward function that
raises or returns NaN fails as a failing reward program does; train_grpo_batch makes the
update a run makes; callbacks stop a fit; help(retrograd.Trainer) shows the docstrings."""

from __future__ import annotations

import json
import math
import pydoc
import sys
from pathlib import Path

import numpy as np
import pytest

import retrograd
from retrograd.api import RolloutGroup, Trainer
from retrograd.cli.main import main
from retrograd.config import load_run
from retrograd.config.document import ALGORITHM_SECTIONS
from retrograd.config.write import section_document
from retrograd.errors import ConfigError, DataError, RewardError
from tests.invariants.test_loops_pinned import (
    LOOPS,
    PROMPTS,
    WRITERS,
    pinned_process,
    write_models,
)

FITS = {
    "sft": "fit_sft",
    "distill_offline": "fit_distill",
    "preference": "fit_preference",
    "grpo": "fit_grpo",
    "ppo": "fit_ppo",
    "distill_on_policy": "fit_distill",
    "agent_grpo": "fit_agentic_grpo",
}
ROLLOUTS = ("grpo", "ppo", "distill_on_policy", "agent_grpo")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return write_models(tmp_path_factory.mktemp("api"))


def plain(section) -> dict | None:
    """A section as the dict a Python caller writes (its set keys, nested tables as dicts)."""
    if section is None:
        return None
    return json.loads(json.dumps(section_document(section), default=str))


def tensors(path) -> dict[str, np.ndarray]:
    from gguf import GGUFReader

    return {t.name: np.array(t.data, dtype=np.float32) for t in GGUFReader(path).tensors}


def trainer_of(cfg, **kw) -> Trainer:
    """The Trainer a Python caller writes for a run file's shared sections, given as dicts."""
    return Trainer(
        str(cfg.model.path),
        device="cpu",
        lora=plain(cfg.lora),
        training=plain(cfg.training),
        reference=plain(cfg.reference),
        progress=False,
        **kw,
    )


def fit_like(trainer: Trainer, cfg, name: str, tmp: Path, **kw) -> dict:
    """The fit a Python caller writes for the run file's algorithm and run settings."""
    section = getattr(cfg, ALGORITHM_SECTIONS[cfg.run.algorithm])
    checkpoint = {**plain(cfg.checkpoint), "directory": str(tmp / "ck-python")}
    settings = {"output": tmp / "python.gguf", "checkpoint": checkpoint, **kw}
    if cfg.evaluation is not None:
        settings["evaluation"] = plain(cfg.evaluation)
    return getattr(trainer, FITS[name])(plain(section), **settings)


@pytest.mark.slow
@pytest.mark.parametrize("name", LOOPS)
def test_every_fit_writes_the_adapter_retrograd_train_writes(name, models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pinned_process(forced=name == "agent_grpo"):
        run = WRITERS[name](tmp_path, models)
        assert main(["train", str(run)]) == 0
        cfg = load_run(run)
        with trainer_of(cfg) as trainer:
            summary = fit_like(trainer, cfg, name, tmp_path)
    want = (tmp_path / "out" / "adapter.gguf").read_bytes()
    assert summary["output"] == str(tmp_path / "python.gguf") and summary["global_step"] > 0
    assert (tmp_path / "python.gguf").read_bytes() == want
    assert any((tmp_path / "ck-python").iterdir())  # the fit's [checkpoint] was honoured


@pytest.mark.slow
def test_a_trainer_from_the_run_file_fits_as_retrograd_train_does(models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pinned_process(forced=False):
        run = WRITERS["sft"](tmp_path, models)
        assert main(["train", str(run)]) == 0
        want = (tmp_path / "out" / "adapter.gguf").read_bytes()
        (tmp_path / "out" / "adapter.gguf").unlink()
        with Trainer.from_toml(run, progress=False) as trainer:
            summary = trainer.fit()
            assert trainer.config == load_run(run)
    assert summary["output"] == str(tmp_path / "out" / "adapter.gguf")
    assert (tmp_path / "out" / "adapter.gguf").read_bytes() == want


# -- GRPO: Python rewards ---------------------------------------------------------------------


def share_of_e(prompts, completions, **_):
    """The reward program of the pinned GRPO run (the share of "e" in the answer), in Python."""
    return [c.count("e") / max(1, len(c)) for c in completions]


def grpo_file(tmp: Path, models) -> tuple[object, dict]:
    run = WRITERS["grpo"](tmp, models)
    cfg = load_run(run)
    return cfg, plain(cfg.grpo)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "steps"), [("grpo", 6), ("ppo", 4)])
def test_a_python_reward_equal_to_the_program_trains_the_same_adapter(
    name, steps, models, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    with pinned_process(forced=False):
        cfg = load_run(WRITERS[name](tmp_path, models))
        section = plain(getattr(cfg, name))
        with trainer_of(cfg) as trainer:
            by_program = fit_like(trainer, cfg, name, tmp_path, output=tmp_path / "program.gguf")
        del section["reward_command"]
        updates = []
        with trainer_of(cfg) as trainer:
            by_function = getattr(trainer, FITS[name])(
                section,
                rewards=[share_of_e],
                output=tmp_path / "function.gguf",
                evaluation=plain(cfg.evaluation),
                on_update=updates.append,
            )
    assert (tmp_path / "function.gguf").read_bytes() == (tmp_path / "program.gguf").read_bytes()
    assert by_function["global_step"] == by_program["global_step"] == steps
    assert by_function["best_eval"] == pytest.approx(by_program["best_eval"])
    members = [r for g in updates[0].groups for r in g.members]
    assert [r.reward_raw for r in members] == pytest.approx(
        share_of_e(None, [r.text for r in members])
    )


def raising(prompts, completions, **_):
    raise ZeroDivisionError("the reward's own bug")


def nan_for_the_second(prompts, completions, **_):
    return [math.nan if i == 1 else 0.5 for i in range(len(completions))]


@pytest.mark.parametrize(
    ("function", "message"),
    [
        (raising, r"reward function raising \(rewards\[0\]\): batch 0: raised ZeroDivisionError"),
        (nan_for_the_second, r"reward function nan_for_the_second \(rewards\[0\]\): batch 0: "
         r"value 1 is not finite \(nan\)"),
    ],
)  # fmt: skip
def test_a_reward_function_that_raises_or_returns_nan_fails_as_a_reward_program_does(
    function, message, models, tmp_path, monkeypatch
):
    """A RewardError naming the function and the batch, the run ended cleanly (no export),
    and the Trainer still trains afterwards."""
    monkeypatch.chdir(tmp_path)
    with pinned_process(forced=False):
        cfg, grpo = grpo_file(tmp_path, models)
        del grpo["reward_command"]
        grpo.update(updates=1, grpo_epochs=1)
        with trainer_of(cfg) as trainer:
            with pytest.raises(RewardError, match=message) as caught:
                trainer.fit_grpo(grpo, rewards=[function], output=tmp_path / "bad.gguf")
            assert not (tmp_path / "bad.gguf").exists()
            summary = trainer.fit_grpo(grpo, rewards=[share_of_e], output=tmp_path / "ok.gguf")
    if function is raising:
        assert isinstance(caught.value.__cause__, ZeroDivisionError)
    assert summary["global_step"] == 1 and (tmp_path / "ok.gguf").exists()


# -- agentic GRPO: a Python environment and verify function ----------------------------------


def counting(seed: int, turn: int) -> str:
    """Forced turns: some seeds add 3 (the target), the others 1 (`solves`); then the answer
    ends."""
    from tests.factories.agents import call

    return call("add", n=3 if solves(seed) else 1) if turn == 0 else "done"


def solves(seed: int) -> bool:
    """Which trajectories reach the target: a rule that splits each group of this run."""
    return seed % 4 < 2


def agentic_fit(models, tmp: Path, monkeypatch, verify):
    """One update of agentic GRPO on the tiny model, 2 scenarios x 2 forced trajectories, in
    the CounterEnvironment class with `verify` -> (summary, the update's event, the env)."""
    import retrograd.sampling.backend as sampling_backend
    from tests.factories.agents import CounterEnvironment, Scripted

    monkeypatch.chdir(tmp)
    scenarios = [
        {"id": f"count-{i}", "user": "reach 3", "metadata": {"target": 3}} for i in range(2)
    ]
    (tmp / "scenarios.jsonl").write_text("".join(json.dumps(x) + "\n" for x in scenarios))
    agent = {
        "scenarios": "scenarios.jsonl",
        "updates": 1,
        "scenarios_per_update": 2,
        "group_size": 2,
        "epochs_per_update": 1,
        "kl_coefficient": 0.0,
        "max_turns": 2,
        "max_new_tokens_per_turn": 64,
    }
    updates = []
    environment = CounterEnvironment()
    training = {"lr": 1e-2, "ctx": 1024, "micro_batch": 1024}
    with pinned_process(forced=False):
        scripted = lambda decoder, tokenizer, **_: Scripted(decoder, tokenizer, counting)  # noqa: E731
        monkeypatch.setattr(sampling_backend, "Sampler", scripted)
        with Trainer(models["student"], device="cpu", training=training, progress=False) as t:
            summary = t.fit_agentic_grpo(
                agent, environment=environment, verify=verify, on_update=updates.append
            )
    return summary, updates[0], environment


def total_added(request) -> int:
    return sum(c.arguments["n"] for c in request.calls if c.name == "add")


@pytest.mark.slow
def test_an_agentic_fit_takes_a_python_environment_and_verify_function(
    models, tmp_path, monkeypatch
):
    """No [agent.environment]: the CounterEnvironment class acts, the verify function grades
    each finished episode from its calls, and its verdict is the trajectory's reward."""
    graded: list[tuple[str, int]] = []

    def verify(request):
        graded.append((request.scenario["id"], total_added(request)))
        return total_added(request) == 3

    summary, update, environment = agentic_fit(models, tmp_path, monkeypatch, verify)
    assert summary["global_step"] == 1 and summary["stopped"] is None
    assert environment.opened == 4
    assert sorted(i for i, _ in graded) == ["count-0"] * 2 + ["count-1"] * 2
    members = [r for g in update.groups for r in g.members]
    assert len(members) == 4
    assert [r.reward_raw for r in members] == [float(solves(r.seed)) for r in members]
    assert {total for _, total in graded} == {1, 3}


@pytest.mark.slow
def test_a_verify_function_that_raises_fails_its_trajectory_not_the_fit(
    models, tmp_path, monkeypatch
):
    """As a failing environment does: the trajectory is dropped, named, and the fit goes on."""

    def verify(request):
        if request.scenario["id"] == "count-1" and total_added(request) != 3:
            raise ZeroDivisionError("the checker's own bug")
        return total_added(request) == 3

    summary, update, _ = agentic_fit(models, tmp_path, monkeypatch, verify)
    assert summary["stopped"] is None and summary["iterations"] == 1
    assert summary["global_step"] == 1  # the other scenario's group trained
    members = [r for g in update.groups for r in g.members]
    failures = [r.extra["sample"].traj.failure for r in members]
    assert [f for f in failures if f] == [
        "scenario count-1: verify function verify raised ZeroDivisionError: the checker's own bug"
    ]
    assert update.values["agent/failed_fraction"] == 0.25


# -- train_grpo_batch -------------------------------------------------------------------------


def one_update(cfg, grpo: dict, tmp: Path, **kw):
    """A one-update GRPO fit (no evaluation, no KL) -> (its groups, its adapter's bytes)."""
    grpo = {**grpo, "updates": 1, "kl_coefficient": 0.0, **kw}
    updates = []
    with trainer_of(cfg) as trainer:
        trainer.fit_grpo(grpo, output=tmp / "run.gguf", on_update=updates.append)
    return updates[0].groups, (tmp / "run.gguf").read_bytes()


def as_groups(groups, behaviour=None) -> list[RolloutGroup]:
    return [
        RolloutGroup(
            g.prompt.ids,
            [r.ids for r in g.members],
            [r.reward_raw for r in g.members],
            None if behaviour is None else [behaviour(r) for r in g.members],
        )
        for g in groups
    ]


@pytest.mark.slow
def test_train_grpo_batch_makes_the_update_a_run_makes(models, tmp_path, monkeypatch):
    """The groups a one-update run sampled, given back as ids and rewards, change a fresh
    adapter exactly as that run's update did; the run's [grpo] loss keys apply."""
    monkeypatch.chdir(tmp_path)
    with pinned_process(forced=False):
        cfg, grpo = grpo_file(tmp_path, models)
        groups, want = one_update(cfg, grpo, tmp_path)
        loss = {k: grpo[k] for k in ("grpo_epochs", "clip_range_low", "clip_range_high")}
        with trainer_of(cfg) as trainer:
            values = trainer.train_grpo_batch(as_groups(groups), grpo=loss)
            trainer.save_adapter(tmp_path / "batch.gguf")
    assert (tmp_path / "batch.gguf").read_bytes() == want
    assert values["optimizer/steps"] == 2 == grpo["grpo_epochs"]
    rewards = [r.reward_raw for g in groups for r in g.members]
    assert values["reward/mean"] == pytest.approx(np.mean(rewards))


@pytest.mark.slow
def test_train_grpo_batch_weighs_tokens_by_the_behaviour_policys_ratio(
    models, tmp_path, monkeypatch
):
    """Behaviour log-probabilities equal to the policy's own (the run's first pass) give
    every token the weight min(pi / mu, C) = 1: the adapter of the run; raised by log 2
    (mu = 2 pi, capped at 1) they weigh each token by 1/2 or more, which the update reports
    and its loss and adapter show."""
    monkeypatch.chdir(tmp_path)
    with pinned_process(forced=False):
        cfg, grpo = grpo_file(tmp_path, models)
        groups, want = one_update(cfg, grpo, tmp_path, grpo_epochs=1)
        loss = {"grpo_epochs": 1}
        with trainer_of(cfg) as trainer:
            unweighted = trainer.train_grpo_batch(as_groups(groups), grpo=loss)
        with trainer_of(cfg) as trainer:
            same = trainer.train_grpo_batch(as_groups(groups, lambda r: r.old_logprobs), grpo=loss)
            trainer.save_adapter(tmp_path / "same.gguf")
        with trainer_of(cfg) as trainer:
            halved = as_groups(groups, lambda r: np.minimum(r.old_logprobs + math.log(2), 0.0))
            half = trainer.train_grpo_batch(halved, grpo=loss)
            trainer.save_adapter(tmp_path / "half.gguf")
    assert same["policy/sampler_is_weight_mean"] == 1.0
    assert (tmp_path / "same.gguf").read_bytes() == want
    assert "policy/sampler_is_weight_mean" not in unweighted
    assert 0.5 <= half["policy/sampler_is_weight_mean"] < 1.0
    assert half["policy/sampler_is_truncated_fraction"] == 0.0
    assert half["policy/surrogate_loss"] != unweighted["policy/surrogate_loss"]
    assert (tmp_path / "half.gguf").read_bytes() != want


def test_train_grpo_batch_names_the_place_of_bad_input(models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with Trainer(models["student"], device="cpu", progress=False) as trainer:
        with pytest.raises(
            ConfigError, match=r"^groups\[0\]\.rewards\[1\] = nan: must be a finite"
        ):
            trainer.train_grpo_batch([([1, 2, 3], [[4, 5], [6]], [1.0, math.nan])])
        with pytest.raises(ConfigError, match=r"^groups\[1\]: 2 completions and 1 rewards"):
            trainer.train_grpo_batch([([1, 2], [[4], [5]], [0, 1]), ([1, 2], [[4], [5]], [0])])
        with pytest.raises(ConfigError, match=r"^groups\[0\]\.completions\[0\]: -1 is not a token"):
            trainer.train_grpo_batch([([1, 2], [[-1], [5]], [0, 1])])
        with pytest.raises(
            ConfigError, match=r"^groups\[0\]\.logprobs\[1\]: 1 log-probabilities for 2"
        ):
            trainer.train_grpo_batch([([1, 2], [[4], [5, 6]], [0, 1], [[-1.0], [-1.0]])])
        with pytest.raises(ConfigError, match=r"^\[grpo\]\.clip_range_low = 2\.0: "):
            trainer.train_grpo_batch([([1, 2], [[4], [5]], [0, 1])], grpo={"clip_range_low": 2.0})


def test_the_python_pages_own_rollouts_example_runs(models, tmp_path, monkeypatch):
    """docs/python.md's train_grpo_batch block, on a tiny model: one update of one group."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "python.md").read_text("utf-8")
    section = page.split("\n### Your own rollouts: train_grpo_batch\n", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    with Trainer(models["student"], device="cpu", progress=False) as trainer:
        namespace = {"trainer": trainer}
        exec(compile(code, "docs/python.md", "exec"), namespace)
        values = namespace["values"]
    assert values["reward/mean"] == 0.5 and values["optimizer/steps"] == 1
    assert math.isfinite(values["train/loss"])


def test_train_grpo_batch_under_a_decaying_schedule_needs_the_batches_it_spans(
    models, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    group = [([1, 2, 3], [[4, 5], [6, 7]], [1.0, 0.0])]
    training = {"lr_scheduler": "linear"}
    with Trainer(models["student"], device="cpu", training=training, progress=False) as trainer:
        with pytest.raises(ConfigError, match=r'^\[training\]\.lr_scheduler = "linear": the sch'):
            trainer.train_grpo_batch(group)
        first = trainer.train_grpo_batch(group, grpo={"updates": 2})
        second = trainer.train_grpo_batch(group, grpo={"updates": 2})
        assert first["optimizer/learning_rate"] == 1e-4 > second["optimizer/learning_rate"] > 0
        with pytest.raises(ConfigError, match=r"batch 3 is past \[grpo\]\.updates = 2"):
            trainer.train_grpo_batch(group, grpo={"updates": 2})


# -- errors, callbacks, configuration ---------------------------------------------------------


def test_errors_name_the_argument_as_the_run_file_names_the_key(models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as caught:
        Trainer(models["student"], lora={"rank": 0}, training={"lr": -1.0, "ctx": 8.5})
    lines = str(caught.value).splitlines()
    assert "[lora].rank = 0: must be at least 1" in lines
    assert any(line.startswith("[training].lr = -1.0: ") for line in lines)
    assert any(line.startswith("[training].ctx = 8.5: ") for line in lines)
    with pytest.raises(
        ConfigError, match=r"^\[lora\]: given a TrainingSection; \[lora\] is a LoraSection"
    ):
        Trainer(models["student"], lora=retrograd.TrainingSection())
    with Trainer(models["student"], device="cpu", progress=False) as trainer:
        with pytest.raises(ConfigError, match=r"\[grpo\]\.group_size = 1: must be at least 2"):
            trainer.fit_grpo({"group_size": 1}, rewards=[share_of_e])
        with pytest.raises(ConfigError, match=r"^\[sft\]: required by fit_sft"):
            trainer.fit_sft()
        with pytest.raises(ConfigError, match=r'^\[training\]\.kv_dtype = "f32": the Trainer\'s'):
            trainer.fit_sft({"data": "data.txt"}, training={"kv_dtype": "f32"})
        with pytest.raises(ConfigError, match=r"\[grpo\]\.reward_command: required"):
            grpo = retrograd.GrpoSection(
                prompts="p.jsonl", updates=1, prompts_per_update=1, group_size=2,
                grpo_epochs=1, clip_range_low=0.2, clip_range_high=0.28, kl_coefficient=0.0,
                sampling={"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 4, "seed": 0},
            )  # fmt: skip
            trainer.fit_grpo(grpo)  # no reward function, no program


def sft_setup(tmp: Path, models) -> object:
    run = WRITERS["sft"](tmp, models)
    return load_run(run)


@pytest.mark.slow
def test_callbacks_see_the_steps_and_stop_the_fit(models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    steps, evaluations = [], []
    with pinned_process(forced=False):
        cfg = sft_setup(tmp_path, models)
        on_step = lambda e: steps.append(e) or e.global_step == 2  # noqa: E731
        with trainer_of(cfg, on_evaluate=evaluations.append) as trainer:
            summary = trainer.fit_sft(
                plain(cfg.sft), evaluation=plain(cfg.evaluation), on_step=on_step
            )
            assert summary["stopped"] == "callback" and summary["global_step"] == 2
            assert [e.global_step for e in steps] == [1, 2]
            # a second fit trains on from the first one's adapter; on_evaluate stops it
            first = trainer.logprobs("the cat", " sat on the mat").sum()
            stop = lambda e: evaluations.append(e) or True  # noqa: E731
            again = trainer.fit_sft(
                plain(cfg.sft), evaluation=plain(cfg.evaluation), on_evaluate=stop
            )
            assert again["stopped"] == "callback" and again["iterations"] == 1
            assert trainer.logprobs("the cat", " sat on the mat").sum() != first
    assert evaluations and all(e.values["eval/loss"] > 0 for e in evaluations)


@pytest.mark.slow
def test_a_fit_resumes_from_its_checkpoint_as_retrograd_train_resume_does(
    models, tmp_path, monkeypatch
):
    """Stopped by a callback after step 2 (a steps checkpoint there), then resumed by a new
    Trainer with resume=True: the adapter of the run that never stopped, byte for byte."""
    monkeypatch.chdir(tmp_path)
    with pinned_process(forced=False):
        cfg = sft_setup(tmp_path, models)
        sft, evaluation = plain(cfg.sft), plain(cfg.evaluation)

        def fit(name: str, **kw) -> dict:
            checkpoint = {"directory": str(tmp_path / name), "mode": "steps", "every_steps": 2}
            with trainer_of(cfg) as trainer:
                return trainer.fit_sft(
                    sft, evaluation=evaluation, checkpoint=checkpoint,
                    output=tmp_path / f"{name}.gguf", **kw,
                )  # fmt: skip

        whole = fit("whole")
        stopped = fit("part", on_step=lambda e: e.global_step == 2)
        resumed = fit("part", resume=True)
    assert stopped["stopped"] == "callback" and stopped["global_step"] == 2
    assert resumed["global_step"] == whole["global_step"] > 2
    assert (tmp_path / "part.gguf").read_bytes() == (tmp_path / "whole.gguf").read_bytes()


def test_from_toml_and_to_toml_round_trip(models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = WRITERS["grpo"](tmp_path, models)
    trainer = Trainer.from_toml(run, progress=False)
    assert trainer.config == load_run(run)
    trainer.config.to_toml(tmp_path / "again.toml")
    assert Trainer.from_toml(tmp_path / "again.toml").config == trainer.config
    # a Trainer built in Python has the config of its last fit, a run file retrograd reads
    with Trainer(models["student"], device="cpu", lora={"rank": 2}, progress=False) as python:
        assert python.config is None
        with pytest.raises(DataError):  # the fit fails on its data, after its config is made
            python.fit_sft({"data": "missing.txt"}, output="out/x.gguf")
        text = python.config.to_toml()
        assert load_run_text(tmp_path, text) == python.config
        assert python.config.lora.rank == 2 and python.config.model.device == "cpu"


def load_run_text(tmp: Path, text: str):
    (tmp / "written.toml").write_text(text)
    return load_run(tmp / "written.toml")


def test_help_shows_every_methods_docstring():
    text = pydoc.render_doc(retrograd.Trainer, renderer=pydoc.plaintext)
    methods = (
        "fit", "fit_sft", "fit_grpo", "fit_ppo", "fit_preference", "fit_distill",
        "fit_agentic_grpo", "train_grpo_batch", "save_adapter", "save", "generate",
        "logprobs", "close", "from_toml",
    )  # fmt: skip
    for name in methods:
        doc = pydoc.getdoc(getattr(retrograd.Trainer, name))
        missing = [line for line in doc.splitlines() if line.strip() not in text]
        assert doc and not missing, (name, missing)
    assert "Train a GGUF model from Python" in text
    assert retrograd.list_backends()[0].name == "cpu"
    assert "Trainer" in retrograd.__all__ and "RolloutGroup" in dir(retrograd)


def test_generate_and_logprobs_read_the_trained_adapter(models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with Trainer(models["student"], device="cpu", progress=False) as trainer:
        ids = trainer.model.tokenize("the cat", add_bos=True)
        text = trainer.generate(PROMPTS[0], max_new_tokens=4)
        again = trainer.generate(PROMPTS[0], max_new_tokens=4)
        assert text == again and isinstance(text, str)
        lps = trainer.logprobs(ids, [5, 6, 7])
        assert lps.shape == (3,) and bool((lps <= 0).all())
        np.testing.assert_allclose(
            lps.numpy(), trainer.model.logprobs([*ids, 5, 6, 7])[-3:].numpy()
        )
        path = trainer.save_adapter(tmp_path / "initial.gguf")
        assert path.exists() and not list(tmp_path.glob("*.tmp*"))
    with pytest.raises(Exception, match="closed"):
        trainer.generate("x")


def test_save_refuses_to_write_over_what_the_trainer_reads(models, tmp_path, monkeypatch):
    """save_adapter and save name their path and write nothing where the path is the model
    (or a link to it), an input of the last fit, or a folder; the model's bytes stay."""
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model.gguf"
    model.write_bytes(Path(models["student"]).read_bytes())
    before = model.read_bytes()
    (tmp_path / "link.gguf").symlink_to(model)
    (tmp_path / "folder").mkdir()
    with Trainer(str(model), device="cpu", progress=False) as trainer:
        for target in (model, tmp_path / "link.gguf"):
            with pytest.raises(ConfigError, match=r"is the model \(\[model\]\.path\)"):
                trainer.save_adapter(target)
            with pytest.raises(ConfigError, match="writing it would destroy that input"):
                trainer.save(target)
        with pytest.raises(ConfigError, match="a folder; name a file"):
            trainer.save_adapter(tmp_path / "folder")
        assert trainer.save_adapter(tmp_path / "fine.gguf").exists()
    assert model.read_bytes() == before


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
