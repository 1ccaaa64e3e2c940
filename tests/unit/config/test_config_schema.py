"""The JSON Schema, the examples, the generated docs and `retrograd-server config-schema`."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
from config_runs import run_doc

from retrograd.config import json_schema, load_run
from retrograd.config.docs import BEGIN, END, key_tables

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((REPO / "examples").glob("*.toml"))


def validator():
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_schema_is_draft_2020_12_with_our_defaults():
    schema = json_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    training = schema["$defs"]["TrainingSection"]["properties"]
    assert training["micro_batch"]["default"] == 32
    assert training["max_gpu_duty_cycle"]["exclusiveMinimum"] == 0
    assert "description" in training["lr"]
    assert schema["$defs"]["GrpoSection"]["additionalProperties"] is False


def test_schema_refuses_what_the_models_refuse():
    v = validator()
    assert not list(v.iter_errors(run_doc("grpo")))
    assert list(v.iter_errors(run_doc("grpo", sft={"data": "d"})))  # section of another algorithm
    assert list(v.iter_errors(run_doc("grpo", grpo={"group_size": 1})))
    assert list(v.iter_errors(run_doc(training={"lr_rate": 1})))
    assert list(v.iter_errors(run_doc("sft", observe={"directory": "o"})))


def test_every_algorithm_and_mode_has_an_example():
    assert len(EXAMPLES) >= 10
    algorithms, modes = set(), set()
    for path in EXAMPLES:
        config = tomllib.loads(path.read_text())
        algorithms.add(config["run"]["algorithm"])
        modes.add(config.get("training", {}).get("trainable", "lora"))
    assert algorithms == {"sft", "ppo", "grpo", "distill", "preference", "agent_grpo"}
    assert modes == {"lora", "full", "partial", "hybrid"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_valid_for_models_and_schema(path):
    config = load_run(path, model="model.gguf")
    assert config.output.path.is_relative_to(path.parent)
    errors = [e.message for e in validator().iter_errors(tomllib.loads(path.read_text()))]
    assert errors == []


@pytest.mark.parametrize(
    "path", sorted((REPO / "examples").glob("*/*.toml")), ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_worked_examples_validate(path):
    """The worked examples in examples/<algorithm>/ (their data beside them, outputs in out/)."""
    config = load_run(path, model="model.gguf")
    assert config.output.path.resolve().is_relative_to(REPO / "out")
    errors = [e.message for e in validator().iter_errors(tomllib.loads(path.read_text()))]
    assert errors == []


def test_docs_key_tables_in_sync():
    page = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    generated = page.split(BEGIN, 1)[1].split(END, 1)[0]
    assert generated.strip() == key_tables().strip(), (
        "regenerate: python -m retrograd.config.docs docs/configuration.md"
    )


def test_config_schema_command_is_fast_and_torch_free():
    # NOTE: CPU seconds, not wall time: beside other work the wall time stretches with the load
    # (2 s at a load of 14 on 2 cores), the CPU time does not. The command takes about 0.25 s
    # of CPU; importing torch alone takes over 1 s.
    code = (
        "import sys, time; t = time.process_time(); from retrograd.cli.run_server import main;"
        "import retrograd.config; rc = main(['config-schema', '--compact']);"
        "print('torch' in sys.modules, time.process_time() - t, file=sys.stderr); sys.exit(rc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    schema = json.loads(done.stdout)
    assert schema == json_schema()
    torch_loaded, seconds = done.stderr.split()
    assert torch_loaded == "False"
    assert float(seconds) < 1.0


def test_config_schema_help_and_output_file(tmp_path):
    from retrograd.cli.run_server import main

    out = tmp_path / "schema.json"
    assert main(["config-schema", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["title"] == "Retrograd run file"
    with pytest.raises(SystemExit) as caught:
        main(["config-schema", "--help"])
    assert caught.value.code == 0
