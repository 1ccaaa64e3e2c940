"""SFT passes and steps: splits, checkpointing and schedules keep the plain path's numbers."""

from __future__ import annotations

import math

import pytest
import torch

import retrograd
from retrograd.algorithms.step import LossOptions, backward_group, groups_of, new_cache
from retrograd.data.sft import Example, permutation
from retrograd.optim import lr_at
from retrograd.optim.build import DecoupledSGD
from retrograd.trainable.lora import attach_lora

IDS = tuple([1] + [(i * 37) % 500 + 3 for i in range(31)])
MASK = tuple([0] * 6 + [1] * 20 + [0] * 3 + [1] * 3)
EX = Example(IDS, MASK, "test:1")


def model_with_lora(tiny_model, name="gemma3"):
    m = retrograd.load(tiny_model(name), device="cpu", dtype=torch.float32)
    loras = attach_lora(m.decoder, ["auto"], rank=4, alpha=8.0, seed=1)
    with torch.no_grad():
        for lo in loras.values():
            lo.lora_b.normal_(std=0.02)  # non-zero B: A gets gradients too
    return m, loras


def grads(loras) -> torch.Tensor:
    out = torch.cat([p.grad.flatten() for lo in loras.values() for p in (lo.lora_a, lo.lora_b)])
    for lo in loras.values():
        lo.zero_grad()
    return out


def test_groups_cover_the_window_and_count_targets():
    groups = groups_of(EX, 8, 2)
    assert [g.passes for g in groups] == [((0, 8), (8, 16)), ((16, 24), (24, 32))]
    assert sum(g.n_targets for g in groups) == sum(MASK[1:])
    trailing = Example(IDS, MASK[:20] + (0,) * 12, "t")
    assert groups_of(trailing, 8, 1)[-1].passes == ((16, 24),)  # no target after 19 -> dropped


@pytest.mark.parametrize("micro_batch", [8, 16])
def test_micro_batch_split_gives_the_whole_window_loss(tiny_model, micro_batch):
    # The same window in one pass or in passes that see earlier passes as cached context:
    # the same loss (forward values do not depend on where gradients stop).
    m, _ = model_with_lora(tiny_model)
    opts = LossOptions(chunked=True, tiles=3, seq_chunk=0)
    whole = groups_of(EX, 32, 1)
    split = groups_of(EX, micro_batch, 32 // micro_batch)
    assert len(whole) == len(split) == 1
    a = backward_group(m.decoder, EX, whole[0], new_cache(m.decoder, EX, torch.float32), opts)
    b = backward_group(m.decoder, EX, split[0], new_cache(m.decoder, EX, torch.float32), opts)
    assert math.isclose(a, b, rel_tol=1e-5)


@pytest.mark.parametrize(
    "stride, dtype", [(1, torch.float32), (2, torch.float32), (3, torch.float32)]
)
def test_gradient_checkpointing_equals_plain(tiny_model, stride, dtype):
    m, loras = model_with_lora(tiny_model)
    opts = LossOptions()
    (g,) = groups_of(EX, 32, 1)
    plain_loss = backward_group(m.decoder, EX, g, new_cache(m.decoder, EX, torch.float32), opts)
    plain = grads(loras)
    m.decoder.enable_checkpointing(stride, dtype)
    ck_loss = backward_group(m.decoder, EX, g, new_cache(m.decoder, EX, torch.float32), opts)
    ck = grads(loras)
    assert math.isclose(plain_loss, ck_loss, rel_tol=1e-6)
    torch.testing.assert_close(ck, plain, rtol=1e-5, atol=1e-7)


def test_chunked_and_plain_loss_give_the_same_gradients(tiny_model):
    m, loras = model_with_lora(tiny_model, "llama")
    (g,) = groups_of(EX, 32, 1)
    a = backward_group(
        m.decoder, EX, g, new_cache(m.decoder, EX, torch.float32), LossOptions(chunked=False)
    )
    ga = grads(loras)
    b = backward_group(
        m.decoder, EX, g, new_cache(m.decoder, EX, torch.float32), LossOptions(tiles=5, seq_chunk=7)
    )
    gb = grads(loras)
    assert math.isclose(a, b, rel_tol=1e-5)
    torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-7)


def test_schedules():
    assert lr_at(0, 10, 1.0, "constant", 0) == 1.0
    assert lr_at(0, 10, 1.0, "linear", 4) == 0.25 and lr_at(3, 10, 1.0, "linear", 4) == 1.0
    assert lr_at(4, 10, 1.0, "linear", 4) == 1.0 and lr_at(
        9, 10, 1.0, "linear", 4
    ) == pytest.approx(1 / 6)
    assert lr_at(5, 10, 1.0, "cosine", 0) == pytest.approx(0.5)
    assert lr_at(10, 10, 1.0, "cosine", 0) == pytest.approx(0.0, abs=1e-12)


def test_decoupled_sgd_shrinks_weights_by_lr_times_decay():
    p = torch.nn.Parameter(torch.tensor([2.0]))
    opt = DecoupledSGD([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.tensor([1.0])
    opt.step()
    assert float(p.detach()) == pytest.approx(2.0 * (1 - 0.05) - 0.1)


def test_epoch_order_is_a_pure_function_of_seed_and_epoch():
    a, b = permutation(50, 42, 3), permutation(50, 42, 3)
    assert (a == b).all() and not (a == permutation(50, 42, 4)).all()
    assert sorted(a.tolist()) == list(range(50))


def test_patience_counts_evaluations_without_improvement():
    from retrograd.algorithms.evaluate import Patience

    p = Patience(patience=2, min_delta=0.1)
    assert p.update(1.0) and not p.stop
    assert not p.update(0.95)  # better, but by less than min_delta
    assert not p.stop
    assert not p.update(1.2)
    assert p.stop and p.best == 1.0
    assert not Patience(None).stop
