"""`retrograd-server` in its own process on a free loopback port, and an SSE reader for it.

    with RunServer(tmp / "state", toml='max_body_bytes = 4096') as server:
        client = server.client()            # httpx, base URL .../v1, token sent when set
        for event in server.events(run_id): ...

`kill()` ends the process with SIGKILL (a crash); `start()` starts it again on the same state
directory. `event_queue` and `send_buffer` (a slow client's test) serve the app of
create_app(config, event_queue=...) from this module instead of the command line, on a loopback
socket this process makes with SO_SNDBUF = send_buffer (which turns the kernel's autotuning off;
accepted connections inherit it) and with asyncio's write buffer of each connection as small,
so that a client that does not read fills the way within a few dozen events. The SFT run file these tests send is `sft_toml`: the tiny model, text data, no
[output] or [checkpoint] unless given (the server puts them in the run's folder).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]

TEXT = (
    "the cat sat on the mat. the dog sat on the log. a bird sang in the tree. "
    "the sun rose over the hill and the day began. "
) * 3


class RunServer:
    def __init__(
        self,
        state: Path,
        toml: str = "",
        token: str | None = None,
        event_queue: int | None = None,
        send_buffer: int | None = None,
    ):
        self.state = Path(state)
        self.event_queue, self.send_buffer = event_queue, send_buffer
        self.state.mkdir(parents=True, exist_ok=True)
        self.token = token
        self.config = self.state.parent / f"{self.state.name}-server.toml"
        self.config.write_text(f'bind = "127.0.0.1:0"\nstate_dir = "{self.state}"\n{toml}\n')
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> RunServer:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        # the runs' fused kernels run eagerly: compiling them costs seconds a process, and the
        # server is what these tests are about (tests/unit/test_compiled.py checks the kernels)
        env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "RETRO_COMPILE": "0"}
        if self.token is not None:
            env["RETROGRAD_SERVER_TOKEN"] = self.token
        argv, sock = [sys.executable, "-m", "retrograd.cli.run_server", str(self.config)], None
        if self.event_queue is not None or self.send_buffer is not None:
            sock = socket.socket()
            if self.send_buffer is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer)
            sock.bind(("127.0.0.1", 0))
            sock.listen(64)
            env["PYTHONPATH"] += os.pathsep + str(REPO)
            queue = self.event_queue if self.event_queue is not None else 0
            argv = [sys.executable, "-m", "tests.factories.run_server", str(self.config)]
            argv += [str(sock.fileno()), str(queue), str(self.send_buffer or 0)]
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=open(self.state.parent / f"{self.state.name}-server.log", "a"),  # noqa: SIM115
            text=True,
            env=env,
            pass_fds=(sock.fileno(),) if sock is not None else (),
        )
        if sock is not None:
            sock.close()  # the server's process holds it now
        line = self.proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, self.log()
        self.url = line.split("listening on ")[1].split()[0]
        with self.client() as c:  # the app is up once it answers
            assert c.get("/health", timeout=60).json()["status"] == "ok"
        return self

    def log(self) -> str:
        return (self.state.parent / f"{self.state.name}-server.log").read_text()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> RunServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def client(self, token: str | None = "default", **kw) -> httpx.Client:
        token = self.token if token == "default" else token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120, **kw)

    def events(self, run_id: str, since: int | None = None, headers: dict | None = None):
        """The run's SSE frames as (event type, data dict), until the server ends the stream."""
        params = {"since": since} if since is not None else {}
        with self.client() as c:
            with c.stream(
                "GET", f"/runs/{run_id}/events", params=params, headers=headers or {}, timeout=300
            ) as response:
                assert response.status_code == 200, response.read()
                kind, data = None, None
                for line in response.iter_lines():
                    if line.startswith("event: "):
                        kind = line[7:]
                    elif line.startswith("data: "):
                        data = json.loads(line[6:])
                    elif line == "" and kind is not None:
                        yield kind, data
                        kind, data = None, None


def sft_toml(
    model: Path,
    data: Path,
    epochs: int = 1,
    extra: str = "",
    text: str = TEXT,
    training: str | None = None,
) -> str:
    """A tiny SFT run file (absolute paths) on `data` (written with `text`, about one optimizer
    step per 30 characters, when missing); `extra` adds tables; `training` replaces the
    [training] keys but `epochs`."""
    if not data.exists():
        data.write_text(text)
    training = training or "lr = 0.005\nctx = 32\nmicro_batch = 16\ngradient_accumulation = 2"
    return f"""
[run]
algorithm = "sft"
[model]
path = "{model}"
device = "cpu"
[lora]
rank = 4
alpha = 8.0
targets = ["q", "v", "ffn_down"]
[training]
{training}
epochs = {epochs}
[sft]
data = "{data}"
{extra}
"""


def grpo_document(model: Path, prompts: Path, grpo: dict, **sections) -> dict:
    """A tiny GRPO run document (absolute paths): two prompts an update, two answers each, of
    at most 4 tokens; `grpo` adds or replaces [grpo] keys (the reward among them: a catalogue
    `reward = {"id": ...}` or a `reward_command`), `sections` whole sections."""
    return {
        "run": {"algorithm": "grpo"},
        "model": {"path": str(model), "device": "cpu"},
        "lora": {"rank": 4, "alpha": 8.0, "targets": ["q", "v"]},
        "grpo": {
            "prompts": str(prompts),
            "updates": 2,
            "prompts_per_update": 2,
            "group_size": 2,
            "grpo_epochs": 1,
            "clip_range_low": 0.2,
            "clip_range_high": 0.28,
            "kl_coefficient": 0.0,
            "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 4, "seed": 3},
            **grpo,
        },
        **sections,
    }


def _serve(config_path: str, fd: str, queue: str, send_buffer: str) -> None:
    """The server of `config_path` on the listening socket `fd`, its streams lagged `queue`
    events behind (0: the server's own limit), each connection's transport pausing its writer
    past `send_buffer` bytes (0: asyncio's 64 KiB) as its socket's buffer does."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class SmallWrites(H11Protocol):
        def connection_made(self, transport) -> None:
            if int(send_buffer):
                transport.set_write_buffer_limits(high=int(send_buffer))
            super().connection_made(transport)

    from retrograd.server.app import create_app
    from retrograd.server.config import load_server_config

    config = load_server_config(config_path)
    sock = socket.socket(fileno=int(fd))
    print(f"retrograd-server: listening on http://127.0.0.1:{sock.getsockname()[1]}/v1", flush=True)
    app = create_app(config, event_queue=int(queue)) if int(queue) else create_app(config)
    server = uvicorn.Config(app, http=SmallWrites, log_level="warning", timeout_graceful_shutdown=3)
    uvicorn.Server(server).run(sockets=[sock])


if __name__ == "__main__":
    _serve(*sys.argv[1:])
