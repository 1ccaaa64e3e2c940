"""The package root's public names: the configuration classes and list_backends, imported when
first used, so that `import retrograd` stays light; list_backends reports this machine."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from pydantic import BaseModel

import retrograd
import retrograd.config as config
from retrograd.config.report import section_classes
from retrograd.model.device import Backend, cpu_has_fast_bf16, list_backends


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_importing_the_package_loads_neither_torch_nor_the_configuration():
    code = "import sys, retrograd; print('torch' in sys.modules, 'retrograd.config' in sys.modules)"
    assert _run(code) == "False False"


def test_a_configuration_class_from_the_root_loads_no_torch():
    code = (
        "import sys, retrograd, retrograd.config as c; s = retrograd.GrpoSampling;"
        "print(s is c.GrpoSampling, 'torch' in sys.modules, 'list_backends' in dir(retrograd))"
    )
    assert _run(code) == "True False True"


def test_the_root_exports_every_configuration_class_and_nothing_else_lazily():
    classes = {cls.__name__ for cls in config.CLASSES}
    assert classes == {c.__name__ for c in section_classes()} | {"RunConfig"}
    assert classes <= set(config.__all__)
    for name in classes:
        assert getattr(retrograd, name) is getattr(config, name)
        assert issubclass(getattr(retrograd, name), BaseModel)
    assert retrograd.list_backends is list_backends and retrograd.Backend is Backend
    assert sorted(retrograd.__all__) == sorted(
        {"__version__", "load", "load_tokenizer", "list_backends", "Backend", *classes}
        | {"Trainer", "RolloutGroup"}
    )
    assert set(dir(retrograd)) >= set(retrograd.__all__)
    for missing in ("load_run", "Selection", "lowercase"):
        with pytest.raises(AttributeError, match=f"no attribute '{missing}'"):
            getattr(retrograd, missing)


def test_the_trainer_from_the_root_is_the_api_s_and_loads_no_torch():
    code = (
        "import sys, retrograd, retrograd.api as a; t = retrograd.Trainer;"
        "print(t is a.Trainer, retrograd.RolloutGroup is a.RolloutGroup, 'torch' in sys.modules)"
    )
    assert _run(code) == "True True False"


def test_star_import_resolves_every_public_name():
    code = "from retrograd import *; print(RunConfig.__name__, callable(list_backends))"
    assert _run(code) == "RunConfig True"


def test_list_backends_reports_the_cpu_then_each_gpu(monkeypatch):
    monkeypatch.delenv("RETRO_DTYPE", raising=False)  # the tests' conftest may pin float32
    backends = list_backends()
    cpu, gpus = backends[0], backends[1:]
    assert cpu.device == cpu.name == "cpu"
    assert len(gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert [g.name for g in gpus] == [f"cuda:{i}" for i in range(len(gpus))]
    assert all(g.device == "gpu" and g.description for g in gpus)
    assert [b.auto for b in backends] == [not gpus] + [i == 0 for i in range(len(gpus))]
    for b in backends:
        assert b.dtypes[0] == "float32" and set(b.dtypes) <= {"float32", "bfloat16", "float16"}
        assert b.default_dtype in b.dtypes
        assert 0 < b.available_bytes <= b.memory_bytes
    assert cpu.fast_bf16 == cpu_has_fast_bf16()
    assert cpu.default_dtype == ("bfloat16" if cpu.fast_bf16 else "float32")
    assert "bfloat16" in cpu.dtypes  # PyTorch computes bf16 on every CPU, fast or not


def test_list_backends_honours_retro_dtype(monkeypatch):
    monkeypatch.setenv("RETRO_DTYPE", "float32")
    assert {b.default_dtype for b in list_backends()} == {"float32"}
    monkeypatch.setenv("RETRO_DTYPE", "bf16")
    assert {b.default_dtype for b in list_backends()} == {"bfloat16"}


def test_the_backend_fields_of_the_python_page_are_the_records():
    from dataclasses import fields
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "python.md").read_text("utf-8")
    section = page.split("\n## Backends\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| `")]
    documented = {name.strip("` ") for row in rows for name in row.split(",")}
    assert documented == {f.name for f in fields(Backend)}
