"""Resume restores the optimizer and the generators exactly: the next steps are bit-identical."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from retrograd.checkpoint import (
    CheckpointError,
    capture_rng,
    load_checkpoint,
    optimizer_state,
    restore_optimizer,
    restore_rng,
    save_checkpoint,
)
from tests.unit.checkpoint.sample_state import make_state

NAMES = ["blk.0.attn_q.weight.lora_a", "blk.0.attn_q.weight.lora_b", "output.bias"]


def params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 16), (24, 4), (24,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def grads(ps, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def run(opt, ps, steps):
    for s in steps:
        grads(ps, s)
        opt.step()
        opt.zero_grad()


def through_checkpoint(tmp_path, opt_state):
    state = dataclasses.replace(make_state(2), optimizer=opt_state)
    return load_checkpoint(save_checkpoint(tmp_path, "step-000000000002", state)).optimizer


BUILDERS = {
    "adamw": lambda ps: torch.optim.AdamW(
        [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.8, 0.95),
        weight_decay=0.1,
    ),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    "sgd_plain": lambda ps: torch.optim.SGD(ps, lr=1e-2),
}


@pytest.mark.parametrize("kind", list(BUILDERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_resumes_bit_identically(tmp_path, kind, dtype):
    ps = params(dtype)
    opt = BUILDERS[kind](ps)
    run(opt, ps, range(3))
    saved = through_checkpoint(tmp_path, optimizer_state(opt, NAMES, kind=kind, hyper={"lr": 1e-2}))
    assert saved.hyper == {"lr": 1e-2}

    fresh = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = BUILDERS[kind](fresh)
    for g in opt2.param_groups:  # a resumed run rebuilds from config; the checkpoint decides
        g["lr"] = 123.0
    restore_optimizer(opt2, NAMES, saved)
    run(opt, ps, range(3, 6))
    run(opt2, fresh, range(3, 6))
    for a, b in zip(ps, fresh, strict=True):
        assert torch.equal(
            a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
            b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        )


def test_slots_are_named_after_parameters(tmp_path):
    ps = params(torch.bfloat16)
    opt = BUILDERS["adamw"](ps)
    run(opt, ps, range(1))
    st = optimizer_state(opt, NAMES, kind="adamw")
    rows = {(s.owner, s.slot): s for s in st.slots}
    assert rows[(NAMES[0], "exp_avg")].dtype == "bf16" and rows[(NAMES[0], "exp_avg")].shape == (
        4,
        16,
    )
    assert rows[(NAMES[2], "step")].shape == () and rows[(NAMES[2], "step")].dtype == "f32"
    assert [g["params"] for g in st.groups] == [NAMES[:2], NAMES[2:]]
    assert st.groups[0]["betas"] == [0.8, 0.95] and st.groups[1]["weight_decay"] == 0.0


def test_other_parameters_are_refused(tmp_path):
    ps = params()
    opt = BUILDERS["adamw"](ps)
    run(opt, ps, range(1))
    st = optimizer_state(opt, NAMES, kind="adamw")
    with pytest.raises(CheckpointError, match="trained parameters differ.*output.weight"):
        restore_optimizer(BUILDERS["adamw"](params()), NAMES[:2] + ["output.weight"], st)
    with pytest.raises(ValueError, match="2 names"):
        optimizer_state(opt, NAMES[:2], kind="adamw")


def draws(gen):
    return (
        torch.rand(3).tolist(),
        torch.rand(2, generator=gen).tolist(),
        random.random(),
        random.gauss(0, 1),
        np.random.rand(2).tolist(),
    )


def test_generators_resume_exactly(tmp_path):
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    draws(gen)
    rng = capture_rng({"lora": 42, "shuffle": 2**64 - 1}, {"shuffle": gen})
    state = dataclasses.replace(make_state(2), rng=rng)
    loaded = load_checkpoint(save_checkpoint(tmp_path, "step-000000000002", state)).rng
    expected = draws(gen)
    torch.manual_seed(9), random.seed(9), np.random.seed(9), gen.manual_seed(9)
    restore_rng(loaded, {"shuffle": gen})
    assert draws(gen) == expected
    assert loaded.seeds == {"lora": 42, "shuffle": 2**64 - 1}
    with pytest.raises(CheckpointError, match="no state for generator 'other'"):
        restore_rng(loaded, {"other": gen})
