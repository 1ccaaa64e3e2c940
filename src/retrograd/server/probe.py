"""Measurements that load a model, each in a process of its own so the server never holds
weights for them: `retrograd preflight` as JSON, and a plan's calibration.

    echo '{"model": ..., "device": ..., "targets": [...]}' | python -m retrograd.server.probe preflight
    echo '{"document": {...}, "base_dir": ...}' | python -m retrograd.server.probe calibrate

The request is JSON on stdin (a command-line argument holds 128 KiB at most); each prints one
JSON object on stdout: the answer, or {"error": "..."}.

`preflight` is the CLI's check (trainable/preflight.py): one forward and backward through fresh
LoRA adapters on the targets with 16 tokens, every operation's device recorded.
`calibrate` loads the run's model on its device as the run would and runs that same audited
step with `training.micro_batch` tokens; it reports the process's peak resident memory (and,
on a GPU, the peak allocated by torch) after loading and after the step. The optimizer's state
and the data are not part of it: the plan's estimate still gives those posts.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes


def preflight(request: dict[str, Any]) -> dict[str, Any]:
    from retrograd.model.model import load
    from retrograd.trainable.preflight import preflight as audit

    model = load(request["model"], device=request.get("device") or "auto")
    report = audit(model.decoder, list(request.get("targets") or ["auto"]))
    return {
        "model": model.gguf.path.name,
        "architecture": model.config.name,
        "load": model.report.describe(),
        "device": report.device.type,
        "dtype": str(report.dtype).replace("torch.", ""),
        "targets": report.targets,
        "operations": report.n_ops,
        "seconds": report.seconds,
        "loss": report.loss,
        "fallbacks": report.fallbacks,
        "failures": report.failures,
        "ok": not report.problems,
    }


def calibrate(request: dict[str, Any]) -> dict[str, Any]:
    import torch

    from retrograd.algorithms import context
    from retrograd.config import validate_run
    from retrograd.trainable.preflight import preflight as audit

    cfg = validate_run(request["document"], source="the plan", base_dir=request["base_dir"])
    before = _peak_rss()
    started = time.perf_counter()
    model = context.load_model(cfg)
    cuda = model.decoder.device.type == "cuda"
    loaded = _peak_rss()
    targets = list(cfg.lora.targets) if cfg.lora is not None else ["auto"]
    report = audit(model.decoder, targets, tokens=max(2, cfg.training.micro_batch))
    out = {
        "measured": True,
        "device": model.decoder.device.type,
        "tokens": cfg.training.micro_batch,
        "seconds": time.perf_counter() - started,
        "ram_before_load_bytes": before,
        "ram_after_load_bytes": loaded,
        "ram_peak_bytes": _peak_rss(),
    }
    if cuda:
        out["vram_peak_bytes"] = int(torch.cuda.max_memory_allocated(model.decoder.device))
    if report.problems:
        out["problems"] = report.problems
    return out


def main(argv: list[str]) -> int:
    """`argv`: the kind (preflight, calibrate); the request is JSON on stdin."""
    kind, request = argv[0], json.loads(sys.stdin.buffer.read())
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write on the answer's stream
    try:
        answer = {"preflight": preflight, "calibrate": calibrate}[kind](request)
    except Exception as error:  # noqa: BLE001 - every failure is the answer
        answer = {"error": f"{type(error).__name__}: {error}"}
    out.write(json.dumps(answer, default=str) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
