"""Requests the run server answers through a process of its own (probe.py: preflight, a
calibrated plan): however long the request, the process starts."""

from __future__ import annotations

from tests.unit.server import test_server_depth as depth

client = depth.client  # the depth tests' server


def test_a_preflight_whose_request_is_longer_than_a_command_line_is_answered(client, tmp_path):
    # the probe's request travelled as one argument of its process: past Linux's 128 KiB for
    # one (MAX_ARG_STRLEN) the process never started, a 500 OSError (E2BIG)
    from tests.factories.tiny_gguf import write_tiny

    model = write_tiny(tmp_path / "tiny.gguf", "llama")
    body = {"model": str(model), "device": "cpu", "targets": ["blk.0.attn_q." + "x" * 200_000]}
    r = client.post("/v1/preflight", json=body)
    assert r.status_code == 422, r.text[:300]
    assert r.json()["detail"].startswith("preflight: "), r.json()["detail"][:300]
    ok = client.post("/v1/preflight", json={**body, "targets": "auto"})
    assert ok.status_code == 200 and ok.json()["ok"] is True, ok.text[:300]  # the stdin way
