"""Loading run files: TOML errors, every error at once, suggestions, paths and overrides."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from config_runs import run_doc

from retrograd.config import load_run, validate_run
from retrograd.errors import ConfigError

RUN = """
[run]
algorithm = "sft"

[model]
path = "models/m.gguf"

[output]
path = "out/a.gguf"

[lora]

[sft]
data = "data/chat.jsonl"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_paths_resolve_against_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).parent)
    config = load_run(write(tmp_path, RUN))
    assert config.model.path == tmp_path / "models/m.gguf"
    assert config.sft.data == tmp_path / "data/chat.jsonl"
    assert config.output.path == tmp_path / "out/a.gguf"
    assert config.lora.rank == 8 and config.training.ctx == 128


def test_model_and_device_flags_override_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path / "..")
    config = load_run(write(tmp_path, RUN), model="other.gguf", device="cpu")
    assert config.model.path == Path.cwd() / "other.gguf"
    assert config.model.device == "cpu"


def test_model_path_required_unless_given(tmp_path):
    path = write(tmp_path, RUN.replace('path = "models/m.gguf"', ""))
    with pytest.raises(
        ConfigError, match=r"\[model\]\.path: required: set it in the file or pass --model"
    ):
        load_run(path)
    assert load_run(path, model="m.gguf").model.path.name == "m.gguf"


def test_toml_syntax_error_names_line_and_column(tmp_path):
    path = write(tmp_path, RUN.replace('algorithm = "sft"', "algorithm = sft"))
    with pytest.raises(ConfigError) as caught:
        load_run(path)
    assert str(caught.value).startswith(f"{path}:3:13: invalid TOML:")


