"""scripts/gpu_check.py's plumbing with tiny fake parts (no model): one verdict line per part,
the summary, the JSON file, and that a failing, crashing, vanishing or timed-out part is a
FAIL, the next part still runs, and the exit code is 1."""

from __future__ import annotations

import json
import time

import psutil
import pytest

from scripts import gpu_check
from scripts.gpu_check import Part
from scripts.gpu_train import scale_command

FAKE = """
import os, subprocess, sys, time
from pathlib import Path
from scripts.gpu_check import failed, passed, skipped

def ok(setting):
    return passed("fine", value=1.5)

def told(setting):
    return passed(f"{setting.device} {setting.quick} {setting.model_kind}")

def bad(setting):
    return failed("wrong by 2", diff=2.0)

def skip(setting):
    return skipped("nothing to do here")

def boom(setting):
    raise RuntimeError("it broke\\nsecond line")

def vanish(setting):
    os._exit(3)

def sleepy(setting):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    Path(setting.work, "pids").write_text(f"{os.getpid()} {child.pid}")
    time.sleep(120)
    return passed("never")
"""


@pytest.fixture
def fake(tmp_path):
    (tmp_path / "fake_parts.py").write_text(FAKE)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")

    def run(names, *args, **budgets):
        """names of FAKE's functions (or whole Parts) -> (exit code, the JSON report)."""
        parts = [
            n
            if isinstance(n, Part)
            else Part(n, f"checks {n}", f"fake_parts:{n}", budgets.get(n, 60))
            for n in names
        ]
        out = tmp_path / "out" / "check.json"
        argv = ["--device", "cpu", "--model", str(model), "--out", str(out)]
        argv += ["--work", str(tmp_path / "work"), "--budget-scale", "1", *args]
        code = gpu_check.main(argv, parts=parts, extra_path=[str(tmp_path)])
        return code, json.loads(out.read_text())

    return run


def statuses(report) -> dict[str, str]:
    return {p["name"]: p["status"] for p in report["parts"]}


def test_passing_and_skipped_parts_exit_zero_with_their_figures(fake, capsys):
    code, report = fake(["ok", "skip", "told"], "--quick")
    out = capsys.readouterr().out
    assert code == 0 and report["exit"] == 0
    assert statuses(report) == {"ok": "PASS", "skip": "SKIP", "told": "PASS"}
    parts = {p["name"]: p for p in report["parts"]}
    assert parts["ok"]["figures"] == {"value": 1.5}
    assert parts["told"]["reason"] == "cpu True file"  # the Setting reaches the part
    lines = [s for s in out.splitlines() if s[:4] in ("PASS", "FAIL", "SKIP")]
    assert [s.split()[:2] for s in lines] == [["PASS", "ok"], ["SKIP", "skip"], ["PASS", "told"]]
    assert "nothing to do here" in lines[1]
    assert "gpu-check: 2 PASS, 0 FAIL, 1 SKIP" in report["summary"]
    assert report["summary"] in out and "no part failed" in out


def test_a_failing_raising_or_vanishing_part_fails_the_run_and_the_rest_runs(fake, capsys):
    code, report = fake(["bad", "boom", "vanish", "ok"])
    assert code == 1 and report["exit"] == 1
    assert statuses(report) == {"bad": "FAIL", "boom": "FAIL", "vanish": "FAIL", "ok": "PASS"}
    parts = {p["name"]: p for p in report["parts"]}
    assert parts["bad"]["figures"] == {"diff": 2.0}
    assert parts["boom"]["reason"] == "RuntimeError: it broke"
    assert "Traceback" in parts["boom"]["log_tail"]  # a failure keeps its output
    assert "exited with code 3 without a verdict" in parts["vanish"]["reason"]
    assert report["summary"].endswith("FAILED: bad, boom, vanish")
    assert "FAILED: bad, boom, vanish" in capsys.readouterr().out


def test_a_part_past_its_budget_is_killed_with_what_it_started(fake, tmp_path):
    started = time.monotonic()
    code, report = fake(["sleepy", "ok"], sleepy=3)
    assert time.monotonic() - started < 60
    assert code == 1
    assert statuses(report) == {"sleepy": "FAIL", "ok": "PASS"}
    sleepy = report["parts"][0]
    assert sleepy["reason"] == "timeout: still running after its budget of 3 s"
    assert 3 <= sleepy["seconds"] < 30
    for pid in map(int, (tmp_path / "work" / "sleepy" / "pids").read_text().split()):
        gone = not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        assert gone, pid  # the part and the process it started


def test_the_global_deadline_clips_budgets_and_stops_starting_parts(fake, monkeypatch):
    monkeypatch.setattr(gpu_check, "LAST_START", 1.0)
    began = time.time() - 100 + 3  # 3 s left of a 100 s deadline
    code, report = fake(["sleepy", "ok"], "--deadline", "100", "--started-at", str(began))
    assert code == 1
    sleepy, ok = report["parts"]
    assert sleepy["status"] == "FAIL" and sleepy["budget_s"] < 3
    assert sleepy["reason"].endswith("(clipped by the global deadline)")
    assert ok["status"] == "FAIL"
    assert ok["reason"] == "not started: the global deadline of 100 s was reached"


def test_a_cuda_part_is_skipped_on_the_cpu_without_running(fake):
    # a target that cannot be imported: it would FAIL if it ran
    code, report = fake([Part("gpu-only", "x", "no_such_module:nothing", 5, cuda_only=True)])
    assert code == 0
    assert report["parts"][0]["status"] == "SKIP"
    assert report["parts"][0]["reason"] == "no CUDA (--device cpu)"


def test_cuda_asked_where_torch_sees_none_fails_at_once(fake, monkeypatch, capsys):
    real = gpu_check.environment

    def without_cuda(device):
        env = real("cpu")
        return {**env, "cuda_available": False, "device": "cuda"}

    monkeypatch.setattr(gpu_check, "environment", without_cuda)
    code, report = fake(["ok"], "--device", "cuda")
    assert code == 1 and report["parts"] == []
    out = capsys.readouterr().out
    assert "gpu-check on no GPU" in out and "--device cuda: PyTorch sees no GPU" in out


def test_scale_command_passes_only_the_flags_its_help_lists(tmp_path):
    helped = "usage: scale.py [--sizes SIZES] [--quick] [--json JSON] [--threads N]"
    cmd = scale_command(helped, tmp_path / "s.json", 16)
    assert cmd[2:] == [
        "--sizes",
        "8b",
        "--quick",
        "--threads",
        "16",
        "--json",
        str(tmp_path / "s.json"),
    ]
    assert scale_command("usage: scale.py [--sizes SIZES]", tmp_path, 2) == (
        "bench/scale.py has no --quick"
    )


def test_host_cpu_names_tests_that_exist():
    """host-cpu's pytest targets: a renamed file or test would make the device check fail on
    its first lent machine, for nothing but a path."""
    import ast

    from scripts.gpu_parts import HOST_TESTS, HOST_TESTS_QUICK, REPO

    for target in HOST_TESTS + HOST_TESTS_QUICK:
        path, _, name = target.partition("::")
        assert (REPO / path).exists(), target
        if name:
            tree = ast.parse((REPO / path).read_text())
            tests = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            assert name in tests, target
