"""A client's run document made into a run: declared fields, catalogue ids, folders, paths."""

from __future__ import annotations

import pytest

from retrograd.server.config import load_server_config
from retrograd.server.documents import prepare
from retrograd.server.problems import Problem

GRPO = {
    "run": {"algorithm": "grpo"},
    "model": {"path": "m.gguf"},
    "lora": {"rank": 2},
    "grpo": {
        "prompts": "p.jsonl",
        "updates": 1,
        "prompts_per_update": 1,
        "group_size": 2,
        "grpo_epochs": 1,
        "clip_range_low": 0.2,
        "clip_range_high": 0.28,
        "kl_coefficient": 0.0,
        "judge_weight": 0.5,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 4, "seed": 1},
        "reward": {"id": "plurals"},
        "judge": {"id": "gemma"},
    },
}
CATALOGUE = """
[[reward]]
id = "plurals"
command = ["python3", "reward.py"]
timeout_seconds = 12
[[judge]]
id = "gemma"
type = "ruler"
base_url = "http://127.0.0.1:8080/v1"
model = "gemma"
"""


def server(tmp_path, extra: str = ""):
    path = tmp_path / "server.toml"
    path.write_text(extra + CATALOGUE)
    return load_server_config(path, environ={})


def test_catalogue_ids_are_filled_in_and_run_folders_added(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    (tmp_path / "p.jsonl").write_text("")
    config = server(tmp_path, f'path_roots = ["{tmp_path}"]\n')  # relative paths: the first root
    prepared = prepare(GRPO, {"grpo": {"updates": 3}}, config, tmp_path / "run_1")
    g = prepared.config.grpo
    assert g.reward_command == ["python3", "reward.py"] and g.reward_timeout_seconds == 12
    assert g.judge.type == "ruler" and g.judge.model == "gemma" and g.updates == 3
    assert prepared.config.output.path == tmp_path / "run_1" / "output" / "adapter.gguf"
    assert prepared.config.checkpoint.directory == tmp_path / "run_1" / "checkpoints"
    assert prepared.provenance["grpo.updates"]["source"] == "override"
    assert prepared.provenance["checkpoint.every_steps"]["source"] == "derived"
    assert prepared.config.model.path == tmp_path / "m.gguf"


def test_files_a_run_reads_must_exist(tmp_path):
    with pytest.raises(Problem) as caught:
        prepare(GRPO, None, server(tmp_path, f'path_roots = ["{tmp_path}"]\n'), tmp_path / "r")
    assert caught.value.kind == "invalid-request"
    found = {e.pointer: e.code for e in caught.value.errors}
    assert found == {
        "/config/model/path": "path_not_found",
        "/config/grpo/prompts": "path_not_found",
    }


@pytest.mark.parametrize(
    "section, key, value",
    [
        ("grpo", "judge", {"type": "command", "command": ["judge"]}),
        ("agent", "mcp_servers", [{"name": "x", "command": ["x"]}]),
        ("agent", "collect_api", {"base_url": "http://x", "model": "m", "api_key_env": "K"}),
    ],
)
def test_server_declared_fields_are_refused(tmp_path, section, key, value):
    document = {**GRPO, section: {**GRPO.get(section, {}), key: value}}
    with pytest.raises(Problem) as caught:
        prepare(document, None, server(tmp_path), tmp_path / "run_1")
    assert caught.value.kind == "server-declared"
    assert [(e.pointer, e.code) for e in caught.value.errors] == [
        (f"/config/{section}/{key}", "server_declared")
    ]


def test_no_local_paths_when_the_server_takes_none(tmp_path):
    config = server(tmp_path, "allow_local_paths = false\n")
    with pytest.raises(Problem) as caught:
        prepare(GRPO, None, config, tmp_path / "run_1")
    assert caught.value.kind == "forbidden-path"
    found = {e.pointer: e.code for e in caught.value.errors}
    assert found == {"/config/model/path": "needs_opt_in", "/config/grpo/prompts": "needs_opt_in"}


AGENT = {
    "run": {"algorithm": "agent_grpo"},
    "model": {"path": "m.gguf"},
    "lora": {"rank": 2},
    "agent": {
        "scenarios": "s.jsonl",
        "updates": 1,
        "scenarios_per_update": 1,
        "group_size": 2,
        "judge": {"id": "gemma"},
        "environment": {"id": "sandbox"},
        "mcp_servers": [{"id": "calc"}],
    },
}
AGENT_CATALOGUE = """
[[mcp_server]]
id = "calc"
command = ["python3", "calc.py"]
stateless = true
allowed_tools = ["add"]
[[environment]]
id = "sandbox"
type = "local"
allow_unsandboxed = true
[environment.tools]
default = "base"
files = ["{outside}/tools.toml"]
"""


def test_agentic_runs_name_judges_environments_and_mcp_servers_by_id(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "operator"
    root.mkdir()
    outside.mkdir()
    for name in ("m.gguf", "s.jsonl"):
        (root / name).write_bytes(b"")
    (outside / "tools.toml").write_text("")
    extra = f'path_roots = ["{root}"]\n' + AGENT_CATALOGUE.format(outside=outside)
    config = server(tmp_path, extra)
    # the environment's tool file lies outside the path roots: the operator's, not refused
    prepared = prepare(AGENT, None, config, root / "run_1")
    a = prepared.config.agent
    assert a.judge.type == "ruler" and a.judge.model == "gemma"
    assert a.environment.type == "local" and a.environment.tools.files == [outside / "tools.toml"]
    [mcp] = a.mcp_servers
    assert (mcp.name, mcp.command, mcp.allowed_tools, mcp.stateless) == (
        "calc",
        ["python3", "calc.py"],
        ["add"],
        True,
    )
    assert prepared.provenance["agent.mcp_servers.0"]["reason"] == "[[mcp_server]] calc"
    assert prepared.provenance["agent.environment"]["reason"] == "[[environment]] sandbox"
    bad = {**AGENT, "agent": {**AGENT["agent"], "mcp_servers": [{"id": "calc"}, {"id": "nope"}]}}
    with pytest.raises(Problem) as caught:
        prepare(bad, None, config, root / "run_2")
    assert caught.value.kind == "unknown-catalog-id"
    assert [(e.pointer, e.code) for e in caught.value.errors] == [
        ("/config/agent/mcp_servers/1/id", "unknown_catalog_id")
    ]


@pytest.mark.parametrize(
    ("section", "value", "where"),
    [
        ("output", {"path": "state/run_0/run.json"}, "/config/output/path"),  # another run's record
        ("output", {"path": "state/datasets/ds_0/data.txt"}, "/config/output/path"),  # a dataset
        (
            "checkpoint",
            {"directory": "state/datasets", "mode": "steps", "every_steps": 1},
            "/config/checkpoint/directory",
        ),
        (
            "checkpoint",
            {"directory": "state", "mode": "steps", "every_steps": 1},
            "/config/checkpoint/directory",
        ),
        ("metrics", {"tensorboard_dir": "state/run_0"}, "/config/metrics/tensorboard_dir"),
    ],
)
def test_a_run_writes_nothing_of_the_servers_own_state_but_its_folder(
    tmp_path, section, value, where
):
    # with the state directory inside a path root, a run's outputs could replace another run's
    # run.json or an uploaded dataset's bytes (its id the sha256 of others)
    from retrograd.server.datasets import Datasets

    state = tmp_path / "state"
    (state / "run_0").mkdir(parents=True)
    (state / "datasets" / "ds_0").mkdir(parents=True)
    for name in ("m.gguf", "d.txt"):
        (tmp_path / name).write_bytes(b"")
    config = server(tmp_path, f'path_roots = ["{tmp_path}"]\nstate_dir = "{state}"\n')
    datasets = Datasets(state / "datasets", 1 << 20, 1 << 30)
    document = {**SFT, section: {k: _at(tmp_path, v) for k, v in value.items()}}
    with pytest.raises(Problem) as caught:
        prepare(document, None, config, state / "run_1", datasets=datasets)
    assert caught.value.kind == "forbidden-path"
    assert [(e.pointer, e.code) for e in caught.value.errors] == [(where, "forbidden_path")]
    assert "the server's state directory" in caught.value.errors[0].message
    ok = {**SFT, "output": {"path": str(tmp_path / "out" / "a.gguf")}}  # elsewhere in the root
    assert prepare(ok, None, config, state / "run_1", datasets=datasets).config.output.path.name


SFT = {
    "run": {"algorithm": "sft"},
    "model": {"path": "m.gguf"},
    "lora": {"rank": 2},
    "sft": {"data": "d.txt"},
}


def _at(root, value):
    return (
        str(root / value) if isinstance(value, str) and "/" in value or value == "state" else value
    )
