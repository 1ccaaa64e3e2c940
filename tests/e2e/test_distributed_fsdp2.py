"""`retrograd train` with [training].parallel = "fsdp2" on 2 gloo ranks: the blocks' GGUF bytes
sharded (model/fsdp2.py), the adapter equal to one process with gradient accumulation 2 at the
reference defaults; a rollout loop, whose ranks do not run in step, refused by name."""

from __future__ import annotations

import pytest

from tests.e2e.test_distributed import assert_same_adapter, launch, runs, train

DEFAULTS = {"ctx": 128, "micro_batch": 32, "gradient_accumulation": 2, "optimizer": "sgd"}


@pytest.mark.slow
def test_fsdp2_trains_the_adapter_of_one_process(tiny_model, tmp_path):
    model = tiny_model("gemma3", "MOSTLY_Q4_K_M")  # quantized blocks, a tied head
    training = {**DEFAULTS, "lr": 0.1, "epochs": 1}
    one, two = runs(tmp_path, model, ("one", "two"), training=training)
    two.write_text(
        two.read_text()
        .replace("[run]\n", "[run]\nverbose = true\n")
        .replace("[training]\n", '[training]\nparallel = "fsdp2"\ndist_timeout_seconds = 120\n')
    )
    done = launch(train(one, ranks=1), one.parent)
    assert done.returncode == 0, done.stderr
    done = launch(train(two), two.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fsdp2: 3 blocks sharded over 2 ranks" in done.stdout + done.stderr
    assert_same_adapter(one.parent / "out/adapter.gguf", two.parent / "out/adapter.gguf")
