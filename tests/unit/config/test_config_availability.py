"""The "At run time" column of docs/configuration.md is true: each key it calls honoured loads,
each key it calls refused is refused when the file loads (naming the key), and the keys of
algorithms and modes that do not train yet are refused by `train` itself."""

from __future__ import annotations

import pytest
from config_runs import SECTIONS, run_doc

from retrograd.config import validate_run
from retrograd.config.availability import (
    ELSEWHERE,
    HONOURED,
    LATER,
    NOT_READ,
    UNAVAILABLE,
    availability,
    entry_key,
)
from retrograd.config.docs import documented_keys
from retrograd.errors import ConfigError

MUON = {"training": {"optimizer": "muon"}, "lora": {"dtype": "f32"}}
EVAL = {"data": "e.jsonl"}
CKPT = {"directory": "ck", "mode": "steps", "every_steps": 5}

ENDPOINT = {"base_url": "http://127.0.0.1:1/v1", "model": "m", "api_key_env": "KEY"}


def agent_run(**agent) -> dict:
    """A patch making run_doc()'s sft run an agent_grpo one, with `agent` keys added."""
    judge = {"type": "command", "command": ["python3", "judge.py"]}
    return {
        "run": {"algorithm": "agent_grpo"},
        "sft": None,
        "agent": {"scenarios": "s.jsonl", "judge": judge, **agent},
    }


