"""Base tensors trained by the rollout and distillation loops, end to end on tiny F32 models:
ppo, on-policy distillation (with a KL term toward [reference]), offline top-k distillation and
agent_grpo on a partial selection, offline distillation in hybrid mode too. The selected
tensors change, every other one stays byte for byte, and the output is of the kind asked.
(sft, preference and grpo: tests/e2e/test_train_trainable.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import retrograd.algorithms.agent_grpo as agent_grpo
import retrograd.sampling.backend as sampling_backend
from retrograd.cli.main import main
from retrograd.config import load_run
from retrograd.gguf import GGUFFile
from tests.e2e import test_train_agent as agent
from tests.e2e import test_train_distill as distill
from tests.e2e import test_train_ppo as ppo
from tests.e2e.test_train_distill import models  # noqa: F401  (a fixture)
from tests.e2e.test_train_grpo import sinks
from tests.e2e.test_train_sft import CHAT_TEMPLATE
from tests.e2e.test_train_trainable import check_model_copy
from tests.factories.agents import CHAT_TEMPLATE as AGENT_TEMPLATE
from tests.factories.tiny_gguf import write_tiny

# the last two of the tiny gemma3's three layers, two matrices each
SELECTION = 'layers = "last:2"\nmodules = ["attn_v", "ffn_down"]'
SELECTED = {f"blk.{i}.{m}.weight" for i in (1, 2) for m in ("attn_v", "ffn_down")}
# the run-file tables of a partial run that writes the whole model (tests/factories/run_files.py)
PARTIAL = {
    "lora": None,
    "output": {"path": "out/m.gguf", "kind": "model"},
    "trainable": SELECTION,
}


def trained_exactly(base: Path, out: Path, selected: set[str]) -> None:
    """The written model is the base with exactly the selected tensors changed."""
    assert GGUFFile(out).get("general.type") != "retrograd.trainable"
    assert check_model_copy(base, out, selected) == selected


def test_ppo_trains_a_partial_selection(tmp_path):
    """With the critic: the value head trains beside the selection and stays out of the model."""
    from retrograd.algorithms.ppo import run_ppo

    model = write_tiny(tmp_path / "chat.gguf", "gemma3", chat_template=CHAT_TEMPLATE)
    run = ppo.write_run(
        tmp_path,
        model,
        {"updates": 2, "rollout_batch_size": 8},
        training={"trainable": "partial", "lr": 3e-3},
        critic={"enabled": True},
        **PARTIAL,
    )
    result = run_ppo(load_run(run), run_file=run, sinks=sinks())
    assert result.iterations == 2 and result.global_step > 0
    trained_exactly(model, tmp_path / "out" / "m.gguf", SELECTED)


def test_on_policy_distillation_trains_a_partial_selection_toward_a_reference(
    models,  # noqa: F811  (the fixture)
    tmp_path,
):
    """A KL term toward the base needs [reference] once base tensors train (the policy is no
    longer the base with its adapter off): the student's own file serves."""
    from retrograd.algorithms.distill import run_distill

    student, _ = models
    run = distill.write_run(
        tmp_path,
        models,
        {
            "prompts": "prompts.jsonl",
            "updates": 2,
            "prompts_per_update": 2,
            "samples_per_prompt": 2,
            "kl_coefficient": 0.05,
        },
        training={"trainable": "partial", "lr": 1e-3},
        reference={"model": str(student)},
        **PARTIAL,
    )
    result = run_distill(load_run(run), run_file=run, sinks=sinks())
    assert result.iterations == 2 and result.global_step == 2
    trained_exactly(student, tmp_path / "out" / "m.gguf", SELECTED)


@pytest.mark.parametrize("mode", ["partial", "hybrid"])
def test_offline_distillation_trains_base_tensors(models, tmp_path, mode):  # noqa: F811
    """partial writes the model; hybrid (the adapter and every norm) the trained tensors alone,
    in their types, the factors beside them."""
    student, _ = models
    tables = dict(PARTIAL) if mode == "partial" else {"trainable": "norms = true"}
    if mode == "hybrid":
        tables["output"] = {"path": "out/t.gguf"}
    run = distill.write_run(
        tmp_path,
        models,
        dict(distill.OFFLINE, offline_epochs=1),
        training={"trainable": mode, "lr": 1e-3},
        **tables,
    )
    assert main(["distill-teacher", str(run), "--k", "8"]) == 0
    assert main(["train", str(run)]) == 0
    if mode == "partial":
        trained_exactly(student, tmp_path / "out" / "m.gguf", SELECTED)
        return
    out, base = GGUFFile(tmp_path / "out" / "t.gguf"), GGUFFile(student)
    assert out.get("general.type") == "retrograd.trainable"
    assert out.get("retrograd.trainable.mode") == "hybrid"
    norms = {n for n in base.tensors if n.endswith("_norm.weight")}
    targets = ("attn_q", "attn_v", "ffn_down")
    factors = {f"blk.{i}.{t}.weight.lora_{h}" for i in range(3) for t in targets for h in "ab"}
    assert set(out.tensors) == norms | factors
    for name in norms:
        assert out.tensors[name].type_name == base.tensors[name].type_name == "F32"
        assert bytes(out.tensors[name].data) != bytes(base.tensors[name].data), name
    b = np.asarray(out.tensors["blk.2.ffn_down.weight.lora_b"].data, dtype=np.float32)
    assert np.abs(b).max() > 0  # B starts at zero: the adapter trained


def test_agent_grpo_trains_a_partial_selection(tmp_path, monkeypatch):
    """Judged one-turn trajectories, scripted so that every group has signal: even members
    write "eeee", odd ones "abcd" (tests/factories/agent_train.py)."""
    from tests.factories.agent_train import scripted_sampler

    monkeypatch.setattr(sampling_backend, "Sampler", scripted_sampler)
    model = write_tiny(tmp_path / "agent.gguf", "gemma3", chat_template=AGENT_TEMPLATE)
    run = agent.write_run(
        tmp_path,
        model,
        {"updates": 2, "epochs_per_update": 1},
        env=False,
        training={"trainable": "partial", "lr": 1e-3},
        **PARTIAL,
    )
    result = agent_grpo.run_agent_grpo(load_run(run), run_file=run, sinks=sinks())
    assert result.iterations == 2 and result.global_step == 2
    trained_exactly(model, tmp_path / "out" / "m.gguf", SELECTED)
