"""Configuration built in Python: the section classes check as the run file does and name keys
as it does, a RunConfig built from them obeys the rules between sections exactly as a loaded
file, and `to_toml` writes a run file that `from_toml` reads back equal."""

from __future__ import annotations

import copy
import inspect
import tomllib
from pathlib import Path

import pytest
from config_runs import run_doc
from full_runs import FULL_RUNS
from pydantic import BaseModel
from test_config_rules import CASES

import retrograd.config as config
from retrograd.config import (
    GrpoSampling,
    GrpoSection,
    LoraSection,
    OutputSection,
    RunConfig,
    build_run,
    json_schema,
    load_run,
    validate_run,
)
from retrograd.config.docs import documented_keys
from retrograd.config.load import _adapter
from retrograd.config.report import home_of, section_classes
from retrograd.config.write import dumps
from retrograd.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((REPO / "examples").rglob("*.toml"))


def file_lines(doc, **kwargs) -> list[str]:
    """The error lines of a run file holding `doc`, without the file name."""
    with pytest.raises(ConfigError) as caught:
        validate_run(copy.deepcopy(doc), **kwargs)
    return [line.removeprefix("run.toml: ") for line in str(caught.value).splitlines()]


def python_lines(build) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        build()
    return str(caught.value).splitlines()


def as_objects(doc: dict) -> dict:
    """Each section of `doc` as its class where it validates alone, else the dict itself."""
    out = {}
    for name, value in doc.items():
        try:
            out[name] = _adapter(name).validate_python(value)
        except Exception:
            out[name] = value
    return out


# -- one section ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "patch"),
    [
        ("grpo", {"group_size": 1}),
        ("grpo", {"group_size": 300, "clip_range_low": 1.5, "updates": None}),
        ("grpo", {"sampling": {"temperature": 0.5}}),
        ("grpo", {"grpo_epochs": 1.0, "baseline": "median"}),
        ("lora", {"rank": 0, "targets": ["qq"]}),
        ("lora", {"rnak": 4}),
        ("training", {"lr": 0.0, "threads": 0, "shared_prefix_fanout": 1}),
        ("model", {"device": "tpu"}),
        ("agent", {"environment": {"type": "local", "tools": {"default": "base"}}}),
        ("agent", {"environment": {"type": "docker"}}),
        ("distill", {"mode": "offline"}),
    ],
)
def test_a_section_built_in_python_fails_with_the_run_files_lines(section, patch):
    algorithm = {"grpo": "grpo", "agent": "agent_grpo", "distill": "distill"}.get(section, "grpo")
    doc = run_doc(algorithm, **{section: patch})
    expected = [line for line in file_lines(doc) if line.startswith(f"[{section}")]
    assert expected  # the patch is an error in a file
    cls = {
        "grpo": GrpoSection,
        "lora": LoraSection,
        "training": config.TrainingSection,
        "model": config.ModelSection,
        "agent": config.AgentSection,
    }.get(section)
    if cls is None:  # [distill] is two classes chosen by mode: the run config picks one
        assert python_lines(lambda: RunConfig(**doc)) == expected
        return
    assert python_lines(lambda: cls(**doc[section])) == expected
    assert python_lines(lambda: RunConfig(**doc)) == expected


def test_the_grpo_group_size_error_reads_as_the_cli_writes_it():
    with pytest.raises(ConfigError) as caught:
        GrpoSection(**{**run_doc("grpo")["grpo"], "group_size": 1})
    assert str(caught.value) == "[grpo].group_size = 1: must be at least 2"


