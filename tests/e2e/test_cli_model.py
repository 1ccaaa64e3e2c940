"""`retrograd inspect` and `retrograd preflight` as a user runs them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from retrograd.cli.main import main


def test_inspect_reads_metadata_without_torch(gemma_path):
    code = (
        "import sys; from retrograd.cli.main import main; "
        f"rc = main(['inspect', '--model', {str(gemma_path)!r}, '--device', 'auto']); "
        "assert 'torch' not in sys.modules, 'inspect imported torch'; sys.exit(rc)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for expected in (
        "gemma3",
        "sliding window",
        "Q4_K",
        "Q8_0",
        "blk.*.attn_q.weight",
        "auto picks: q, k, v, o, ffn_gate, ffn_up, ffn_down",
        "never: quantized",
        "input embedding",
        "device: cpu",
    ):
        assert expected in text, expected


def test_inspect_bad_file_is_one_clear_line(tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    assert main(["inspect", "--model", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not a GGUF file" in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_preflight_passes_strict_on_cpu(tiny_model, capsys, name):
    assert main(["preflight", "--model", str(tiny_model(name)), "--strict", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "every operation ran on cpu" in out


def test_preflight_rejects_unknown_target(tiny_model, capsys):
    assert main(["preflight", "--model", str(tiny_model("llama")), "--targets", "q,nope"]) == 1
    assert "'nope' matches no tensor" in capsys.readouterr().err


def test_preflight_reports_fallbacks_strictly(tiny_model, monkeypatch):
    # Pretend the device is a GPU: every CPU op then counts as a host fallback.
    import retrograd
    from retrograd.model import preflight as pf

    m = retrograd.load(tiny_model("llama"), device="cpu")
    report = pf.PreflightReport(pf.torch.device("cuda"), m.dtype, [])
    audit = pf._DeviceAudit(report)
    with audit:
        m.decoder(pf.torch.tensor([[1, 2, 3]]))
    assert report.fallbacks and report.problems