# Entry -> sections merged into a valid sft run that set the key(s) to a value other than the
# default; the run must load with that value.
ACCEPTED: dict[tuple[str, str], dict] = {
    ("agent.collect_api", "*"): agent_run(collect_api=ENDPOINT),
    ("agent.scenario_generation", "*"): agent_run(scenario_generation=ENDPOINT),
    ("run", "algorithm"): {"run": {"algorithm": "sft"}},
    ("run", "verbose"): {"run": {"verbose": True}},
    ("model", "path"): {"model": {"path": "other.gguf"}},
    ("model", "device"): {"model": {"device": "cpu"}},
    ("output", "path"): {"output": {"path": "o/a.gguf"}},
    ("output", "kind"): {"output": {"kind": "adapter"}},
    ("lora", "rank"): {"lora": {"rank": 4}},
    ("lora", "alpha"): {"lora": {"alpha": 4.0}},
    ("lora", "seed"): {"lora": {"seed": 7}},
    ("lora", "targets"): {"lora": {"targets": ["q", "v"]}},
    ("lora", "dtype"): {"lora": {"dtype": "f32"}},
    ("lora", "init_adapter"): {"lora": {"init_adapter": "a.gguf"}},
    ("training", "trainable"): {"training": {"trainable": "lora"}},
    ("trainable", "*"): {
        "lora": None,
        "training": {"trainable": "partial"},
        "trainable": {"norms": True},
    },
    ("optimizer.gefen", "*"): {
        "lora": None,
        "training": {"trainable": "full", "optimizer": "gefen"},
        "optimizer": {"gefen": {"variant": "quantized_m", "block_size": 256}},
    },
    ("training", "optimizer"): {"training": {"optimizer": "sgd"}},
    ("training", "lr"): {"training": {"lr": 0.01}},
    ("training", "lr_scheduler"): {"training": {"lr_scheduler": "cosine"}},
    ("training", "warmup_steps"): {"training": {"warmup_steps": 3}},
    ("training", "weight_decay"): {"training": {"weight_decay": 0.1}},
    ("training", "max_grad_norm"): {"training": {"max_grad_norm": 0.5}},
    ("training", "epochs"): {"training": {"epochs": 3}},
    ("training", "ctx"): {"training": {"ctx": 64}},
    ("training", "micro_batch"): {"training": {"micro_batch": 16}},
    ("training", "gradient_accumulation"): {"training": {"gradient_accumulation": 2}},
    ("training", "threads"): {"training": {"threads": 2}},
    ("training", "fast_sampling_context"): {"training": {"fast_sampling_context": False}},
    ("training", "kv_dtype"): {"training": {"kv_dtype": "f32"}},
    ("training", "gradient_checkpointing"): {"training": {"gradient_checkpointing": True}},
    ("training", "checkpoint_every_n_layers"): {
        "training": {"gradient_checkpointing": True, "checkpoint_every_n_layers": 2}
    },
    ("training", "checkpoint_dtype"): {
        "training": {"gradient_checkpointing": True, "checkpoint_dtype": "bf16"}
    },
    ("training", "chunked_cross_entropy"): {"training": {"chunked_cross_entropy": False}},
    ("training", "chunked_ce_tiles"): {"training": {"chunked_ce_tiles": 4}},
    ("training", "chunked_ce_seq_chunk"): {"training": {"chunked_ce_seq_chunk": 0}},
    ("training", "require_gpu_resident"): {"training": {"require_gpu_resident": True}},
    ("training", "max_gpu_duty_cycle"): {"training": {"max_gpu_duty_cycle": 0.5}},
    ("training", "parallel"): {"training": {"parallel": "ddp"}},
    ("training", "dist_timeout_seconds"): {"training": {"dist_timeout_seconds": 60}},
    ("optimizer.muon", "fallback_learning_rate"): {
        **MUON,
        "optimizer": {"muon": {"fallback_learning_rate": 0.01}},
    },
    ("optimizer.muon", "*"): {**MUON, "optimizer": {"muon": {"momentum": 0.95}}},
    ("evaluation", "data"): {"evaluation": EVAL},
    ("evaluation", "every_iterations"): {"evaluation": {**EVAL, "every_iterations": 2}},
    ("evaluation", "patience"): {"evaluation": {**EVAL, "patience": 2}},
    ("evaluation", "min_delta"): {"evaluation": {**EVAL, "min_delta": 0.01}},
    ("checkpoint", "*"): {"checkpoint": {**CKPT, "resume_from": "ck/step-5.state"}},
    ("metrics", "*"): {"metrics": {"tensorboard_dir": "tb", "wandb_export_dir": "wb"}},
    ("sft", "*"): {
        "sft": {"data_format": "jsonl", "shuffle": False, "template_variables": {"x": 1}}
    },
    ("ppo", "*"): {
        "run": {"algorithm": "ppo"},
        "sft": None,
        "ppo": {
            **SECTIONS["ppo"]["ppo"],
            "critic": {"gamma": 0.99, "gae_lambda": 0.9, "feature_dtype": "bf16"},
        },
    },
    ("grpo", "*"): {
        "run": {"algorithm": "grpo"},
        "sft": None,
        "grpo": {**SECTIONS["grpo"]["grpo"], "baseline": "rloo", "prompt_order": "shuffled"},
    },
    ("distill", "*"): {
        "run": {"algorithm": "distill"},
        "sft": None,
        "distill": {
            "teacher_path": "t.gguf",
            "prompts": "p.jsonl",
            "updates": 3,
            "prompts_per_update": 2,
            "samples_per_prompt": 2,
            "weight_clip": 3.0,
            "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8, "seed": 1},
        },
    },
    ("agent", "*"): {
        "run": {"algorithm": "agent_grpo"},
        "sft": None,
        "agent": {
            "scenarios": "s.jsonl",
            "group_size": 4,
            "max_turns": 3,
            "environment": {
                "type": "local",
                "allow_unsandboxed": True,
                "tools": {"default": "base"},
            },
        },
    },
    ("reference", "ctx"): {
        "run": {"algorithm": "grpo"},
        "sft": None,
        "grpo": {**SECTIONS["grpo"]["grpo"], "kl_coefficient": 0.1},
        "reference": {"model": "r.gguf", "ctx": 256},
    },
    ("preference", "*"): {
        "run": {"algorithm": "preference"},
        "sft": None,
        "preference": {"data": "pairs.jsonl", "loss": "ipo", "beta": 0.5, "pairs_per_step": 4},
    },
}

