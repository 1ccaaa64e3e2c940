"""TrainPlan for base tensors: what full, partial and hybrid train and leave, master weights,
and a model whose trained tensors have not moved computing what the file does."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import retrograd
from retrograd.config.core import LoraSection, TrainableSection
from retrograd.errors import ConfigError
from retrograd.trainable.plan import build_plan


def cfg(mode: str, master: str = "auto", lora=None, trainable=None):
    training = SimpleNamespace(trainable=mode, master_weights=master)
    return SimpleNamespace(training=training, lora=lora, trainable=trainable)


def load(path):
    return retrograd.load(path, device="cpu", dtype=torch.float32)


def test_full_on_a_quantized_model_trains_its_float_tensors_only(tiny_model):
    model = load(tiny_model("llama", "MOSTLY_Q4_K_M"))
    plan, trained = build_plan(model, cfg("full"))
    names = {t.name for t in plan.base}
    floats = {n for n, t in model.gguf.tensors.items() if t.is_float and n != "token_embd.weight"}
    assert names == floats
    assert all(n.endswith("norm.weight") or n == "output.weight" for n in names)
    reasons = dict(plan.excluded)
    assert any("quantized (Q4_K), never trained" in why for why in reasons.values())
    assert reasons["token_embd.weight"] == "input embedding, never trained"
    assert [n for n, _ in trained.named()] == [t.name for t in plan.base]


@pytest.mark.parametrize(
    "master, dtype", [("auto", torch.float32), ("f32", torch.float32), ("off", torch.bfloat16)]
)
def test_bf16_matrices_train_through_a_master_copy_unless_off(tiny_model, master, dtype):
    model = load(tiny_model("qwen3", "MOSTLY_BF16"))
    section = TrainableSection(modules="attn_q", layers="0..0")
    plan, trained = build_plan(model, cfg("partial", master, trainable=section))
    (t,) = trained.base
    assert (t.name, t.storage, t.param.dtype) == ("blk.0.attn_q.weight", "BF16", dtype)
    assert plan.master_weights == ("off" if master == "off" else "f32")
    with torch.no_grad():  # an update smaller than bf16's step reaches the model only
        t.param.add_(1e-5)  # through the master copy's rounding, never half-way
        w = model.decoder.blk[0].attn_q.dense_weight(torch.float32)
    assert torch.equal(w, w.bfloat16().float())


@pytest.mark.parametrize("mode", ["full", "hybrid"])
def test_a_plan_before_any_step_computes_the_files_logits(tiny_model, mode):
    path = tiny_model("qwen2")
    ids = [1, 5, 9, 200, 31, 77, 4]
    want = load(path).logits(ids)
    model = load(path)
    lora = LoraSection(rank=4) if mode == "hybrid" else None
    section = TrainableSection(norms=True, biases=True) if mode == "hybrid" else None
    plan, trained = build_plan(model, cfg(mode, lora=lora, trainable=section))
    assert plan.base and all(p.requires_grad for _, p in trained.named())
    assert torch.equal(model.logits(ids), want)
    if mode == "hybrid":
        kinds = {t.kind for t in trained.base}
        assert kinds == {"norm", "bias"} and trained.adapters


def test_partial_refuses_a_selection_of_quantized_tensors(tiny_model):
    model = load(tiny_model("llama", "MOSTLY_Q4_K_M"))
    section = TrainableSection(modules="attn_q")
    with pytest.raises(ConfigError, match="matched only tensors never trained"):
        build_plan(model, cfg("partial", trainable=section))


@pytest.mark.parametrize(
    "stride, dtype", [(1, torch.float32), (2, torch.float32), (2, torch.bfloat16)], ids=str
)
def test_checkpointing_gives_base_tensors_the_plain_gradients(tiny_model, stride, dtype):
    """gradient_checkpointing recomputes the layers in backward: the trained matrices' and
    norms' gradients equal the plain path's (bf16: through the compiled fused kernels, which
    the recomputation's early stop used to trip over)."""
    ids = torch.tensor([[1, 5, 9, 200, 31, 77, 4, 8, 19]])
    grads = []
    for checkpointed in (False, True):
        model = retrograd.load(tiny_model("gemma3"), device="cpu", dtype=dtype)
        _, trained = build_plan(model, cfg("full"))
        if checkpointed:
            model.decoder.enable_checkpointing(stride)
        h = model.decoder(ids)
        torch.nn.functional.cross_entropy(model.decoder.head(h[0, :-1]), ids[0, 1:]).backward()
        grads.append({n: p.grad.clone() for n, p in trained.named()})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name, g in grads[0].items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["lfm2", "gpt-oss", "qwen3next"])
def test_full_trains_every_norm_under_its_file_name(tiny_model, name):
    """Norms the decoder keeps under a fixed module name (the final norm, lfm2's
    token_embd_norm; the pre-FFN norm that gpt-oss and qwen3-next store as
    post_attention_norm) train under the file's name: full leaves no norm out."""
    model = load(tiny_model(name))
    plan, trained = build_plan(model, cfg("full"))
    norms = {n for n in model.gguf.tensors if n.endswith("norm.weight")}
    assert norms <= {t.name for t in plan.base}
    for t in trained.base:  # each Parameter is the module that reads that tensor
        if t.name in norms:
            want = np.asarray(model.gguf.tensors[t.name].data).view(np.float32).reshape(-1)
            assert np.array_equal(t.param.detach().reshape(-1).numpy(), want), t.name
