"""FSDP2 over the decoder (distributed/fsdp2.py): two gloo ranks under torchrun train LoRA on a tiny
quantized model sharded block by block, against one process with gradient accumulation 2 on
the same data; each rank holds half of the blocks' bytes between passes. Every launch has a
hard timeout, so a hang fails the test instead of blocking the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from retrograd import distributed
from retrograd.algorithms import table
from retrograd.config.load import validate_run
from retrograd.distributed import World
from retrograd.distributed.fsdp2 import BYTES, register_block_bytes
from retrograd.errors import ConfigError
from retrograd.gguf import GGUFFile
from retrograd.model.loader import build_decoder
from tests.unit.config.config_runs import run_doc

WORKER = Path(__file__).with_name("fsdp2_worker.py")
ENV = {"OMP_NUM_THREADS": "1", "RETRO_THREADS": "1", "RETRO_COMPILE": "0"}


def two_ranks(out: Path, specs: list[str]) -> list[list[dict]]:
    """One torchrun launch over every spec; per spec, the two ranks' reports."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    done = subprocess.run(
        [*launcher, "--nproc_per_node", "2", str(WORKER), str(out), *specs],
        capture_output=True,
        text=True,
        env=os.environ | ENV,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [
        [json.loads((out / f"{i}-rank{r}.json").read_text()) for r in range(2)]
        for i in range(len(specs))
    ]


CASES = [  # (model, llama.cpp quantization, compute dtype, activation checkpointing)
    ("gemma3", "MOSTLY_Q4_K_M", "float32", False),  # tied head, K-quants, sandwich norms
    ("qwen3moe", "MOSTLY_Q8_0", "float32", True),  # expert tensors, recomputed blocks
    ("llama", "MOSTLY_Q4_K_M", "bfloat16", False),  # the fused 16-bit path
]


@pytest.mark.slow
def test_sharded_lora_equals_one_process(tiny_model, tmp_path):
    specs = [f"{tiny_model(m, q)},{d},{int(c)}" for m, q, d, c in CASES]
    for (name, _, dtype, _), reports in zip(CASES, two_ranks(tmp_path, specs), strict=True):
        for r in reports:
            tol = 0.0 if dtype == "float32" else 0.05 * r["moved"]  # bf16: cache-on reference
            assert r["moved"] > 1e-3, name  # it trained
            assert r["worst"] <= tol, (name, r)
            assert not r["cache"]  # no dense copy of a whole weight on a rank
            # between passes each rank holds its half of every block's bytes, after training too
            assert r["local_before"] == r["local_after"]
            assert abs(r["local_before"] - r["whole"] / 2) <= 64  # a byte of padding a tensor
        assert sum(r["local_before"] for r in reports) == reports[0]["whole"]


def test_registered_bytes_are_read_through_the_module(tiny_model):
    """One process: bytes handed to their modules give the same logits; a new Parameter on
    the module (what FSDP2 swaps in) is what the next product reads."""
    g = GGUFFile(tiny_model("qwen3", "MOSTLY_Q8_0"))
    decoder, _ = build_decoder(g, torch.device("cpu"), torch.float32, "off")
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.no_grad():
        before = decoder.head(decoder(ids))
        n = sum(register_block_bytes(b) for b in decoder.blk)
        blocks = [t for n, t in g.tensors.items() if n.startswith("blk.") and len(t.shape) > 1]
        assert n == sum(t.n_bytes for t in blocks)
        assert torch.equal(decoder.head(decoder(ids)), before)
        q = decoder.blk[0].attn_q
        assert q.frozen.raw is getattr(q, BYTES)
        setattr(q, BYTES, torch.nn.Parameter(torch.zeros_like(q.raw), requires_grad=False))
        assert not torch.equal(decoder.head(decoder(ids)), before)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_loops_whose_ranks_do_not_run_in_step_are_refused(algorithm):
    w = World(rank=0, size=2, parallel="fsdp2")
    traits = table.algorithm_of(validate_run(run_doc(algorithm))).traits
    for lockstep in ("sft", "preference"):
        distributed.check_traits(table.algorithm_of(validate_run(run_doc(lockstep))).traits, w)
    where = f"[run].algorithm = {algorithm!r}"
    with pytest.raises(ConfigError, match=rf"fsdp2.*{algorithm!r} does not run its ranks in step"):
        distributed.check_traits(traits, w, where)
    distributed.check_traits(traits, World(rank=0, size=2, parallel="ddp"), where)
    distributed.check_traits(traits, World(parallel="fsdp2"), where)  # one process: alone
