"""Tool definitions, toolsets and the resolved catalog: built-in toolsets, id@version lookup,
include/replace/deny, exec tools in both protocols, errors that name their place, hashes and
the resume signature."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from retrograd.agent.local import LocalSandbox
from retrograd.agent.tools.catalog import load_catalog
from retrograd.agent.types import Observation
from retrograd.config.agent import ToolsConfig
from retrograd.errors import ConfigError, EnvironmentFailure

BASE = ["bash", "read_file", "write_file", "edit_file", "list_dir", "grep", "submit"]


def tools_config(**keys) -> ToolsConfig:
    return ToolsConfig.model_validate({"default": "base", **keys})


def catalog_of(tmp_path: Path, definitions: str = "", **keys):
    """A catalog from one definition file `tools.toml` (when given) and inline keys."""
    if definitions:
        (tmp_path / "tools.toml").write_text(textwrap.dedent(definitions))
        keys.setdefault("files", ["tools.toml"])
    return load_catalog(tools_config(**keys), tmp_path)


@pytest.fixture
def sandbox(tmp_path):
    box = LocalSandbox(exec_timeout=10.0, parent=tmp_path)
    yield box
    box.close()


def names(catalog, toolset=None) -> list[str]:
    return [spec.name for spec in catalog.specs(toolset)]


def refs(catalog, toolset=None) -> list[str]:
    return [entry.ref for entry in catalog.entries(toolset)]


def test_builtin_toolsets(tmp_path):
    catalog = catalog_of(tmp_path, default="python", scenario_toolsets=["typescript", "base"])
    assert catalog.selectable == ("python", "typescript", "base")
    assert names(catalog, "base") == BASE
    assert names(catalog) == BASE + ["python", "run_tests"]
    assert refs(catalog, "python")[-2:] == ["python@1", "pytest@1"]
    assert refs(catalog, "typescript")[-2:] == ["node@1", "npm_test@1"]
    assert all(ref.endswith("@1") for ref in refs(catalog, "typescript"))
    npm = catalog.entries("typescript")[-1]
    assert npm.tool.argv == ["npm", "test", "--silent"]
    assert catalog.entries("python")[-1].tool.argv == ["python3", "-m", "pytest", "-q"]


def test_unversioned_reference_is_the_latest(tmp_path):
    catalog = catalog_of(
        tmp_path,
        """
        [[tool]]
        id = "bash"
        version = 2
        description = "Run a command."
        builtin = { factory = "shell" }

        [toolset.latest]
        tools = ["bash", "submit"]

        [toolset.pinned]
        tools = ["bash@1"]
        """,
        scenario_toolsets=["latest", "pinned"],
    )
    latest = catalog.entries("latest")[0]
    assert latest.ref == "bash@2" and latest.spec.description == "Run a command."
    assert latest.spec.input_schema == catalog.entries("pinned")[0].spec.input_schema
    assert refs(catalog, "pinned") == ["bash@1"]


def test_include_replace_and_deny(tmp_path):
    catalog = catalog_of(
        tmp_path,
        """
        [[tool]]
        id = "shell"
        version = 1
        name = "bash"
        description = "A shell that replaces bash by name."
        builtin = { factory = "shell", params = { program = "sh" } }

        [toolset.coding]
        include = ["python"]
        tools = ["shell@1"]
        deny = ["*_file", "grep"]
        """,
        default="coding",
    )
    # bash@1 (same exposed name) is replaced where shell@1 lands: after the included tools
    assert names(catalog) == ["list_dir", "submit", "python", "run_tests", "bash"]
    assert refs(catalog)[-1] == "shell@1"
    assert catalog.entries()[-1].tool.program == "sh"


def test_a_tool_replaces_an_included_one_with_the_same_id(tmp_path):
    catalog = catalog_of(
        tmp_path,
        """
        [[tool]]
        id = "grep"
        version = 2
        name = "search"
        builtin = { factory = "grep" }

        [toolset.s]
        include = ["base"]
        tools = ["grep@2"]
        """,
        default="s",
    )
    assert names(catalog) == [n for n in BASE if n != "grep"] + ["search"]


@pytest.mark.parametrize(
    ("definitions", "message"),
    [
        (
            '[[tool]]\nid = "bash"\nversion = 1\nbuiltin = { factory = "shell" }\n',
            "tools.toml: [[tool]] bash@1: bash@1 is defined already (built-in: [[tool]] bash@1)",
        ),
        (
            '[toolset.base]\ntools = ["bash"]\n',
            "tools.toml: [toolset.base]: toolset base is defined",
        ),
        (
            '[[tool]]\nid = "x"\nversion = 1\nbuiltin = { factory = "nope" }\n',
            "tools.toml: [[tool]] x@1: unknown factory 'nope'",
        ),
        (
            '[[tool]]\nid = "x"\nversion = 1\n',
            "tools.toml: [[tool]] x@1: needs exactly one of builtin and exec",
        ),
        (
            '[[tool]]\nid = "x"\nversion = 1\nexec = { argv = ["a"], protocol = "xml" }\n',
            "tools.toml: [[tool]] x@1: exec.protocol must be text or json",
        ),
        (
            '[[tool]]\nid = "x"\nversion = 0\nexec = { argv = ["a"] }\n',
            "tools.toml: [[tool]] 1 (x): version must be an integer of at least 1",
        ),
        (
            '[[tool]]\nid = "x"\nversion = 1\nexec = { argv = ["a"], script = "gone.py" }\n',
            "tools.toml: [[tool]] x@1: cannot read exec.script",
        ),
        (
            '[[tool]]\nid = "r"\nversion = 2\nbuiltin = { factory = "read_file" }\n'
            'input_schema = { type = "object", properties = {} }\n',
            "tools.toml: [[tool]] r@2: a builtin tool keeps its own input_schema",
        ),
        (
            '[[tool]]\nid = "r"\nversion = 2\nbuiltin = { factory = "read_file", params = '
            "{ a = 1 } }\n",
            "tools.toml: [[tool]] r@2: builtin read_file: factory takes no params",
        ),
        (
            '[[tool]]\nid = "py"\nversion = 1\nbuiltin = { factory = "interpreter", params = '
            '{ language = "py" } }\n',
            "tools.toml: [[tool]] py@1: builtin interpreter: params.argv must be a non-empty",
        ),
        (
            '[toolset.t]\ntools = ["bash@7"]\n',
            "tools.toml: [toolset.t]: unknown tool bash@7 (defined: bash@1)",
        ),
        ('[toolset.t]\ntools = ["nothing"]\n', "tools.toml: [toolset.t]: unknown tool nothing"),
        ('[toolset.t]\ninclude = ["u"]\n[toolset.u]\ninclude = ["t"]\n', "include each other"),
        ('[toolset.t]\ninclude = ["base"]\ndeny = ["*"]\n', "[toolset.t]: the toolset selects no"),
        ('[toolset.t]\nallow = ["bash"]\n', 'tools.toml: [toolset.t]: unknown key "allow"'),
        ("[tools]\nx = 1\n", 'unknown key "tools"'),
    ],
)
def test_definition_errors_name_the_place(tmp_path, definitions, message):
    with pytest.raises(ConfigError) as error:
        catalog_of(tmp_path, definitions)
    assert message in str(error.value)


def test_inline_definitions_and_their_errors(tmp_path):
    (tmp_path / "say.sh").write_text('echo "said: $(cat)"\n')
    catalog = load_catalog(
        tools_config(
            default="mine",
            tool=[
                {
                    "id": "say",
                    "version": 1,
                    "description": "Say it.",
                    "exec": {"argv": ["sh", "-c"], "script": "say.sh"},
                }
            ],
            toolset={"mine": {"tools": ["say", "submit@1"]}},
        ),
        tmp_path,
    )
    assert refs(catalog) == ["say@1", "submit@1"]
    assert catalog.entries()[0].tool.argv == ["sh", "-c", 'echo "said: $(cat)"\n']
    with pytest.raises(ConfigError, match=r"\[agent.environment.tools\]: \[toolset.t\]: unknown"):
        load_catalog(tools_config(toolset={"t": {"tools": ["nope"]}}), tmp_path)
    with pytest.raises(ConfigError, match=r"scenario_toolsets: unknown toolset missing"):
        load_catalog(tools_config(scenario_toolsets=["missing"]), tmp_path)


def test_text_exec_tool_gets_its_arguments_on_stdin(tmp_path, sandbox):
    scripts = tmp_path / "defs"
    scripts.mkdir()
    (scripts / "echo.py").write_text("import sys; print('got ' + sys.stdin.read()); sys.exit(2)")
    (scripts / "tools.toml").write_text(
        '[[tool]]\nid = "echo"\nversion = 1\nexec = { argv = ["python3", "-c"], script = '
        '"echo.py" }\n[toolset.e]\ntools = ["echo"]\n'
    )
    # files are relative to the run file, scripts to the file that declares them
    catalog = load_catalog(tools_config(default="e", files=["defs/tools.toml"]), tmp_path)
    entry = catalog.entries()[0]
    assert entry.spec.input_schema == {"type": "object", "properties": {}}
    out = entry.tool.call(sandbox, {"b": [1, "é"], "a": None})
    assert out.content == 'exit code: 2\nstdout:\ngot {"b": [1, "é"], "a": null}\n'
    assert out.is_error and not out.done


JSON_TOOL = """
[[tool]]
id = "check"
version = 1
description = "Check an answer."
input_schema = {{ type = "object", properties = {{ answer = {{ type = "integer" }} }} }}
exec = {{ argv = ["python3", "-c", '''{code}'''], protocol = "json", timeout_secs = {timeout} }}

