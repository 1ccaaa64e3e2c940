"""`retrograd chat` through a pseudo-terminal, as a user types it (real Gemma 3 270M)."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import pytest

import retrograd
from retrograd.cli.main import main
from retrograd.sampling import Sampler, SampleRequest, SamplingParams
from retrograd.tokenizer import ChatFormat, chat_template
from tests.e2e.test_serve import gemma_adapter, write_run


class Terminal:
    """A child process on a pty: write lines, read until a marker appears."""

    def __init__(self, cmd: list[str]):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
        os.close(slave)
        self.seen = ""

    def read_until(self, marker: str, timeout: float = 120) -> str:
        end = time.time() + timeout
        start = len(self.seen)
        while marker not in self.seen[start:]:
            assert time.time() < end, f"no {marker!r} in {self.seen[start:]!r}"
            ready, _, _ = select.select([self.master], [], [], 1)
            if ready:
                try:
                    self.seen += os.read(self.master, 4096).decode("utf-8", "replace")
                except OSError:  # the child closed the terminal
                    break
        return self.seen[start:]

    def send(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=60)
        finally:
            os.close(self.master)


@pytest.fixture(scope="module")
def setup(gemma_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    adapter = gemma_adapter(gemma_path, root / "tuned.gguf")
    return write_run(root, adapter), adapter


def expected_greedy(gemma_path, adapter, text: str, n: int) -> str:
    m = retrograd.load(gemma_path, device="cpu", adapter=adapter)
    fmt = ChatFormat(m.tokenizer, chat_template(m.tokenizer, m.gguf.metadata))
    ids = fmt.prompt_ids([{"role": "user", "content": text}])
    params = SamplingParams(temperature=0, max_new_tokens=n)
    [[c]] = Sampler(m.decoder, m.tokenizer).generate([SampleRequest(tuple(ids), params)])
    return c.text


def test_chat_compares_resets_and_exits(setup, gemma_path):
    run, adapter = setup
    cmd = [sys.executable, "-m", "retrograd.cli.main", "chat", str(run), "--model", str(gemma_path)]
    cmd += ["--compare", "--temp", "0", "--max-new-tokens", "6", "--device", "cpu"]
    term = Terminal(cmd)
    try:
        assert "/reset clears" in term.read_until("> ")
        term.send("Name a color.")
        turn = term.read_until("\n> ")
        assert "[base] " in turn and "[adapter] " in turn
        adapted = turn.split("[adapter] ")[1].split("\n")[0].rstrip()
        want = expected_greedy(gemma_path, adapter, "Name a color.", 6)
        assert adapted.replace(" [length]", "") == want.replace("\n", "\r").split("\r")[0].rstrip()
        term.send("/reset")
        assert "(history cleared)" in term.read_until("> ")
        term.send("/exit")
    finally:
        code = term.close()
    assert code == 0


def test_chat_streams_base_only_and_quits_on_eof(setup, gemma_path):
    run, _ = setup
    cmd = [sys.executable, "-m", "retrograd.cli.main", "chat", str(run), "--model", str(gemma_path)]
    cmd += ["--base-only", "--temp", "0.7", "--seed", "3", "--max-new-tokens", "4"]
    cmd += ["--system", "You are terse."]
    term = Terminal(cmd)
    try:
        term.read_until("> ")
        term.send("Hi")
        turn = term.read_until("\n> ")
        assert "[base]" not in turn and len(turn.strip()) > len("Hi")
        os.write(term.master, b"\x04")  # Ctrl-D
    finally:
        code = term.close()
    assert code == 0


def test_chat_flag_errors_before_loading(setup, capsys):
    run, _ = setup
    assert main(["chat", str(run), "--model", "missing.gguf", "--compare", "--base-only"]) == 1
    assert "--compare and --base-only" in capsys.readouterr().err
    assert main(["chat", str(run), "--model", "missing.gguf", "--top-p", "0"]) == 1
    assert "--top-p 0" in capsys.readouterr().err