# Entry -> (sections that set a value the run would ignore or this version cannot honour, the
# start of the error line).
REFUSED: dict[tuple[str, str], tuple[dict, str]] = {
    ("training", "generation_concurrency"): (
        {"training": {"generation_concurrency": 2}},
        "[training].generation_concurrency = 2: read only by runs that generate",
    ),
    ("training", "generation_batch"): (
        {"training": {"generation_batch": 2}},
        "[training].generation_batch = 2: read only by runs that generate",
    ),
    ("training", "shared_prefix_fanout"): (
        {"training": {"shared_prefix_fanout": "off"}},
        '[training].shared_prefix_fanout = "off": read only by runs that score answers',
    ),
    ("training", "rollout_backend"): (
        {"training": {"rollout_backend": "llama_cpp"}},
        '[training].rollout_backend = "llama_cpp": samples the answers of ppo and grpo only; '
        "sft samples nothing",
    ),
    ("training", "rollout_is_cap"): (
        {"training": {"rollout_is_cap": 3.0}},
        '[training].rollout_is_cap = 3.0: read only with rollout_backend = "llama_cpp"',
    ),
    ("training", "checkpoint_every_n_layers"): (
        {"training": {"checkpoint_every_n_layers": 2}},
        "[training].checkpoint_every_n_layers = 2: needs gradient_checkpointing = true",
    ),
    ("training", "checkpoint_dtype"): (
        {"training": {"checkpoint_dtype": "f16"}},
        '[training].checkpoint_dtype = "f16": needs gradient_checkpointing = true',
    ),
    ("training", "chunked_ce_tiles"): (
        {"training": {"chunked_cross_entropy": False, "chunked_ce_tiles": 4}},
        "[training].chunked_ce_tiles = 4: needs chunked_cross_entropy = true",
    ),
    ("training", "chunked_ce_seq_chunk"): (
        {"training": {"chunked_cross_entropy": False, "chunked_ce_seq_chunk": 64}},
        "[training].chunked_ce_seq_chunk = 64: needs chunked_cross_entropy = true",
    ),
    ("training", "master_weights"): (
        {"training": {"master_weights": "f32"}},
        '[training].master_weights = "f32": applies to trained f16/bf16 base weights',
    ),
    ("optimizer.muon", "*"): (
        {**MUON, "optimizer": {"muon": {"ns_steps": 3}}},
        '[optimizer.muon].ns_steps = 3: Muon updates no matrix when training.trainable = "lora"',
    ),
    ("optimizer.gefen", "*"): (
        {"training": {"optimizer": "gefen"}, "lora": {"dtype": "f32"}},
        '[training].optimizer = "gefen": not available in this version',
    ),
    ("evaluation", "max_examples"): (
        {"evaluation": {**EVAL, "max_examples": 3}},
        "[evaluation].max_examples = 3: read only by rollout algorithms",
    ),
    ("observe", "*"): ({"observe": {"directory": "obs"}}, "[observe]: only ppo, grpo"),
    ("reference", "*"): ({"reference": {"model": "r.gguf"}}, "[reference]: refused"),
}

# Entries of trainable modes `train` refuses, and a valid run of each.
MODE_RUNS: dict[tuple[str, str], dict] = {}  # keys of modes that validate but do not train


def entries_of(*kinds: str) -> set[tuple[str, str]]:
    return {entry_key(t, k) for t, k in documented_keys() if availability(t, k).kind in kinds}


def test_every_documented_key_has_a_column_and_a_check():
    checked = set(ACCEPTED) | set(REFUSED) | set(MODE_RUNS)
    assert entries_of(HONOURED, ELSEWHERE) <= set(ACCEPTED)
    assert entries_of(NOT_READ, UNAVAILABLE) <= set(REFUSED)
    assert entries_of(LATER) <= set(MODE_RUNS)
    assert {entry_key(t, k) for t, k in documented_keys()} == checked


@pytest.mark.parametrize("entry", sorted(ACCEPTED), ids=".".join)
def test_honoured_key_loads_with_its_value(entry):
    config = validate_run(run_doc(**ACCEPTED[entry]))
    table, key = entry
    if key != "*":
        section = config
        for part in table.split("."):
            section = getattr(section, part)
        assert section.is_set(key)


