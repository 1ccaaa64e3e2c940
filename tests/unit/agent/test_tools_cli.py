"""`retrograd tools list` on run files written here: the resolved toolsets, id@version, hashes,
MCP servers by name; no model is loaded (the model path does not exist)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from retrograd.agent.tools.catalog import load_catalog
from retrograd.cli.main import main
from retrograd.cli.tools import render
from retrograd.config.agent import ToolsConfig

RUN = """
[run]
algorithm = "agent_grpo"

[model]
path = "missing.gguf"

[output]
path = "out.gguf"

[lora]

[agent]
scenarios = "s.jsonl"

[agent.environment]
type = "local"
allow_unsandboxed = true

[agent.environment.tools]
default = "base"
scenario_toolsets = ["mine"]
files = ["defs/tools.toml"]

[agent.environment.tools.toolset.mine]
include = ["python"]
tools = ["lint"]
deny = ["grep"]
"""

DEFS = """
[[tool]]
id = "lint"
version = 3
description = "Lint the workspace."
exec = { argv = ["sh", "-c"], script = "lint.sh" }
"""

MCP = """
[[agent.mcp_servers]]
name = "docs"
command = ["no-such-server"]
stateless = true
"""


def write_run(tmp_path: Path, extra: str = "") -> Path:
    (tmp_path / "defs").mkdir()
    (tmp_path / "defs" / "tools.toml").write_text(textwrap.dedent(DEFS))
    (tmp_path / "defs" / "lint.sh").write_text("echo clean\n")
    run = tmp_path / "run.toml"
    run.write_text(textwrap.dedent(RUN) + textwrap.dedent(extra))
    return run


def test_tools_list_text(tmp_path, capsys):
    run = write_run(tmp_path)
    assert main(["tools", "list", str(run), "--no-connect"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("toolset base (default), hash ")
    assert lines[1].split() == ["bash@1", "bash", "Run", "a", "shell", "command", "in", "the",
                                "workspace", "and", "return", "its", "exit", "code,", "stdout",
                                "and", "stderr."]  # fmt: skip
    mine = lines.index(next(line for line in lines if line.startswith("toolset mine")))
    assert lines[mine].startswith("toolset mine (selectable), hash ")
    assert "lint@3" in lines[mine + 9] and "Lint the workspace." in lines[mine + 9]
    assert not any("grep@1" in line for line in lines[mine : mine + 10])
    catalog = load_catalog(
        ToolsConfig.model_validate(
            {
                "default": "base",
                "scenario_toolsets": ["mine"],
                "files": ["defs/tools.toml"],
                "toolset": {"mine": {"include": ["python"], "tools": ["lint"], "deny": ["grep"]}},
            }
        ),
        tmp_path,
    )
    assert f"catalog hash: {catalog.hash()}" in lines
    assert "other toolsets (not selectable): python, typescript" in lines
    assert "mcp" not in out


def test_tools_list_json(tmp_path, capsys):
    run = write_run(tmp_path, MCP)
    assert main(["tools", "list", str(run), "--no-connect"]) == 0
    assert "mcp servers: docs (not connected: --no-connect)" in capsys.readouterr().out
    assert main(["tools", "list", str(run), "--json", "--no-connect"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["environment"] == "local" and report["default"] == "base"
    assert list(report["toolsets"])[:2] == ["base", "mine"]
    mine = report["toolsets"]["mine"]
    assert mine["selectable"] and not report["toolsets"]["typescript"]["selectable"]
    assert [t["ref"] for t in mine["tools"]] == [
        "bash@1", "read_file@1", "write_file@1", "edit_file@1", "list_dir@1", "submit@1",
        "python@1", "pytest@1", "lint@3",
    ]  # fmt: skip
    lint = mine["tools"][-1]
    assert (lint["id"], lint["version"], lint["kind"]) == ("lint", 3, "exec")
    assert lint["input_schema"] == {"type": "object", "properties": {}}
    assert len(report["catalog_hash"]) == 64
    assert report["mcp"]["servers"] == ["docs"] and not report["mcp"]["connected"]


def test_tools_list_changes_hash_with_a_description(tmp_path, capsys):
    run = write_run(tmp_path)
    main(["tools", "list", str(run), "--json"])
    before = json.loads(capsys.readouterr().out)
    defs = tmp_path / "defs" / "tools.toml"
    defs.write_text(defs.read_text().replace("Lint the workspace.", "Lint it."))
    main(["tools", "list", str(run), "--json"])
    after = json.loads(capsys.readouterr().out)
    assert after["catalog_hash"] != before["catalog_hash"]
    assert after["toolsets"]["base"]["hash"] == before["toolsets"]["base"]["hash"]
    assert after["toolsets"]["mine"]["hash"] != before["toolsets"]["mine"]["hash"]


def test_tools_list_errors(tmp_path, capsys):
    run = write_run(tmp_path)
    run.write_text(run.read_text().replace('tools = ["lint"]', 'tools = ["lint@9"]'))
    assert main(["tools", "list", str(run)]) == 1
    err = capsys.readouterr().err
    assert "[toolset.mine]: unknown tool lint@9 (defined: lint@3)" in err
    other = tmp_path / "sft.toml"
    other.write_text('[run]\nalgorithm = "sft"\n[model]\npath = "m.gguf"\n[output]\npath = "o"\n[lora]\n'
                     '[sft]\ndata = "d.jsonl"\n')  # fmt: skip
    assert main(["tools", "list", str(other)]) == 1
    assert "tools list reads an agent_grpo run file" in capsys.readouterr().err


def test_tools_list_of_an_http_environment(tmp_path, capsys):
    run = tmp_path / "run.toml"
    head = RUN.split("[agent.environment]")[0]
    run.write_text(head + '[agent.environment]\ntype = "http"\nbase_url = "http://env.test/api/"\n')
    assert main(["tools", "list", str(run), "--no-connect"]) == 0
    out = capsys.readouterr().out
    assert (
        out
        == "http environment: its tools come from GET http://env.test/api/tools when a run starts\n"
    )
    assert "catalog hash" not in out


@pytest.mark.slow
def test_tools_list_connects_to_mcp_servers(tmp_path, capfd):
    # capfd, not capsys: the SDK hands a stdio server this process's stderr descriptor
    from tests.factories.mcp_server import stdio_command

    command = json.dumps(stdio_command())
    run = write_run(tmp_path, f'[[agent.mcp_servers]]\nname = "calc"\ncommand = {command}\n'
                              'allowed_tools = ["add", "echo"]\nstateless = true\n')  # fmt: skip
    assert main(["tools", "list", str(run), "--json"]) == 0
    report = json.loads(capfd.readouterr().out)
    mcp = report["mcp"]
    assert mcp["connected"] and mcp["servers"] == ["calc"]
    assert sorted(t["name"] for t in mcp["tools"]) == ["calc__add", "calc__echo"]
    lines = render(report).splitlines()  # the text form of the same report
    assert lines[lines.index("mcp tools:") + 1 :] == [
        "  calc__add  Add two integers.",
        "  calc__echo  Echo the text back.",
    ]
