"""fork_from without a server: which adapter a fork starts from, and the document it gets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from retrograd.server import forks
from retrograd.server.config import load_server_config
from retrograd.server.problems import Problem
from retrograd.server.store import RunRecord


def record(tmp_path, **config) -> RunRecord:
    folder = tmp_path / "run_1"
    (folder / "output").mkdir(parents=True)
    (folder / "output" / "adapter.gguf").write_bytes(b"GGUF")
    document = {
        "run": {"algorithm": "grpo"},
        "lora": {"rank": 4, "alpha": 8.0, "targets": ["q"]},
        "output": {"path": str(folder / "output" / "adapter.gguf")},
        "checkpoint": {"directory": str(folder / "checkpoints")},
        "observe": {"directory": str(folder / "observe"), "every": 3},
    }
    effective = {"output": document["output"], "checkpoint": document["checkpoint"], **config}
    return RunRecord(
        "run_1", None, "completed", "grpo", "m.gguf", 0, document=document,
        effective_config=effective,
    )  # fmt: skip


def test_a_fork_of_a_run_starts_from_its_adapter_in_folders_of_its_own(tmp_path):
    source = record(tmp_path)
    store = SimpleNamespace(runs={"run_1": source})
    server = load_server_config(None, environ={})
    adapter, theirs, why = forks.source({"run": "run_1"}, store, server)
    assert (
        adapter == tmp_path / "run_1" / "output" / "adapter.gguf" and why == "fork_from run run_1"
    )
    document = forks.apply(theirs, adapter, tmp_path / "run_2")
    assert document["lora"] == {"init_adapter": str(adapter)}  # rank, alpha, targets: the adapter's
    assert "output" not in document and "checkpoint" not in document
    assert document["observe"] == {"directory": str(tmp_path / "run_2" / "observe"), "every": 3}
    assert source.document["lora"]["rank"] == 4  # the source run's document is untouched


@pytest.mark.parametrize(
    ("fork", "kind"),
    [
        ({"run": "run_9"}, "not-found"),
        ({"run": "run_1", "checkpoint": "step-3"}, "not-found"),
        ({"run": "run_1", "path": "x"}, "invalid-request"),
        ({"path": "/elsewhere/a.gguf"}, "forbidden-path"),
    ],
)
def test_forks_that_cannot_start_are_refused(tmp_path, fork, kind):
    store = SimpleNamespace(runs={"run_1": record(tmp_path)})
    (tmp_path / "roots").mkdir()
    server = load_server_config(
        None, overrides={"path_roots": [str(tmp_path / "roots")]}, environ={}
    )
    with pytest.raises(Problem) as refused:
        forks.source(fork, store, server)
    assert refused.value.kind == kind


def test_a_run_that_trains_base_tensors_is_not_forked(tmp_path):
    store = SimpleNamespace(runs={"run_1": record(tmp_path, training={"trainable": "full"})})
    with pytest.raises(Problem) as refused:
        forks.source({"run": "run_1"}, store, load_server_config(None, environ={}))
    assert refused.value.kind == "conflict"


@pytest.mark.parametrize("client_timeout", [False, True])
def test_a_fork_references_the_catalogue_entries_its_source_was_given(tmp_path, client_timeout):
    # the source's document holds them resolved (its process runs them); the fork's goes
    # through the server's checks again, where a reward_command is the client's own: refused
    source = record(tmp_path)
    source.document["grpo"] = {
        "prompts": "p.jsonl",
        "reward_command": ["python3", "/srv/plural_reward.py"],
        "reward_mode": "batch",
        "reward_timeout_seconds": 7 if client_timeout else 30,
        "judge": {"type": "ruler", "base_url": "http://127.0.0.1:8080/v1", "model": "gemma"},
    }
    source.provenance = {
        "grpo.prompts": {"source": "override"},
        "grpo.reward_command": {"source": "derived", "reason": "[[reward]] plurals"},
        "grpo.judge": {"source": "derived", "reason": "[[judge]] gemma"},
    }
    if client_timeout:
        source.provenance["grpo.reward_timeout_seconds"] = {"source": "override"}
    store = SimpleNamespace(runs={"run_1": source})
    _, theirs, _ = forks.source({"run": "run_1"}, store, load_server_config(None, environ={}))
    expected = {"prompts": "p.jsonl", "reward": {"id": "plurals"}, "judge": {"id": "gemma"}}
    if client_timeout:
        expected["reward_timeout_seconds"] = 7
    assert theirs["grpo"] == expected
    assert source.document["grpo"]["reward_mode"] == "batch"  # the source's own is untouched