@pytest.mark.parametrize("entry", sorted(REFUSED), ids=".".join)
def test_refused_key_names_itself(entry):
    patch, expected = REFUSED[entry]
    with pytest.raises(ConfigError) as caught:
        validate_run(run_doc(**patch))
    lines = str(caught.value).splitlines()
    assert any(line.startswith(f"run.toml: {expected}") for line in lines), lines


@pytest.mark.parametrize("value", [1.0, 0.999, 0.25], ids=["default", "just-below", "quarter"])
def test_every_duty_cycle_in_range_loads(value):
    assert validate_run(run_doc(training={"max_gpu_duty_cycle": value})).training.is_set(
        "max_gpu_duty_cycle"
    )


def test_defaults_written_out_are_accepted():
    """Every key written with its default value loads (the switched keys included)."""
    validate_run(
        run_doc(
            training={
                "master_weights": "auto",
                "checkpoint_every_n_layers": 4,
                "checkpoint_dtype": "f32",
                "chunked_cross_entropy": False,
                "chunked_ce_tiles": 8,
                "chunked_ce_seq_chunk": 512,
                "max_gpu_duty_cycle": 1.0,
                **MUON["training"],
            },
            lora={"dtype": "f32"},
            optimizer={"muon": {"momentum": 0.95, "nesterov": True, "ns_steps": 5}},
        )
    )


def test_muon_matrix_keys_load_where_base_matrices_train():
    validate_run(
        run_doc(
            lora=None,
            training={"trainable": "partial", "optimizer": "muon"},
            trainable={"modules": "attn"},
            optimizer={"muon": {"momentum": 0.9, "ns_steps": 3}},
        )
    )


def test_gefen_refusal_does_not_repeat_the_f32_rule():
    with pytest.raises(ConfigError) as caught:
        validate_run(run_doc(training={"optimizer": "gefen"}))
    assert str(caught.value).splitlines() == [
        'run.toml: [training].optimizer = "gefen": not available in this version '
        "(adapters train with adamw, sgd or muon)"
    ]


def test_train_has_a_loop_for_every_algorithm():
    import typing

    from retrograd.algorithms import table
    from retrograd.config.core import Algorithm

    assert set(table.names()) == set(typing.get_args(Algorithm))
    assert not entries_of(LATER) - set(MODE_RUNS)  # no algorithm is left for later


def test_sft_trains_every_mode():
    """No trainable mode is left for later: sft builds a plan for each (tests/e2e)."""
    assert not entries_of(LATER)


GRPO_UNAVAILABLE = {
    "fanout max": (
        {"training": {"shared_prefix_fanout": "max"}},
        "[training].shared_prefix_fanout = 'max': not available in this version",
    ),
}


@pytest.mark.parametrize("case", sorted(GRPO_UNAVAILABLE))
def test_grpo_refuses_what_its_loop_cannot_honour(case):
    """The file is valid (the reference allows these values); `train` refuses them before
    anything loads."""
    from retrograd.algorithms.grpo import check_available

    patch, expected = GRPO_UNAVAILABLE[case]
    config = validate_run(run_doc("grpo", **patch))
    with pytest.raises(ConfigError) as caught:
        check_available(config)
    assert str(caught.value).startswith(expected), str(caught.value)


@pytest.mark.parametrize(
    "judge",
    [
        {"type": "command", "command": ["j"]},
        {"type": "ruler", "base_url": "http://127.0.0.1:1/v1", "model": "j"},
    ],
    ids=["command", "ruler"],
)
def test_grpo_and_agent_grpo_accept_both_judges(judge):
    from retrograd.algorithms import agent_grpo, grpo

    grpo.check_available(validate_run(run_doc("grpo", training={"shared_prefix_fanout": "off"})))
    grpo.check_available(validate_run(run_doc("grpo", grpo={"judge_weight": 0.5, "judge": judge})))
    agent = {"judge": {"command": None, **judge}}  # None drops the default command
    agent_grpo.check_available(validate_run(run_doc("agent_grpo", agent=agent)))
