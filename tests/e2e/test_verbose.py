"""[run].verbose through the command line: the resolved run and the loader's decisions on
stderr with verbose = true, none of it without, and off again for the next run file."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from retrograd.cli.main import main
from retrograd.observe.log import LOGGER, configure_logging

LINE = re.compile(r"^retrograd +\d+\.\d\ds [\w.]+: ", re.MULTILINE)
TEXT = "the cat sat on the mat. the dog sat on the log.\n"  # a few optimizer steps


def write_run(tmp: Path, model: Path | None, verbose: bool) -> Path:
    (tmp / "data.txt").write_text(TEXT)
    model_line = f'path = "{model}"' if model else ""
    path = tmp / f"run-{verbose}.toml"
    path.write_text(
        f"""
[run]
algorithm = "sft"
verbose = {str(verbose).lower()}
[model]
{model_line}
device = "cpu"
[output]
path = "out/adapter.gguf"
[lora]
rank = 2
targets = ["q", "v"]
[training]
lr = 0.005
ctx = 32
micro_batch = 16
[sft]
data = "data.txt"
"""
    )
    return path


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    """What is logged does not depend on compiled kernels; compiling would dominate the time."""
    monkeypatch.setenv("RETRO_COMPILE", "0")


def test_verbose_lines_with_verbose_and_none_without(tiny_model, tmp_path, capsys):
    model = tiny_model("llama")
    run = write_run(tmp_path, None, verbose=True)
    assert main(["train", str(run), "--model", str(model)]) == 0
    err = capsys.readouterr().err
    lines = LINE.findall(err)
    assert len(lines) > 40, err
    # every key, with where its value came from
    assert "config.load: [run].verbose = true (file)\n" in err
    assert "config.load: [training].lr = 0.005 (file)\n" in err
    assert 'config.load: [training].kv_dtype = "f16" (default)\n' in err
    assert 'config.load: [output].kind = "adapter" (derived)\n' in err
    assert f'config.load: [model].path = "{model}" (--model)\n' in err
    assert "config.load: [checkpoint]" not in err  # a section the file does not have
    # the loader's decisions and timing
    assert re.search(r"model\.loader: device cpu; cpu threads \d+ intra-op", err), err
    assert re.search(r"model\.loader: decoder built in \d+\.\d\d s: llama, 2 layers", err), err
    assert "dequantized-weight cache" in err
    # the loop's own lines: model and data timing, every step
    assert re.search(r"algorithms\.context: model loaded in \d+\.\d\d s", err), err
    assert re.search(r"algorithms\.sft: data loaded in \d+\.\d\d s: data\.txt", err), err
    assert re.search(r"algorithms\.sft: step 1 \(data\.txt:window \d+, group 1/\d+\): ", err), err

    # the next run file, not verbose, turns the lines off again in the same process
    assert main(["train", str(write_run(tmp_path, model, verbose=False))]) == 0
    err = capsys.readouterr().err
    assert not LINE.search(err), err
    assert logging.getLogger(LOGGER).handlers == []


def test_configure_logging_undoes_only_itself():
    logger = logging.getLogger(LOGGER)
    own = logging.NullHandler()
    logger.addHandler(own)
    logger.setLevel(logging.WARNING)
    try:
        configure_logging(True)
        assert logger.level == logging.DEBUG and len(logger.handlers) == 2
        configure_logging(True)  # idempotent
        assert len(logger.handlers) == 2
        configure_logging(False)
        assert logger.handlers == [own] and logger.level == logging.WARNING
        configure_logging(False)
        assert logger.handlers == [own]
    finally:
        logger.removeHandler(own)
        logger.setLevel(logging.NOTSET)
