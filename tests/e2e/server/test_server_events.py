"""A slow SSE client against a real uvicorn on loopback: it is lagged (formats.md §9.3), and
neither the run nor another client following it waits for it.

The server's streams may fall 4 events behind (create_app's event_queue) and its connections
send through a 4 KiB socket buffer and a 4 KiB transport buffer; the slow client asks for a 4 KiB receive buffer, sends its
GET by hand and reads nothing until the run has ended. Then the kernel's buffers and the
server's transport are full, the stream's queue overflowed, and what it reads ends with
`event: lagged`.
"""

from __future__ import annotations

import json
import socket

import pytest

from tests.factories.agents import CHAT_TEMPLATE
from tests.factories.run_server import RunServer, sft_toml
from tests.factories.tiny_gguf import write_tiny

SMALL = 4096


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    return write_tiny(path, "llama", chat_template=CHAT_TEMPLATE)


def slow_client(server, path: str) -> socket.socket:
    """A connection with a small receive buffer that asks for `path` and reads nothing yet."""
    host, port = server.url.split("//")[1].split("/")[0].split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL)  # before connect: the window
    sock.connect((host, int(port)))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    return sock


def read_frames(sock: socket.socket) -> list[tuple[str, dict]]:
    """The SSE frames of the chunked response on `sock`, read to its last chunk."""
    sock.settimeout(120)
    data = b""
    while b"\r\n0\r\n\r\n" not in data:  # a chunked body's end (frames hold no CR)
        more = sock.recv(1 << 16)
        assert more, f"the connection closed before the stream ended: {data[-200:]!r}"
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    text = b""
    while True:
        size, _, body = body.partition(b"\r\n")
        if int(size, 16) == 0:
            break
        text, body = text + body[: int(size, 16)], body[int(size, 16) + 2 :]
    frames = []
    for block in text.decode().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in fields:
            frames.append((fields["event"], json.loads(fields["data"])))
    return frames


def test_a_slow_client_is_lagged_and_blocks_neither_the_run_nor_another_client(model, tmp_path):
    toml = sft_toml(model, tmp_path / "data.txt", epochs=5)  # some 190 events; some 80 fill the way
    state = tmp_path / "state"
    with RunServer(state, event_queue=4, send_buffer=SMALL) as server, server.client() as c:
        run = c.post("/runs", content=toml, headers={"Content-Type": "application/toml"})
        assert run.status_code == 201, run.text
        rid = run.json()["id"]
        slow = slow_client(server, f"/v1/runs/{rid}/events")
        # another client follows the same run meanwhile: every event, to the end
        followed = list(server.events(rid))
        seqs = [d["seq"] for _, d in followed]
        assert seqs == list(range(1, len(seqs) + 1))
        assert followed[-1][0] == "terminal" and followed[-1][1]["status"] == "completed"
        last = seqs[-1]
        assert c.get(f"/runs/{rid}").json()["status"] == "completed"

        # the slow client reads at last: what fitted in the way, then lagged, and the end
        frames = read_frames(slow)
        slow.close()
        kind, lagged = frames[-1]
        assert kind == "lagged", frames[-3:]
        since = lagged["since"]
        assert [d["seq"] for _, d in frames[:-1]] == list(range(1, since + 1))
        assert 0 < since < last
        # it reconnects with since and gets the rest, gapless, to the end
        rest = list(server.events(rid, since=since))
        assert [d["seq"] for _, d in rest] == list(range(since + 1, last + 1))
        assert rest[-1][0] == "terminal"
