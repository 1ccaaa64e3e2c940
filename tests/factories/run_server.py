"""`retrograd-server` in its own process on a free loopback port, and an SSE reader for it.

    with RunServer(tmp / "state", toml='max_body_bytes = 4096') as server:
        client = server.client()            # httpx, base URL .../v1, token sent when set
        for event in server.events(run_id): ...

`kill()` ends the process with SIGKILL (a crash); `start()` starts it again on the same state
directory. The SFT run file these tests send is `sft_toml`: the tiny model, text data, no
[output] or [checkpoint] unless given (the server puts them in the run's folder).
"""

from __future__ import annotations

import json
import os
import signal
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
    def __init__(self, state: Path, toml: str = "", token: str | None = None):
        self.state = Path(state)
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
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "retrograd.cli.server", str(self.config)],
            stdout=subprocess.PIPE,
            stderr=open(self.state.parent / f"{self.state.name}-server.log", "a"),  # noqa: SIM115
            text=True,
            env=env,
        )
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
epochs = {epochs}
{training}
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
