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


def test_inspect_shows_a_hostile_files_names_as_text(tmp_path, capsys):
    """general.name is the file maker's: its brackets are not rich markup (a "[/bold]" was a
    MarkupError traceback) and its ESC sequences are shown, not sent to the terminal."""
    from tests.factories.tiny_gguf import write_tiny

    hostile = "[/bold] \x1b]0;owned\x07\x1b[31mred [link=https://x.example]click[/link]"
    path = write_tiny(tmp_path / "h.gguf", "llama", general_name=hostile)
    assert main(["inspect", "--model", str(path), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    shown = "[/bold] \\x1b]0;owned\\x07\\x1b[31mred [link=https://x.example]click[/link]"
    assert shown.replace(" ", "") in "".join(out.split())  # as text, wherever rich wraps it


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
    from retrograd.trainable import preflight as pf

    m = retrograd.load(tiny_model("llama"), device="cpu")
    report = pf.PreflightReport(pf.torch.device("cuda"), m.dtype, [])
    audit = pf._DeviceAudit(report)
    with audit:
        m.decoder(pf.torch.tensor([[1, 2, 3]]))
    assert report.fallbacks and report.problems


def test_inspect_states_the_weights_per_rank(tiny_model, capsys):
    """--ranks N: none and ddp hold the whole file on each rank; fsdp2 a 1/N share of the
    blocks (bytes, norms, biases), what stays whole, and two gathered blocks."""
    from retrograd.cli.inspect import rank_memory
    from retrograd.gguf import GGUFFile

    g = GGUFFile(tiny_model("qwen3", "MOSTLY_Q8_0"))
    rows = {mode: n for mode, n, _ in rank_memory(g, 4)}
    layer = sum(t.n_bytes for name, t in g.tensors.items() if name.startswith("blk.0."))
    rest = sum(t.n_bytes for name, t in g.tensors.items() if not name.startswith("blk."))
    assert rows["none"] == rows["ddp"] == g.n_bytes
    assert rows["fsdp2"] == -(-2 * layer // 4) + rest + 2 * layer  # two alike layers
    assert rank_memory(g, 1)[2][1] == g.n_bytes
    assert main(["inspect", "--model", str(g.path), "--ranks", "4"]) == 0
    out = capsys.readouterr().out
    assert "Frozen weights per rank on 4 ranks" in out and "fsdp2" in out
    with pytest.raises(SystemExit):
        main(["inspect", "--model", str(g.path), "--ranks", "0"])
    assert "--ranks 0: must be a whole number of at least 1" in capsys.readouterr().err
