"""The compute plan: built once from the environment and the run file, carried by every forward
pass, printed at a run's start; and every switch it holds has an equality test."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import retrograd
from retrograd import compute, environ
from retrograd.errors import ConfigError
from tests.factories.run_files import write_run_file

REPO = Path(__file__).resolve().parents[2]


def training(**fields):
    """A run file's [training] section with these values (the rest as documented)."""
    from retrograd.config.training import TrainingSection

    return TrainingSection(**fields)


def test_the_environment_wins_over_the_run_file_over_the_default(monkeypatch):
    for name in environ.BY_NAME:
        monkeypatch.delenv(name, raising=False)
    t = training(threads=3, fast_sampling_context=False, kv_dtype="f32")
    plan = compute.ComputePlan.of(environ.read(), training=t, where="[training]")
    assert plan.threads.intra == 3 and plan.source("threads") == "[training].threads"
    assert (plan.sampling.fast_context, plan.sampling.kv_dtype) == (False, "f32")
    assert plan.weights.cache == "auto" and plan.source("cache") == "default"
    monkeypatch.setenv("RETRO_THREADS", "1")
    monkeypatch.setenv("RETRO_DEQUANT_CACHE", "0")
    monkeypatch.setenv("RETRO_FAST_TOP_P", "0")
    plan = compute.ComputePlan.of(environ.read(), training=t, cache="on", where="[training]")
    assert plan.threads.intra == 1 and plan.source("threads") == "RETRO_THREADS=1"
    assert plan.weights.cache == "off" and plan.source("cache") == "RETRO_DEQUANT_CACHE=0"
    assert plan.sampling.top_p == "exact"
    assert plan.compile and plan.source("RETRO_COMPILE") == "default"


def test_load_builds_the_plan_and_reports_it(tiny_model, monkeypatch):
    monkeypatch.setenv("RETRO_DEQUANT_CACHE", "off")
    monkeypatch.setenv("RETRO_THREADS", "1")
    monkeypatch.setenv("RETRO_DTYPE", "float32")
    m = retrograd.load(tiny_model("llama3"), device="cpu", cache="on")
    assert m.decoder.plan is m.report.plan and not m.report.cache
    assert "dequantized-weight cache off" in m.report.describe()
    assert m.report.describe().endswith("; RETRO_DEQUANT_CACHE=off)")
    compute_line, sampling_line = m.report.lines()
    assert compute_line.startswith(
        "compute: float32 (RETRO_DTYPE=float32), 1 threads (RETRO_THREADS=1)"
    )
    assert "decode graph off: float32 compute" in compute_line
    assert sampling_line.startswith("sampling: in-process, fast context, kv f16, device sampling")
    torch.set_num_threads(2)


def test_garbage_in_any_variable_stops_the_load_naming_it(tiny_model, monkeypatch):
    """Before the table, RETRO_COMPILE=fasle loaded and compiled."""
    monkeypatch.setenv("RETRO_COMPILE", "fasle")
    with pytest.raises(ConfigError, match="RETRO_COMPILE=fasle: must be 1, true, on, yes or 0"):
        retrograd.load(tiny_model("llama3"), device="cpu")


def test_a_forward_reads_the_overlay_then_the_installed_plan_then_the_environment(monkeypatch):
    monkeypatch.setenv("RETRO_COMPILE", "0")
    assert compute.current() == compute.ForwardPlan(compile=False)
    compute.install(compute.ComputePlan(compile=True))
    assert compute.current() == compute.ForwardPlan(compile=True)
    overlay = compute.SamplingPlan().forward(True, compute.current())
    with compute.using(overlay):
        assert compute.current().fast_decode
        assert compute.current().packed == {torch.bfloat16, torch.float32}
    assert compute.current() == compute.ForwardPlan(compile=True)
    compute.install(None)
    assert not compute.current().compile


def test_exact_sampling_packs_no_float32_products():
    exact = compute.SamplingPlan().forward(False, compute.ForwardPlan())
    assert exact == compute.ForwardPlan(packed=frozenset({torch.bfloat16}))
    unpacked = compute.SamplingPlan(packed=False).forward(True, compute.ForwardPlan())
    assert unpacked.packed == frozenset() and unpacked.fast_decode


