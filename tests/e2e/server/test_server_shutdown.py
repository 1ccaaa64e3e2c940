"""retrograd-server's Ctrl-C, with a real server process and signals: the first asks the live
runs to checkpoint and stop at their next boundary; a second abandons them at once (their
processes killed, the runs `interrupted` when the server next starts)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.server.test_server_runs import model, start_run, wait_for  # noqa: F401
from tests.factories.run_server import RunServer, grpo_document, sft_toml

# a reward program that answers its first batch and never the second: the run's second
# update does not reach its boundary (the program waits for its input to end, which it does
# when the run's process is gone: nothing is left running after the test)
STALLS = r"""
import json, sys
ended = 0
for line in sys.stdin:
    req = json.loads(line)
    if "protocol" in req or "_retrograd_batch_end" in req:
        ended += "_retrograd_batch_end" in req
        print(json.dumps(req), flush=True)
        continue
    if ended:
        sys.stdin.read()
        break
    print(json.dumps({"reward": 0.5, "_retrograd_batch": req["_retrograd_batch"],
                      "_retrograd_index": req["_retrograd_index"]}), flush=True)
"""


def interrupt(server: RunServer) -> None:
    server.proc.send_signal(signal.SIGINT)


def exited(server: RunServer, seconds: float) -> bool:
    try:
        server.proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


def journal(server: RunServer, rid: str) -> list[dict]:
    lines = (server.state / rid / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def children(state: Path) -> list[int]:
    """The run processes of this state directory still alive."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"retrograd.server.child" in argv and any(str(state).encode() in a for a in argv):
            found.append(int(proc.name))
    return found


def test_ctrl_c_checkpoints_a_live_run_at_its_next_boundary(model, tmp_path):  # noqa: F811
    server = RunServer(tmp_path / "state").start()
    with server.client() as c:
        rid = start_run(c, sft_toml(model, tmp_path / "data.txt", epochs=200))["id"]
        wait_for(server.events(rid), "progress")
    interrupt(server)
    assert exited(server, 120), "the server did not stop after its run's next boundary"
    events = journal(server, rid)
    assert events[-2]["type"] == "checkpoint" and Path(events[-2]["path"]).exists()
    assert (events[-1]["type"], events[-1]["status"]) == ("status", "interrupted")
    assert children(server.state) == []


def test_a_second_ctrl_c_abandons_a_run_far_from_its_boundary(model, tmp_path):  # noqa: F811
    (tmp_path / "reward.py").write_text(STALLS)
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": w}]}) + "\n" for w in "abc")
    )
    catalogue = (
        f'[[reward]]\nid = "stalls"\ncommand = ["{sys.executable}", "{tmp_path / "reward.py"}"]\n'
    )
    prompts = tmp_path / "prompts.jsonl"
    document = grpo_document(model, prompts, {"reward": {"id": "stalls"}, "updates": 10})
    server = RunServer(tmp_path / "state", toml=catalogue).start()
    with server.client() as c:
        r = c.post("/runs", json={"config": document})
        assert r.status_code == 201, r.text
        rid = r.json()["id"]
        wait_for(server.events(rid), "progress")  # update 1; update 2 waits for its rewards
    assert len(children(server.state)) == 1
    interrupt(server)
    assert not exited(server, 5)  # waiting for the run's next boundary
    t0 = time.monotonic()
    interrupt(server)
    assert exited(server, 15) and time.monotonic() - t0 < 15
    assert children(server.state) == []
    assert "checkpoint" not in [e["type"] for e in journal(server, rid)]

    with server, server.client() as c:  # the next start: the run is interrupted, resumable
        view = c.get(f"/runs/{rid}").json()
        assert view["status"] == "interrupted" and view["holds_device"] is False
