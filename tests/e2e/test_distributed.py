"""`retrograd train` under torchrun: 2 gloo ranks on a CPU against one process with the same run
file (gradient_accumulation 2: each rank takes one pass of every step), kill -9 of every rank
and resume, a world size that changed, and a rank that dies mid-run. Every launch has a hard
timeout, so a hang fails the test instead of blocking the suite."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import psutil
import pytest

from tests.e2e.test_train_distill import models  # noqa: F401 (the student and its teacher)
from tests.e2e.test_train_sft import write_run

LAUNCH_TIMEOUT = 300  # seconds; a run here takes seconds
ENV = {"OMP_NUM_THREADS": "1", "RETRO_THREADS": "1", "RETRO_COMPILE": "0"}


def train(run: Path, *extra: str, ranks: int = 2) -> list[str]:
    """The command: torchrun with `ranks` processes, or one plain process."""
    cli = ["-m", "retrograd.cli.main", "train", str(run), *extra]
    if ranks == 1:
        return [sys.executable, *cli]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*launcher, "--nproc_per_node", str(ranks), *cli]


def launch(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd,
        cwd=cwd,
        capture_output=True,
        text=True,
        env=os.environ | ENV,
        timeout=LAUNCH_TIMEOUT,
    )


def start(cmd: list[str], cwd: Path) -> subprocess.Popen:
    """A launch in its own process group (killed whole with os.killpg)."""
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=os.environ | ENV,
        start_new_session=True,
    )


def adapter(path: Path) -> dict[str, np.ndarray]:
    return {t.name: np.array(t.data, dtype=np.float32) for t in gguf.GGUFReader(path).tensors}


def assert_same_adapter(a: Path, b: Path, atol: float = 1e-5) -> None:
    x, y = adapter(a), adapter(b)
    assert x.keys() == y.keys()
    for name in x:
        np.testing.assert_allclose(x[name], y[name], atol=atol, rtol=1e-4, err_msg=name)
    assert any(np.abs(v).max() > 0 for k, v in x.items() if "lora_b" in k)  # it trained


def runs(tmp: Path, model: Path, names: tuple[str, ...], **over) -> list[Path]:
    out = []
    for name in names:
        (tmp / name).mkdir()
        out.append(write_run(tmp / name, model, **over))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "training",
    [
        {"ctx": 32, "micro_batch": 16, "gradient_accumulation": 2},
        # the reference defaults; sgd, whose step (unlike adamw's) sees the gradient's scale
        {"ctx": 128, "micro_batch": 32, "gradient_accumulation": 2, "optimizer": "sgd", "lr": 0.1},
    ],
    ids=["small", "defaults"],
)
def test_two_ranks_train_the_adapter_of_one_process(tiny_model, tmp_path, training):
    """Each rank takes one of every step's two passes; the summed gradients make the step of
    one process with gradient accumulation 2, evaluation and checkpoints included."""
    model = tiny_model("llama")
    one, two = runs(tmp_path, model, ("one", "two"), training={**training, "epochs": 2})
    done = launch(train(one, ranks=1), one.parent)
    assert done.returncode == 0, done.stderr
    done = launch(train(two), two.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_same_adapter(one.parent / "out/adapter.gguf", two.parent / "out/adapter.gguf")
    assert done.stdout.count("model: ") == 1  # rank 0 alone reports
    states = sorted(p.name for p in (two.parent / "ck").glob("step-*.state"))
    assert states == sorted(p.name for p in (one.parent / "ck").glob("step-*.state"))
    assert (two.parent / "ck" / states[-1] / "dcp" / ".metadata").is_file()


def kill_every_rank(proc: subprocess.Popen, path: Path) -> None:
    """SIGKILL of the launcher and every rank once `path` (a checkpoint) has landed. torchrun
    starts each rank in a session of its own: a kill of the launcher's process group would leave
    the ranks training on, so each process is killed by pid."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while not (path / "manifest.msgpack").exists():
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.02)
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:
        p.kill()
    proc.wait(timeout=30)
    gone, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, alive