def test_a_run_installs_its_plan_and_prints_it(tiny_model, tmp_path, capsys, monkeypatch):
    from retrograd.cli.main import main

    monkeypatch.setenv("RETRO_COMPILE", "0")
    (tmp_path / "data.txt").write_text("the cat sat on the mat. the dog sat on the log.\n")
    training = {"lr": 0.005, "ctx": 32, "micro_batch": 16, "threads": 1}
    training["fast_sampling_context"] = False
    tables = {"training": training, "sft": {"data": "data.txt"}}
    run = write_run_file(tmp_path, "sft", tiny_model("llama"), tables)
    assert main(["train", str(run)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert ", 1 threads ([training].threads), OpenMP wait " in out
    assert "fused kernels eager (RETRO_COMPILE=0)" in out
    assert "sampling: in-process, exact context" in out
    assert compute.installed() is not None and not compute.installed().compile
    torch.set_num_threads(2)


# Each switch of the plan -> the tests that its fast path equals the plain one (docs/exactness.md
# lists them). A new field of ComputePlan without a row here fails.
EQUALITY_TESTS = {
    "compile": [
        "tests/unit/test_compiled.py::test_retro_compile_0_is_the_plain_function",
        "tests/unit/model/test_decoder.py::test_fused_bf16_block_equals_unfused",
        "tests/unit/model/test_attention.py::test_attention_matches_sdpa",
    ],
    "dtype": ["tests/unit/model/test_decoder.py::test_bf16_path_stays_close_to_f32"],
    "weights.cache": [
        "tests/unit/model/test_decoder.py::test_dense_cache_on_and_off_give_identical_logits",
        "tests/unit/model/test_decoder.py::test_dense_cache_on_and_off_give_identical_gradients",
        "tests/unit/model/test_decoder.py::test_grouped_projections_equal_separate_ones",
        # "int8": 8-bit rows, within a stated distance (not exact)
        "tests/unit/model/test_int8.py::test_products_and_input_gradient_equal_the_float_product_of_the_8bit_weight",
        "tests/unit/model/test_int8.py::test_bf16_products_stay_within_bf16_rounding_of_the_float_product",
        "tests/unit/model/test_int8.py::test_a_model_kept_in_8_bits_stays_close_to_the_plain_path_and_holds_no_dense_copy",
        "tests/unit/model/test_int8.py::test_8_bit_lora_gradients_stay_close_to_the_plain_path",
        "tests/unit/model/test_int8.py::test_stacked_8_bit_products_equal_one_product_each_and_hold_nothing_twice",
        "tests/unit/model/test_logprobs.py::test_tiled_head_equals_plain",
    ],
    "weights.products": [],  # "dequantize" alone so far
    "sampling.backend": [
        "tests/unit/sampling/test_llamacpp.py::test_the_same_answers_as_the_in_process_sampler",
        "tests/unit/sampling/test_llamacpp.py::test_behaviour_logprobs_equal_the_trainers_rescoring",
        "tests/unit/sampling/test_llamacpp.py::test_the_adapter_changes_the_logits_as_ours_does",
    ],
    "sampling.fast_context": [
        "tests/unit/sampling/test_sampling_engine.py::test_fast_context_stays_close_to_the_exact_one",
        "tests/unit/model/test_attention.py::test_fast_decode_step_matches_the_matmul_path",
        "tests/unit/model/test_decode.py::test_decode_graph_equals_the_layer_by_layer_path",
        "tests/unit/model/test_decode.py::test_the_decode_graph_has_no_graph_break",
    ],
    "sampling.kv_dtype": [
        "tests/unit/sampling/test_sampling_engine.py::test_fast_context_stays_close_to_the_exact_one",
    ],
    "sampling.packed": [
        "tests/unit/model/test_decoder.py::test_packed_float32_products_only_for_fast_sampling",
        "tests/unit/model/test_decoder.py::test_packed_group_products_equal_one_product_each",
        "tests/unit/model/test_decode.py::test_without_bf16_packing_bf16_decoding_runs_layer_by_layer",
    ],
    "sampling.device_sampling": [
        "tests/unit/sampling/test_sampling_engine.py::test_host_and_device_sampling_agree_in_the_engine",
        "tests/unit/sampling/test_sampling_select.py::test_host_and_device_sampling_give_the_same_distribution",
    ],
    "sampling.device_logprobs": [
        "tests/unit/sampling/test_sampling_select.py::test_logprobs_device_equal_host_oracle",
    ],
    "sampling.top_p": [
        "tests/unit/sampling/test_sampling_engine.py::test_the_top_candidates_answer_what_the_full_sort_answers",
        "tests/unit/sampling/test_sampling_select.py::test_fast_top_p_falls_back_when_the_top_candidates_are_not_enough",
    ],
    "sampling.prefix_cache": [
        "tests/unit/sampling/test_sampling_turns.py::test_kept_keys_and_values_sample_what_a_fresh_prefill_samples",
    ],
}
# Fields that choose where or how much, not a faster way to the same numbers.
NOT_SWITCHES = {
    "device",
    "threads.intra",
    "threads.interop",
    "threads.wait",
    "weights.budget_fraction",
    "weights.int8_fraction",
    "require_gpu_resident",
    "sources",
}


def _fields(cls, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        kind = getattr(compute, str(f.type), None)
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            out += _fields(kind, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def test_every_switch_has_an_equality_test():
    fields = set(_fields(compute.ComputePlan))
    assert fields - NOT_SWITCHES == set(EQUALITY_TESTS), "a switch without its equality test row"
    forward = {f.name for f in dataclasses.fields(compute.ForwardPlan)}
    assert forward == {"compile", "fast_decode", "packed", "fuse"}  # each read above
    page = (REPO / "docs" / "exactness.md").read_text(encoding="utf-8")
    for ids in EQUALITY_TESTS.values():
        for test_id in ids:
            path, name = test_id.split("::")
            tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
            names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert name in names, f"{test_id} does not exist"
            assert name in page, f"docs/exactness.md does not list {test_id}"


def test_the_run_files_rollout_backend_is_the_plans():
    from retrograd.config.training import TrainingSection

    plan = compute.ComputePlan.of(
        environ.read(), training=TrainingSection(rollout_backend="llama_cpp")
    )
    assert plan.sampling.backend == "llama_cpp" and "llama_cpp" in compute.BACKENDS
    assert compute.ComputePlan.of(environ.read()).sampling.backend == "in_process"


def test_a_new_weight_mode_is_refused_until_it_plugs_in():
    with pytest.raises(ValueError, match="cache = 'layers': must be one of auto, on, off, int8"):
        compute.ComputePlan.of(environ.Environ(), cache="layers")
    with pytest.raises(ConfigError, match="RETRO_DEQUANT_CACHE=layers: must be auto, on, off"):
        environ.read({"RETRO_DEQUANT_CACHE": "layers"})
    plan = compute.ComputePlan.of(environ.read({"RETRO_DEQUANT_CACHE": "int8"}))
    assert plan.weights.cache == "int8"