def test_a_table_of_several_places_is_named_by_its_class():
    with pytest.raises(ConfigError) as caught:
        GrpoSampling(temperature=0.5, top_p=1.0, max_new_tokens=0, seed=1)
    assert str(caught.value).splitlines() == [
        "GrpoSampling.temperature = 0.5: must be 1.0 (the policy ratio and KL assume "
        "unmodified sampling)",
        "GrpoSampling.max_new_tokens = 0: must be at least 1",
    ]
    with pytest.raises(ConfigError) as caught:
        config.McpServer(name="files", env={"A": 1})
    assert str(caught.value) == "McpServer.env.A = 1: must be a string"
    assert home_of(GrpoSampling) is None
    assert home_of(config.PpoSampling) == ("ppo", "sampling")
    assert home_of(config.ContainerLimits) == ("agent", "environment", "limits")


def test_sections_keep_the_files_types_and_read_paths_as_written():
    assert LoraSection(alpha=16).alpha == 16.0  # an integer where a number goes, as TOML
    with pytest.raises(ConfigError, match=r"\[lora\]\.rank = 4\.0: must be an integer"):
        LoraSection(rank=4.0)
    assert OutputSection(path="out/a.gguf").path == Path("out/a.gguf")  # resolved once placed


def test_the_section_classes_show_their_keys_to_help():
    parameters = inspect.signature(GrpoSection).parameters
    assert {"group_size", "reward_command", "sampling"} <= set(parameters)
    assert parameters["baseline"].default == "mean"
    assert "rank" in inspect.signature(LoraSection).parameters


def test_every_table_of_the_run_file_is_a_public_class():
    exported = set(config.__all__)
    classes = {cls.__name__ for cls in section_classes()}
    assert classes <= exported
    public_classes = {n for n in exported if isinstance(getattr(config, n), type)}
    assert public_classes - {"Selection"} == classes | {"RunConfig"}
    for name in classes:
        assert issubclass(getattr(config, name), BaseModel)


