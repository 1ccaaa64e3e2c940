"""Adapters on mixtures of experts, written by us, applied by llama.cpp as we apply them.

Expert tensors take one low-rank pair per expert, stacked in llama.cpp's layout (lora_a
(n_expert, r, n_in), lora_b (n_expert, n_out, r)), which llama.cpp applies to each token's
selected experts (build_lora_mm_id); the router (ffn_gate_inp) takes a plain pair.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import retrograd
from retrograd.errors import GGUFError
from retrograd.gguf import write_lora_adapter
from retrograd.trainable.lora import apply_adapter_file, attach_lora, target_modules
from tests.factories.tiny_moe import NAMES
from tests.oracles.llama_oracle import llama_logits

pytestmark = pytest.mark.oracle

IDS = [1, 300, 301, 17, 260, 400, 401, 402, 5, 77, 78, 79]


def random_pairs(decoder, pick, rank: int = 4, seed: int = 3) -> dict:
    rng = np.random.default_rng(seed)
    pairs = {}
    for base, module in target_modules(decoder).items():
        if not pick(base):
            continue
        *lead, n_out, n_in = module.frozen.shape
        a = rng.standard_normal((*lead, rank, n_in)) * 0.1
        b = rng.standard_normal((*lead, n_out, rank)) * 0.1
        pairs[f"{base}.weight"] = (a.astype(np.float32), b.astype(np.float32))
    return pairs


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("where", ["_exps", "ffn_gate_inp"])
def test_expert_and_router_adapters_apply_as_in_llama_cpp(tiny_model, tmp_path, name, where):
    model = tiny_model(name)
    m = retrograd.load(model, device="cpu", dtype=torch.float32)
    pairs = random_pairs(m.decoder, lambda base: where in base)
    assert len(pairs) == (3 if where == "_exps" else 1) * m.config.layer_ffn.count("moe")
    adapter = write_lora_adapter(
        tmp_path / "a.gguf", architecture=m.gguf.architecture, tensors=pairs, alpha=8.0, dtype="f32"
    )
    ref = llama_logits(model, IDS, lora_path=str(adapter))
    assert np.abs(ref - llama_logits(model, IDS)).max() > 0.05, "the adapter changes the model"
    got = retrograd.load(model, device="cpu", dtype=torch.float32, adapter=adapter).logits(IDS)
    assert np.abs(got.numpy() - ref).max() < 2e-3


def test_ffn_aliases_target_the_experts_and_train_them(tiny_model):
    m = retrograd.load(tiny_model("qwen3moe"), device="cpu", dtype=torch.float32)
    adapters = attach_lora(m.decoder, ["ffn_up", "ffn_down"], rank=4, alpha=8.0, seed=0)
    assert sorted(adapters) == [
        f"blk.{il}.{t}" for il in range(m.config.n_layer) for t in ("ffn_down_exps", "ffn_up_exps")
    ]
    up = adapters["blk.0.ffn_up_exps"]
    assert up.lora_a.shape == (8, 4, 256) and up.lora_b.shape == (8, 128, 4)
    for lo in adapters.values():  # B starts at zero: give it a value so A gets a gradient too
        torch.nn.init.normal_(lo.lora_b, std=0.01)
    m.decoder.head(m.decoder(torch.tensor([IDS]))).logsumexp(-1).sum().backward()
    grads = up.lora_a.grad.abs().sum((1, 2))
    assert (grads > 0).sum() >= 2  # the experts the prompt reached


def test_an_expert_adapter_of_the_wrong_layout_is_refused(tiny_model, tmp_path):
    model = tiny_model("qwen3moe")
    m = retrograd.load(model, device="cpu", dtype=torch.float32)
    a, b = random_pairs(m.decoder, lambda base: base == "blk.0.ffn_up_exps")[
        "blk.0.ffn_up_exps.weight"
    ]
    with pytest.raises(GGUFError, match="same rank"):  # A and B for different expert counts
        write_lora_adapter(
            tmp_path / "x.gguf",
            architecture="qwen3moe",
            tensors={"blk.0.ffn_up_exps.weight": (a[:4], b)},
            alpha=8.0,
        )
    flat = {"blk.0.ffn_up_exps.weight": (a[0], b[0])}  # one 2-D pair for an expert tensor
    path = write_lora_adapter(tmp_path / "y.gguf", architecture="qwen3moe", tensors=flat, alpha=8.0)
    with pytest.raises(GGUFError, match="do not fit a 8x128x256 weight"):
        apply_adapter_file(m.decoder, path)
