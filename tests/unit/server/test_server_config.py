"""The server TOML (formats.md §9.1): defaults, budgets, catalogues, refusals, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from retrograd.errors import ConfigError
from retrograd.server.config import (
    Budget,
    ServerConfig,
    load_server_config,
    parse_budget,
    parse_bytes,
    split_bind,
)


def load(tmp_path: Path, text: str, **kw) -> ServerConfig:
    path = tmp_path / "server.toml"
    path.write_text(text)
    return load_server_config(path, environ=kw.pop("environ", {}), **kw)


def test_every_key_has_the_spec_default(tmp_path):
    c = load(tmp_path, "")
    assert (c.bind, c.state_dir) == ("127.0.0.1:8471", tmp_path / "runs")
    assert (c.max_concurrent_runs, c.calibrate_runs, c.path_roots) == (1, True, [])
    assert (c.command_timeout_seconds, c.request_timeout_seconds) == (300.0, 60.0)
    assert (c.max_body_bytes, c.max_concurrent_requests) == (1 << 20, 256)
    assert (c.max_dataset_bytes, c.max_datasets_bytes) == (1 << 30, 20 << 30)
    assert (c.upload_idle_timeout_seconds, c.ui, c.observe_target_updates) == (60.0, True, 100)
    s = c.serving
    assert (s.enabled, s.idle_seconds, s.device_wait_seconds, s.queue) == (True, 300, 0, 8)
    assert s.max_body_bytes == 4 << 20
    assert c.auth_token is None and c.loopback and c.local_paths and not c.redact
    assert (c.vram_budget, c.ram_budget) == (Budget("all"), Budget("fraction", 0.8))


def test_budgets_and_sizes():
    assert parse_budget("all") == Budget("all")
    assert parse_budget("6GiB") == Budget("bytes", 6 << 30)
    assert parse_budget(4096) == Budget("bytes", 4096)
    assert parse_budget(0.8).bytes_of(1000) == 800
    assert parse_bytes("1.5 GB") == 1_500_000_000 and parse_bytes("512MiB") == 512 << 20
    for bad in ("lots", 1.5, -3, True, "6 parsecs"):
        with pytest.raises(ValueError):
            parse_budget(bad)


def test_unknown_keys_name_their_table_and_the_closest_key(tmp_path):
    text = 'max_concurent_runs = 2\n[serving]\nqueu = 3\n[[judge]]\nid = "j"\ntype = "command"\ncomand = ["x"]\n'
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text)
    lines = str(caught.value).splitlines()
    assert any(
        "max_concurent_runs = 2: unknown key; did you mean max_concurrent_runs?" in x for x in lines
    )
    assert any("[serving].queu = 3: unknown key; did you mean queue?" in x for x in lines)
    assert any("[judge][0].comand" in x and "command" in x for x in lines)


def test_catalogues_and_their_ids(tmp_path):
    text = """
[[reward]]
id = "plurals"
command = ["python3", "reward.py"]
mode = "oneshot"
[[judge]]
id = "gemma"
type = "ruler"
base_url = "http://127.0.0.1:8080/v1"
model = "gemma"
[[mcp_server]]
id = "files"
command = ["mcp-files"]
[[environment]]
id = "web"
type = "http"
base_url = "http://127.0.0.1:9000"
"""
    c = load(tmp_path, text)
    assert c.catalogue("reward")["plurals"].timeout_seconds == 30.0  # §2.6's default
    assert c.catalogue("judge")["gemma"].type == "ruler"
    assert c.catalogue("mcp_server")["files"].name is None
    assert c.catalogue("environment")["web"].type == "http"
    with pytest.raises(ConfigError, match=r"\[reward\]\[1\]\.id = \"plurals\": used twice"):
        load(tmp_path, text + '[[reward]]\nid = "plurals"\ncommand = ["x"]\n')


def test_a_non_loopback_bind_needs_a_token_and_path_roots(tmp_path):
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, 'bind = "0.0.0.0:8471"\n')
    assert "auth_token" in str(caught.value) and "path_roots" in str(caught.value)
    c = load(
        tmp_path,
        f'bind = "0.0.0.0:8471"\npath_roots = ["{tmp_path}"]\n',
        environ={"RETROGRAD_SERVER_TOKEN": "t"},
    )
    assert c.auth_token == "t" and not c.loopback and c.redact and not c.local_paths
    assert split_bind("[::1]:0") == ("::1", 0)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        load(tmp_path, 'bind = "8471"\n')


def test_flags_override_the_file(tmp_path):
    c = load(
        tmp_path, 'bind = "127.0.0.1:1"\n', overrides={"bind": "127.0.0.1:2", "ram_budget": "all"}
    )
    assert c.bind == "127.0.0.1:2" and c.ram_budget == Budget("all")


def test_help_openapi_and_schema_import_no_torch():
    code = (
        "import sys, io, contextlib; from retrograd.cli.run_server import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out): rc = main(['openapi', '--compact'])\n"
        "print(rc, 'torch' in sys.modules, out.getvalue(), end='')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    rc, torch_loaded, document = done.stdout.split(" ", 2)
    assert (rc, torch_loaded) == ("0", "False")
    paths = json.loads(document)["paths"]
    assert {"/v1/runs", "/v1/runs/{run_id}/events", "/v1/health"} <= set(paths)
    done = subprocess.run(
        [sys.executable, "-m", "retrograd.cli.run_server", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0 and "openapi" in done.stdout and "--state-dir" in done.stdout


def test_a_required_mcp_server_that_cannot_connect_stops_startup(tmp_path, capfd):
    # capfd, not capsys: the MCP SDK hands a server its stderr's file descriptor
    from tests.factories.mcp_server import SCRIPT

    path = tmp_path / "server.toml"
    working = f'[[mcp_server]]\nid = "tools"\ncommand = ["{sys.executable}", "{SCRIPT}"]\n'
    broken = '[[mcp_server]]\nid = "broken"\ncommand = ["false"]\n'
    optional = '[[mcp_server]]\nid = "maybe"\ncommand = ["false"]\nrequired = false\n'
    from retrograd.cli.run_server import main
    from retrograd.server.mcp_check import check_required_mcp

    config = load(tmp_path, working + optional)
    check_required_mcp(config, tmp_path)  # connects, lists, closes; the optional one is left
    path.write_text(f'state_dir = "{tmp_path / "state"}"\n' + working + broken)
    assert main([str(path)]) == 1
    err = capfd.readouterr().err
    assert '[mcp_server][1] id = "broken": required, and it cannot connect' in err
    assert not (tmp_path / "state").exists()  # refused before anything else