@pytest.mark.slow
def test_kill_of_every_rank_then_resume_gives_the_uninterrupted_adapter(tiny_model, tmp_path):
    model = tiny_model("llama")
    # windows of two steps each: the checkpoint at step 3 cuts a window (its cache is saved)
    ck = 'directory = "ck"\nmode = "steps"\nevery_steps = 3'
    training = {"ctx": 64, "micro_batch": 16, "gradient_accumulation": 2, "epochs": 4}
    whole, cut = runs(tmp_path, model, ("whole", "cut"), training=training, checkpoint=ck)
    done = launch(train(whole), whole.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    proc = start(train(cut), cut.parent)
    kill_every_rank(proc, cut.parent / "ck" / "step-000000000003.state")
    assert (cut.parent / "ck/step-000000000003.state/artifacts/window-kv.msgpack").is_file()
    assert not (cut.parent / "out/adapter.gguf").exists()
    # a different world size is refused, naming the change
    refused = launch(train(cut, "--resume", ranks=1), cut.parent)
    assert refused.returncode != 0
    assert "saved by 2 ranks and this run has 1" in refused.stderr
    resumed = launch(train(cut, "--resume"), cut.parent)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout
    assert_same_adapter(
        whole.parent / "out/adapter.gguf", cut.parent / "out/adapter.gguf", atol=1e-7
    )


@pytest.mark.slow
def test_a_rank_that_dies_fails_the_run_on_every_rank(tiny_model, tmp_path):
    """SIGKILL of rank 1 once the run trains: the launcher stops the other rank and returns
    non-zero, well within the timeout (no rank hangs in a collective)."""
    model = tiny_model("llama")
    ck = 'directory = "ck"\nmode = "steps"\nevery_steps = 1'
    training = {"ctx": 32, "micro_batch": 16, "gradient_accumulation": 2, "epochs": 200}
    training["dist_timeout_seconds"] = 60
    (run,) = runs(tmp_path, model, ("run",), training=training, checkpoint=ck)
    proc = start(train(run), run.parent)
    first = run.parent / "ck" / "step-000000000001.state"
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while not (first / "manifest.msgpack").exists():
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if _rank(p) == "1"]
    assert len(ranks) == 1
    ranks[0].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    try:
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code != 0
    assert time.monotonic() - t0 < 120
    assert not psutil.pid_exists(ranks[0].pid) or ranks[0].status() == psutil.STATUS_ZOMBIE
    assert not (run.parent / "out/adapter.gguf").exists()


def _rank(p: psutil.Process) -> str | None:
    try:
        return p.environ().get("RANK")
    except psutil.Error:
        return None


def dpo_runs(tmp: Path, pairs_per_step: int, **training) -> list[Path]:
    """The run files one/run.toml and two/run.toml of a DPO run on a tiny chat model: sgd,
    held-out pairs, a checkpoint every 3 steps; `training` adds [training] keys."""
    from tests.e2e.test_train_preference import CHAT_TEMPLATE
    from tests.e2e.test_train_preference import write_run as write_pairs_run
    from tests.factories.tiny_gguf import write_tiny

    model = write_tiny(tmp / "chat.gguf", "gemma3", chat_template=CHAT_TEMPLATE)
    sections = {
        "evaluation": {"data": "held.jsonl"},
        "checkpoint": 'directory = "ck"\nmode = "steps"\nevery_steps = 3',
    }
    out = []
    for name in ("one", "two"):
        (tmp / name).mkdir()
        preference = {"loss": "dpo", "pairs_per_step": pairs_per_step}
        training = {"optimizer": "sgd", "lr": 0.5, "epochs": 2, **training}
        out.append(write_pairs_run(tmp / name, model, preference, training=training, **sections))
    return out


@pytest.mark.slow
def test_two_ranks_train_the_dpo_adapter_of_one_process(tmp_path):
    """DPO with its reference scores computed by both ranks' shares, each rank one of every
    step's two pairs, held-out evaluation and checkpoints; sgd sees the gradients' scale."""
    done = {}
    for run, ranks in zip(dpo_runs(tmp_path, 2), (1, 2), strict=True):
        name = run.parent.name
        done[name] = launch(train(run, ranks=ranks), run.parent)
        assert done[name].returncode == 0, done[name].stdout + done[name].stderr
    one, two = (tmp_path / n / "out/adapter.gguf" for n in ("one", "two"))
    assert_same_adapter(one, two)
    assert (tmp_path / "two/ck/step-000000000006.state/dcp/.metadata").is_file()


@pytest.mark.slow
def test_two_ranks_distill_offline_like_one_process(models, tmp_path):  # noqa: F811
    """Offline top-k distillation runs SFT's steps: the reference defaults, accumulation 2."""
    from tests.e2e.test_train_distill import OFFLINE
    from tests.e2e.test_train_distill import write_run as write_distill_run

    training = {"ctx": 128, "micro_batch": 32, "gradient_accumulation": 2, "optimizer": "sgd"}
    done = {}
    for name, ranks in (("one", 1), ("two", 2)):
        (tmp_path / name).mkdir()
        run = write_distill_run(
            tmp_path / name, models, dict(OFFLINE, offline_epochs=2), training=training
        )
        if ranks == 1:
            teacher = launch(
                [sys.executable, "-m", "retrograd.cli.main", "distill-teacher", str(run)],
                run.parent,
            )
            assert teacher.returncode == 0, teacher.stderr
        else:
            (run.parent / "corpus.topk").write_bytes((tmp_path / "one/corpus.topk").read_bytes())
        done[name] = launch(train(run, ranks=ranks), run.parent)
        assert done[name].returncode == 0, done[name].stdout + done[name].stderr
    assert_same_adapter(tmp_path / "one/out/adapter.gguf", tmp_path / "two/out/adapter.gguf")