def test_toml_nested_too_deep_is_an_error_naming_the_place_not_a_recursion_error(tmp_path):
    # arrays and inline tables (tomllib recurses into them) and dotted keys (it does not, but
    # every reader after it does)
    deep = {
        "x = " + "[" * 100_000 + "]" * 100_000: ":15:69: invalid TOML: nested more than 64",
        "x = " + "{a = " * 5_000 + "1" + "}" * 5_000: ":15:325: invalid TOML: nested more than 64",
        "x" + ".x" * 100 + " = 1": ": invalid TOML: nested more than 64 levels deep",
    }
    for line, message in deep.items():
        path = write(tmp_path, RUN + line + "\n")
        with pytest.raises(ConfigError) as caught:
            load_run(path)
        assert str(caught.value).startswith(f"{path}{message}"), str(caught.value)[:200]


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        (["train"], []),
        (["tools", "list"], []),
        (["judge", "eval"], ["--fixtures", "f.jsonl"]),
        (["collect"], ["--out", "o.jsonl"]),
        (["distill-teacher"], []),
    ],
)
def test_commands_that_read_a_run_file_name_toml_nested_too_deep(tmp_path, capsys, command, flags):
    # some commands glance at the file before load_run (is there a [model].path?)
    from retrograd.cli.main import main

    path = write(tmp_path, RUN + "x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert main([*command, str(path), *flags]) != 0
    assert f"{path}:15:69: invalid TOML: nested more than 64 levels deep" in capsys.readouterr().err


def test_toml_integer_of_more_digits_than_python_converts_names_the_place(tmp_path):
    # tomllib raises a plain ValueError (not TOMLDecodeError) for it: it was a traceback
    path = write(tmp_path, RUN + "[training]\nepochs = " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError) as caught:
        load_run(path)
    assert str(caught.value).startswith(f"{path}:16:10: invalid TOML: Exceeds the limit")


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "+inf"])
@pytest.mark.parametrize("key", ["lr", "max_grad_norm"])
def test_a_float_key_refuses_nan_and_the_infinities(tmp_path, key, value):
    # TOML writes them; no float key means them (an lr of inf trained to NaN, a served run's
    # view of it could not be answered as JSON)
    path = write(tmp_path, RUN + f"[training]\n{key} = {value}\n")
    with pytest.raises(ConfigError, match=rf"\[training\]\.{key} = .*: must be a finite number"):
        load_run(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such run file"):
        load_run(tmp_path / "absent.toml")


def test_all_errors_reported_together_with_suggestions(tmp_path):
    text = RUN + "\n[training]\nlerning_rate = 1\nepochs = 0\nmicro_batch = 3\n[grpo]\n[sfft]\n"
    with pytest.raises(ConfigError) as caught:
        load_run(write(tmp_path, text))
    lines = str(caught.value).splitlines()
    source = str(tmp_path / "run.toml")
    assert f"{source}: [training].lerning_rate = 1: unknown key; did you mean lr?" not in lines
    assert f"{source}: [training].lerning_rate = 1: unknown key" in lines
    assert f"{source}: [training].epochs = 0: must be at least 1" in lines
    assert f"{source}: [sfft]: unknown section; did you mean [sft]?" in lines
    assert f'{source}: [grpo]: does not apply to run.algorithm = "sft"; remove it' in lines
    assert len(lines) == 4  # the window rule is skipped while [training] itself is broken
    assert len(caught.value.issues) == 4


def test_misspelled_key_suggests_the_closest(tmp_path):
    doc = run_doc("grpo", grpo={"group_sise": 4, "group_size": None})
    with pytest.raises(ConfigError) as caught:
        validate_run(doc)
    assert "run.toml: [grpo].group_sise = 4: unknown key; did you mean group_size?" in str(
        caught.value
    )
    assert "run.toml: [grpo].group_size: required" in str(caught.value)


def test_rules_still_run_beside_a_broken_section():
    doc = run_doc(training={"micro_batch": 48}, sft={"shuffle": "yes"})
    with pytest.raises(ConfigError) as caught:
        validate_run(doc)
    lines = str(caught.value).splitlines()
    assert 'run.toml: [sft].shuffle = "yes": must be true or false' in lines
    assert any(line.startswith("run.toml: [training].micro_batch = 48:") for line in lines)


def test_strict_types():
    with pytest.raises(ConfigError, match=r"\[training\]\.epochs = 1.5: must be an integer"):
        validate_run(run_doc(training={"epochs": 1.5}))
    assert validate_run(run_doc(training={"lr": 1})).training.lr == 1.0


def test_literal_suggestion_and_required_sections():
    with pytest.raises(ConfigError) as caught:
        validate_run({"run": {"algorithm": "grpoo"}, "lora": {}})
    text = str(caught.value)
    assert (
        'run.toml: [run].algorithm = "grpoo": must be sft, ppo, grpo, distill, preference or agent_grpo; did you mean grpo?'
        in text
    )
    assert "run.toml: [output]: required" in text


def test_algorithm_section_required():
    with pytest.raises(ConfigError, match=r'\[sft\]: required by run.algorithm = "sft"'):
        validate_run(run_doc(sft=None))


def test_top_level_keys_belong_in_sections():
    with pytest.raises(ConfigError, match="run.toml: verbose = true: keys belong in a section"):
        validate_run({**run_doc(), "verbose": True})


def test_unknown_discriminator_suggests():
    doc = run_doc("agent_grpo", agent={"environment": {"type": "containr"}})
    with pytest.raises(
        ConfigError,
        match=r'\[agent.environment\].type = "containr": must be container, http or local; did you mean container\?',
    ):
        validate_run(doc)


def test_distill_mode_checked():
    with pytest.raises(
        ConfigError, match=r'\[distill\].mode = "offline": must be on_policy or topk_offline'
    ):
        validate_run(run_doc("distill", distill={"mode": "offline"}))


def test_grpo_baseline_alias():
    assert validate_run(run_doc("grpo", grpo={"baseline": "rloo"})).grpo.baseline == "leave_one_out"


def test_fanout_values():
    assert validate_run(run_doc("grpo", training={"shared_prefix_fanout": "max"}))
    with pytest.raises(ConfigError, match="must be at least 2"):
        validate_run(run_doc("grpo", training={"shared_prefix_fanout": 1}))
    with pytest.raises(ConfigError, match='must be "auto", "off", "max"'):
        validate_run(run_doc("grpo", training={"shared_prefix_fanout": "all"}))


def test_a_document_of_many_problems_reports_the_first_hundred_and_counts_the_rest():
    """100,000 unknown keys (a 1 MiB body) were 100,000 lines, each with a suggestion
    computed: megabytes of errors and seconds of CPU. The first 100 are reported, then one
    line counts the rest."""
    document = {"run": {"algorithm": "sft"}, "model": {"path": "m.gguf"}, "sft": {"data": "d"}}
    with pytest.raises(ConfigError) as caught:  # its own problems (no such data file)
        validate_run(document, source="run.toml")
    own = len(str(caught.value).splitlines())
    document["training"] = {f"k{i}": 1 for i in range(100_000)}
    document["nope"] = {"a": 1}
    with pytest.raises(ConfigError) as caught:
        validate_run(document, source="run.toml")
    lines = str(caught.value).splitlines()
    assert len(lines) == 101
    assert lines[0] == "run.toml: [training].k0 = 1: unknown key"
    last = re.fullmatch(r"run\.toml: and (\d+) more problems", lines[-1])
    # the keys and the section past the first 100, and those of its own rules still run
    assert last and 100_001 - 100 <= int(last[1]) <= 100_001 - 100 + own, lines[-1]
    assert len(caught.value.issues) == 101