[toolset.c]
tools = ["check"]
"""


def json_tool(tmp_path, code: str, timeout: float = 10, folder: str = "defs"):
    """The json tool running `code`, declared in tmp_path/folder/tools.toml."""
    where = tmp_path / folder
    where.mkdir()
    catalog = catalog_of(where, JSON_TOOL.format(code=code, timeout=timeout), default="c")
    return catalog.entries()[0].tool


def test_json_exec_tool_rewards_and_ends(tmp_path, sandbox):
    tool = json_tool(
        tmp_path,
        "import json, sys; a = json.load(sys.stdin)['answer']; "
        'print(json.dumps({"content": "right" if a == 42 else "wrong", "is_error": a != 42, '
        '"reward": 1 if a == 42 else 0, "done": a == 42}))',
    )
    right = tool.call(sandbox, {"answer": 42})
    assert (right.content, right.is_error, right.reward, right.done) == ("right", False, 1.0, True)
    wrong = tool.call(sandbox, {"answer": 1})
    assert (wrong.content, wrong.is_error, wrong.reward, wrong.done) == ("wrong", True, 0.0, False)
    plain = json_tool(tmp_path, 'print(\'{"content": "ok"}\')', folder="plain")
    assert plain.call(sandbox, {}) == Observation("ok")  # no reward, not done, not an error


@pytest.mark.parametrize(
    ("code", "why"),
    [
        ("print('not json')", "broke the json protocol"),
        ("print('[1]')", "must be a JSON object"),
        ('print(\'{"text": "x"}\')', 'unknown key "text"'),
        ("print('{\"content\": 1}')", '"content" must be a string'),
        ('print(\'{"content": "x", "reward": NaN}\')', '"reward" must be a finite number'),
        ('print(\'{"content": "x", "done": 1}\')', '"done" must be true or false'),
        # more digits than Python converts: a ValueError out of the parser, not a broken tool
        ("print('{\"content\": \"x\", \"reward\": ' + '9' * 5000 + '}')", "4300 digits"),
    ],
)
def test_a_bad_json_reply_is_a_broken_tool(tmp_path, sandbox, code, why):
    tool = json_tool(tmp_path, code)
    with pytest.raises(EnvironmentFailure, match="exec tool 'check' ") as error:
        tool.call(sandbox, {})
    assert why in str(error.value)


def test_a_json_reply_nested_too_deep_is_a_broken_tool_not_a_crash(tmp_path, sandbox):
    # as deep as the output cap lets through: past what Python's parser recurses into
    tool = json_tool(tmp_path, "print('{\"content\": ' + '[' * 30000 + ']' * 30000 + '}')")
    with pytest.raises(EnvironmentFailure, match="exec tool 'check' broke the json protocol"):
        tool.call(sandbox, {})
    with pytest.raises(EnvironmentFailure, match="nested more than 64 levels deep"):
        tool.call(sandbox, {})


@pytest.mark.parametrize(
    "definitions",
    [
        "x = " + "[" * 100_000 + "]" * 100_000 + "\n",
        "x = " + "{a = " * 100_000 + "1" + "}" * 100_000 + "\n",
        "x" + ".x" * 900 + " = 1\n",  # dotted keys: no bracket, past tomllib into our readers
    ],
)
def test_a_definition_file_nested_too_deep_is_a_config_error(tmp_path, definitions):
    with pytest.raises(
        ConfigError, match=r"tools\.toml(:1:\d+)?: invalid TOML: nested more than 64"
    ):
        catalog_of(tmp_path, definitions)


def test_a_failing_json_tool_is_an_observation(tmp_path, sandbox):
    failed = json_tool(tmp_path, "import sys; print('garbage'); sys.exit(3)").call(sandbox, {})
    assert failed.is_error and failed.content == "exit code: 3\nstdout:\ngarbage\n"
    slow = json_tool(tmp_path, "import time; time.sleep(30)", 0.3, "slow").call(sandbox, {})
    assert slow.content.startswith("command timed out and was killed\n") and slow.is_error


def test_hash_and_signature_follow_what_the_model_sees(tmp_path):
    def catalog(description: str, script: str = "print(1)"):
        (tmp_path / "t.py").write_text(script)
        return catalog_of(
            tmp_path,
            f"""
            [[tool]]
            id = "t"
            version = 1
            description = "{description}"
            exec = {{ argv = ["python3", "-c"], script = "t.py" }}

            [toolset.t]
            include = ["base"]
            tools = ["t"]
            """,
            default="t",
        )

    one, same, other = catalog("One."), catalog("One."), catalog("Two.")
    assert one.hash() == same.hash() and one.toolset_hash() == same.toolset_hash()
    assert one.hash() != other.hash() and one.toolset_hash() != other.toolset_hash()
    assert one.toolset_hash("base") == other.toolset_hash("base")
    edited = catalog("One.", "print(2)")
    assert edited.hash() == one.hash()  # the model sees the same catalog...
    assert edited.signature() != one.signature()  # ...but the run changed: resume refuses
    signature = one.signature()
    assert json.loads(json.dumps(signature)) == signature
    assert signature["toolsets"]["t"][-1] == "t@1"
    assert signature["tools"]["t@1"]["exec"]["script_sha256"] is not None
    assert signature["tools"]["bash@1"]["builtin"] == {"factory": "shell", "params": {}}