# -- the run config ---------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["sft", "ppo", "grpo", "distill", "preference", "agent_grpo"])
def test_a_run_config_built_in_python_equals_the_loaded_file(algorithm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    doc = run_doc(algorithm)
    loaded = validate_run(copy.deepcopy(doc), base_dir=tmp_path)
    assert RunConfig(**as_objects(doc)) == loaded
    assert RunConfig(**copy.deepcopy(doc)) == loaded
    built = RunConfig(**as_objects(doc))
    assert built.output.path == tmp_path / "out.gguf"  # relative: the current directory
    assert built.output.kind == "adapter"  # the derived default, as the loader fills it in


@pytest.mark.parametrize(
    ("valid", "broken", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_the_rules_between_sections_apply_to_a_config_built_in_python(valid, broken, expected):
    assert RunConfig(**as_objects(copy.deepcopy(valid))) == validate_run(
        copy.deepcopy(valid), base_dir=Path.cwd()
    )
    lines = file_lines(broken, base_dir=Path.cwd())
    assert python_lines(lambda: RunConfig(**as_objects(copy.deepcopy(broken)))) == lines
    assert any(expected.removeprefix("run.toml: ") in line for line in lines)


def test_a_section_object_under_another_sections_name_is_refused():
    doc = run_doc("grpo")
    sections = {**as_objects(doc), "grpo": LoraSection(rank=2)}
    assert python_lines(lambda: RunConfig(**sections)) == [
        "[grpo]: given a LoraSection; [grpo] is a GrpoSection"
    ]
    sections = {**as_objects(doc), "grpo": as_objects(doc)["grpo"].sampling}
    assert python_lines(lambda: RunConfig(**sections)) == [
        "[grpo]: given a GrpoSampling; [grpo] is a GrpoSection"
    ]


# -- what a Python caller supplies --------------------------------------------------------------


def test_reward_functions_replace_the_reward_command_only_when_supplied():
    for algorithm in ("grpo", "ppo"):
        doc = run_doc(algorithm, **{algorithm: {"reward_command": None}})
        assert file_lines(doc) == [f"[{algorithm}].reward_command: required"]
        cfg = build_run(as_objects(doc), supplied={"rewards"})
        assert cfg.algorithm_section.reward_command is None
    # the file's schema and the key table still say so
    for name in ("GrpoSection", "PpoSection"):
        assert "reward_command" in json_schema()["$defs"][name]["required"]
    page = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert "| `reward_command` | list of string | required |" in page
    with pytest.raises(ValueError, match="supplied"):
        build_run(as_objects(run_doc()), supplied={"reward"})


def test_a_python_environment_counts_as_the_agents_environment():
    judged = run_doc("agent_grpo")
    bare = run_doc("agent_grpo", agent={"judge": None})
    assert file_lines(bare) == [
        "[agent]: needs an [agent.judge], an [agent.environment], or both, to score trajectories"
    ]
    assert build_run(bare, supplied={"environment"}).agent.environment is None
    assert build_run(bare, supplied={"environment", "verify"}).agent.judge is None
    assert file_lines(judged, supplied={"verify"}) == [
        "[agent]: a Python verify function checks the episodes of an environment; declare an "
        "[agent.environment] or give a Python environment"
    ]
    local = {"type": "local", "allow_unsandboxed": True, "tools": {"default": "base"}}
    both = run_doc("agent_grpo", agent={"environment": local})
    assert file_lines(both, supplied={"environment"}) == [
        "[agent.environment]: a Python environment is given too; remove the table or the "
        "Python environment"
    ]
    shared = run_doc("agent_grpo", agent={"mcp_servers": [{"name": "m", "command": ["m"]}]})
    validate_run(copy.deepcopy(shared))  # no environment: a stateful server is fine
    assert file_lines(shared, supplied={"environment"}) == [
        "[agent.mcp_servers][0].stateless = false: must be true when [agent.environment] is "
        "declared: trajectories share the server"
    ]


# -- reading and writing run files ------------------------------------------------------------


def test_examples_round_trip_through_to_toml(tmp_path):
    assert len(EXAMPLES) >= 15
    for path in EXAMPLES:
        cfg = RunConfig.from_toml(path, model="model.gguf")
        saved = tmp_path / path.relative_to(REPO / "examples").as_posix().replace("/", "-")
        text = cfg.to_toml(saved)
        assert saved.read_text(encoding="utf-8") == text
        assert RunConfig.from_toml(saved) == cfg, path
        assert load_run(saved) == cfg


@pytest.fixture
def quiet():
    """from_toml applies [run].verbose to the `retrograd` logger: put it back."""
    yield
    from retrograd.observe.log import configure_logging

    configure_logging(False)


@pytest.mark.parametrize("name", sorted(FULL_RUNS))
def test_runs_with_every_key_set_round_trip(name, tmp_path, quiet):
    cfg = validate_run(copy.deepcopy(FULL_RUNS[name]), base_dir=tmp_path / "elsewhere")
    saved = tmp_path / "run.toml"
    cfg.to_toml(saved)
    again = RunConfig.from_toml(saved)
    assert again == cfg
    assert again.to_toml() == cfg.to_toml()
    # the keys set stay set, so "read only with ..." rules read the file as they read the config
    assert _set_keys(again) == _set_keys(cfg)


def test_the_full_runs_set_every_key_of_every_table_away_from_its_default(tmp_path):
    changed: set[tuple[str, str]] = set()
    for doc in FULL_RUNS.values():
        cfg = validate_run(copy.deepcopy(doc), base_dir=tmp_path)
        for name in cfg.model_fields_set:
            section = getattr(cfg, name)
            if section is not None:
                changed |= _changed_keys(section, name)
    single = {(t, k) for t, k in documented_keys() if _only_value(t, k)}
    missing = set(documented_keys()) - changed - single
    assert not missing, sorted(missing)


def test_to_toml_leaves_no_temporary_file_and_replaces_the_old_one(tmp_path):
    cfg = RunConfig(**as_objects(run_doc("grpo")))
    path = tmp_path / "run.toml"
    path.write_text("old", encoding="utf-8")
    cfg.to_toml(path)
    assert [p.name for p in tmp_path.iterdir()] == ["run.toml"]
    assert RunConfig.from_toml(path) == cfg


def test_the_writer_escapes_strings_and_quotes_keys():
    doc = {
        "t": {
            "plain": 'a "quoted" \\ back\tslash\nnew line \x7f \x00 é 😀',
            "a key": 1,
            "é": -2.5e-12,
            "big": 10**18,
            "floats": [1.0, 1e300, -0.0],
            "nested": [[1, 2], ["a"], []],
            "inline": [{"x": 1}, 2],
            "sub": {"k": True, "deeper": {"z": "y"}},
            "items": [{"a": 1, "sub": {"b": 2}}, {"a": 3}],
        }
    }
    assert tomllib.loads(dumps(doc)) == doc
    assert 'a key" = 1' in dumps(doc) and "\\u007f" in dumps(doc)


def test_the_writer_names_a_value_toml_cannot_hold():
    with pytest.raises(ConfigError, match=r"\[t\]\.x: cannot be written as TOML"):
        dumps({"t": {"x": [1, None]}})
    with pytest.raises(ConfigError, match=r"\[t\]\.y: cannot be written as TOML"):
        dumps({"t": {"y": "\ud800"}})


def _set_keys(cfg) -> dict:
    return {
        name: getattr(cfg, name).model_dump(exclude_unset=True)
        for name in type(cfg).model_fields
        if getattr(cfg, name) is not None
    }


def _changed_keys(section: BaseModel, table: str) -> set[tuple[str, str]]:
    """(table, key) of every key whose value differs from its default, in the tables' names
    of the key tables (arrays by name, maps as NAME)."""
    found = set()
    for key, field in type(section).model_fields.items():
        value = getattr(section, key)
        if isinstance(value, BaseModel):
            found |= _changed_keys(value, f"{table}.{key}")
        elif isinstance(value, list) and value and isinstance(value[0], BaseModel):
            for item in value:
                found |= _changed_keys(item, f"{table}.{key}")
        elif (
            isinstance(value, dict) and value and isinstance(next(iter(value.values())), BaseModel)
        ):
            for item in value.values():
                found |= _changed_keys(item, f"{table}.{key}.NAME")
        elif key in section.model_fields_set and value != field.default:
            found.add((table, key))
    return found


def _only_value(table: str, key: str) -> bool:
    """Keys that hold one value only (gefen's codebook, levels and partition)."""
    import typing

    for cls in section_classes():
        field = cls.model_fields.get(key)
        if field is not None and typing.get_origin(field.annotation) is typing.Literal:
            if len(typing.get_args(field.annotation)) == 1 and table.endswith("gefen"):
                return True
    return False


def test_the_configuration_example_of_the_python_page_runs(tmp_path, monkeypatch):
    page = (REPO / "docs" / "python.md").read_text(encoding="utf-8")
    section = page.split("\n## Configuration\n", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/python.md", "exec"), {})
    assert RunConfig.from_toml(tmp_path / "run.toml").grpo.group_size == 8


def test_an_empty_run_config_names_what_it_needs_in_python_words():
    assert python_lines(lambda: RunConfig()) == [
        "[run]: required",
        "[output]: required",
        "[model].path: required: give ModelSection(path=...)",
    ]
    assert "[model].path: required: set it in the file or pass --model" in file_lines(
        run_doc(model={"path": None})
    )


def test_loading_never_goes_through_the_python_constructors():
    """pydantic calls a model's own __init__ for nested tables unless it is marked as its base
    one: marked, a file's problems are collected from every section at once, and building a
    RunConfig inside validate_run does not recurse into the loader."""
    for cls in (*section_classes(), RunConfig):
        assert cls.__pydantic_custom_init__ is False, cls
    doc = run_doc("grpo", grpo={"group_size": 1, "sampling": {"seed": -1}}, lora={"rank": 0})
    assert file_lines(doc) == [
        "[lora].rank = 0: must be at least 1",
        "[grpo].group_size = 1: must be at least 2",
        "[grpo.sampling].seed = -1: must be at least 0",
    ]
