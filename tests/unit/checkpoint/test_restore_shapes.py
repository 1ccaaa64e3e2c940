"""A checkpoint's tensors go into the run's parameters only when each is there and of the
parameter's shape: `copy_` would broadcast a (1, n) tensor over an (r, n) parameter, and a
checkpoint may be anyone's (its identity checks pass when its maker copied them)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from retrograd.checkpoint import AdapterState, CheckpointError
from retrograd.checkpoint.fingerprint import ModelIdentity
from retrograd.checkpoint.rng import capture_rng
from retrograd.checkpoint.run import RunIdentity, restore
from tests.unit.checkpoint.sample_state import SETTINGS, make_state

NAME = "blk.0.attn_q.weight"


def _found(tensors=None):
    state = make_state(1)
    ident = dataclasses.replace(
        state.identity, trajectory_settings={**SETTINGS, "optimizer": "adamw"}
    )
    adapter = state.adapter
    if tensors is not None:
        adapter = AdapterState(adapter.rank, adapter.alpha, adapter.dtype, tensors)
    mine = tuple(s for s in state.optimizer.slots if s.owner == f"{NAME}.lora_a")
    optimizer = dataclasses.replace(state.optimizer, slots=mine)  # the one trained tensor's
    state = dataclasses.replace(
        state, identity=ident, adapter=adapter, optimizer=optimizer, rng=capture_rng()
    )
    model = ModelIdentity(ident.model_signature, ident.model_bytes, ident.model_fingerprint)
    run = RunIdentity("llama", model, ident.data_fingerprint, "sft", ident.trajectory_settings)
    return (state, "ck.state"), run, state


def _named(shape=(4, 32)):
    a = torch.nn.Parameter(torch.zeros(shape))
    return [(f"{NAME}.lora_a", a)], torch.optim.AdamW([a])


def test_the_checkpoints_tensor_of_the_right_shape_is_restored():
    found, run, state = _found()
    named, optimizer = _named()
    restore(found, run, named, optimizer)
    np.testing.assert_array_equal(named[0][1].detach().numpy(), state.adapter.tensors[NAME][0])


def test_a_tensor_of_another_shape_is_refused_not_broadcast():
    found, run, state = _found()
    a, b = state.adapter.tensors[NAME]
    found, run, _ = _found({**state.adapter.tensors, NAME: (a[:1], b)})  # (1, 32) for (4, 32)
    named, optimizer = _named()
    with pytest.raises(
        CheckpointError, match=r"lora_a is of shape \(1, 32\), the run's is \(4, 32\)"
    ):
        restore(found, run, named, optimizer)
    assert not named[0][1].detach().any()  # nothing was written


def test_optimizer_state_for_a_tensor_the_run_does_not_train_is_refused():
    found, run, state = _found()
    slots = state.optimizer.slots
    for bad, why in [
        (dataclasses.replace(slots[0], owner="output.weight"), r"state for 'output.weight'"),
    ]:
        optimizer = dataclasses.replace(state.optimizer, slots=(bad, *slots[1:]))
        broken = (dataclasses.replace(state, optimizer=optimizer), "ck.state")
        named, opt = _named()
        with pytest.raises(CheckpointError, match=why):
            restore(broken, run, named, opt)


def test_a_tensor_the_checkpoint_lacks_is_refused():
    found, run, state = _found()
    found, run, _ = _found({k: v for k, v in state.adapter.tensors.items() if k != NAME})
    named, optimizer = _named()
    with pytest.raises(CheckpointError, match=r"blk.0.attn_q.weight.lora_a is missing"):
        restore(found, run, named, optimizer)
