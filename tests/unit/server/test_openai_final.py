"""The run server's OpenAI routes name a run's weights from its record: a record whose output
section lacks a path (an older or edited run.json) has no final adapter, never a KeyError."""

from __future__ import annotations

import pytest

from retrograd.server.openai_routes import _final, available
from retrograd.server.store import RunRecord


def record(output, tmp_path) -> RunRecord:
    return RunRecord(
        id="run_1",
        name=None,
        status="completed",
        algorithm="sft",
        model="m.gguf",
        created_at=0,
        effective_config={"output": output} if output is not None else {},
        base_dir=str(tmp_path),
    )


@pytest.mark.parametrize("output", [None, {}, {"kind": "adapter"}, {"path": None}, {"path": ""}])
def test_a_record_without_an_output_path_has_no_final_adapter(output, tmp_path):
    run = record(output, tmp_path)
    assert _final(run) is None
    assert available(run) == ["run_1@base"]


def test_a_written_adapter_is_the_final_one(tmp_path):
    adapter = tmp_path / "a.gguf"
    adapter.write_bytes(b"GGUF")
    run = record({"path": str(adapter)}, tmp_path)
    assert _final(run) == adapter
    assert "run_1@final" in available(run)
