"""`retrograd train` with [training].parallel = "fsdp2" on 2 gloo ranks: the blocks' GGUF bytes
sharded (distributed/fsdp2.py), the adapter equal to one process with gradient accumulation 2 at the
reference defaults; a kill -9 of every rank inside a window, then a resume to the same adapter."""

from __future__ import annotations

import re

import numpy as np
import pytest

from retrograd.algorithms.pairs import REFERENCE, decode_scores
from tests.e2e.test_distributed import (
    assert_same_adapter,
    dpo_runs,
    kill_every_rank,
    launch,
    runs,
    start,
    train,
)

DEFAULTS = {"ctx": 128, "micro_batch": 32, "gradient_accumulation": 2, "optimizer": "sgd"}
FSDP2 = 'parallel = "fsdp2"\ndist_timeout_seconds = 120\n'


@pytest.mark.slow
def test_fsdp2_trains_the_adapter_of_one_process(tiny_model, tmp_path):
    model = tiny_model("gemma3", "MOSTLY_Q4_K_M")  # quantized blocks, a tied head
    training = {**DEFAULTS, "lr": 0.1, "epochs": 1}
    one, two = runs(tmp_path, model, ("one", "two"), training=training)
    two.write_text(
        two.read_text()
        .replace("[run]\n", "[run]\nverbose = true\n")
        .replace("[training]\n", f"[training]\n{FSDP2}")
    )
    done = launch(train(one, ranks=1), one.parent)
    assert done.returncode == 0, done.stderr
    done = launch(train(two), two.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fsdp2: 3 blocks sharded over 2 ranks" in done.stdout + done.stderr
    assert_same_adapter(one.parent / "out/adapter.gguf", two.parent / "out/adapter.gguf")


@pytest.mark.slow
def test_fsdp2_resumes_after_every_rank_is_killed(tiny_model, tmp_path):
    """A kill -9 of both ranks inside a window (step 3: ctx 128 is two steps of two passes),
    then --resume: the adapter of the uninterrupted fsdp2 run."""
    model = tiny_model("gemma3", "MOSTLY_Q4_K_M")
    ck = 'directory = "ck"\nmode = "steps"\nevery_steps = 3'
    training = {**DEFAULTS, "optimizer": "adamw", "epochs": 3}
    whole, cut = runs(tmp_path, model, ("whole", "cut"), training=training, checkpoint=ck)
    for run in (whole, cut):
        run.write_text(run.read_text().replace("[training]\n", f"[training]\n{FSDP2}"))
    done = launch(train(whole), whole.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    kill_every_rank(start(train(cut), cut.parent), cut.parent / "ck" / "step-000000000003.state")
    assert not (cut.parent / "out/adapter.gguf").exists()
    resumed = launch(train(cut, "--resume"), cut.parent)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "at step 3" in resumed.stdout
    assert_same_adapter(
        whole.parent / "out/adapter.gguf", cut.parent / "out/adapter.gguf", atol=1e-7
    )


@pytest.mark.slow
@pytest.mark.parametrize("micro_batch", [32, 64])
def test_fsdp2_trains_the_dpo_adapter_of_one_process(micro_batch, tmp_path):
    """DPO over sharded blocks, three pairs a step: the ranks own two pieces and one (at 32 a
    pair's rows each, at 64 shared-prompt pieces of two passes mixed with rows of one), every
    rank scoring every piece, reference score and held-out pair; the adapter and the held-out
    statistics of one process, checkpoints written."""
    one, two = dpo_runs(tmp_path, 3, micro_batch=micro_batch)
    two.write_text(
        two.read_text()
        .replace("[run]\n", "[run]\nverbose = true\n")
        .replace("[training]\n", f"[training]\n{FSDP2}")
    )
    done = {}
    for name, run, ranks in (("one", one, 1), ("two", two, 2)):
        done[name] = launch(train(run, ranks=ranks), run.parent)
        assert done[name].returncode == 0, done[name].stdout + done[name].stderr
    assert "fsdp2: 3 blocks sharded over 2 ranks" in done["two"].stdout + done["two"].stderr
    assert_same_adapter(tmp_path / "one/out/adapter.gguf", tmp_path / "two/out/adapter.gguf")
    evals = {n: re.findall(r"(eval/\w+)\s+(-?[\d.]+)", done[n].stdout) for n in done}
    assert len(evals["two"]) == 10  # two evaluations of five statistics
    assert [k for k, _ in evals["one"]] == [k for k, _ in evals["two"]]
    np.testing.assert_allclose(
        *([float(v) for _, v in evals[n]] for n in done), rtol=2e-3, atol=1e-3
    )
    ref = {n: tmp_path / n / "ck/step-000000000003.state/artifacts" / REFERENCE for n in done}
    one, two = (decode_scores(REFERENCE, ref[n].read_bytes(), n) for n in done)
    for a, b in zip(one, two, strict=True):  # the training set's scores, then the held-out
        np.testing.assert_allclose(a.chosen, b.chosen, rtol=1e-5)
        np.testing.assert_allclose(a.rejected, b.rejected, rtol=1e-5)
    assert (tmp_path / "two/ck/step-000000000003.state/dcp/.metadata").is_file()
