"""Build a Decoder from a GGUF file: map the bytes, check every type, decide the dense cache.

The loader is the only place that knows both the file's tensor names and the decoder's
structure. It resolves the compute plan against the file and the machine and reports what it
chose (`compute.Resolved`: device, compute dtype, dense cache, decode graph) so that commands
can print it.
"""

from __future__ import annotations

import logging
import time
import warnings

import torch

from retrograd import environ
from retrograd.compute import ComputePlan, Resolved, WeightsPlan
from retrograd.errors import GGUFError
from retrograd.gguf import GGUFFile, TensorInfo
from retrograd.model import decode
from retrograd.model.arch import FLOAT_PARTS
from retrograd.model.block import Block
from retrograd.model.config import ModelConfig
from retrograd.model.decoder import Decoder
from retrograd.model.dequant import check_supported, dequantize
from retrograd.model.device import available_memory
from retrograd.model.frozen import DenseCache, FrozenTensor
from retrograd.model.layers import Linear, RMSNorm
from retrograd.model.moe import Experts

log = logging.getLogger(__name__)


def tensor_bytes(info: TensorInfo, device: torch.device) -> torch.Tensor:
    """The tensor's stored bytes as a uint8 tensor: the memory map itself on the CPU."""
    with warnings.catch_warnings():  # the memory map is read-only; we never write to it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(info.data)
    return raw if device.type == "cpu" else raw.to(device)


def _float(info: TensorInfo, device: torch.device) -> torch.Tensor:
    return dequantize(tensor_bytes(info, torch.device("cpu")), info.ggml_type, info.shape).to(
        device
    )


def decide_cache(
    dense_bytes: int,
    device: torch.device,
    weights: WeightsPlan,
    source: str = "default",
    int8_bytes: int = 0,
) -> tuple[str, str]:
    """How frozen weights are held ("on": dense copies, "int8": 8-bit rows, "off": the file's
    bytes alone), and why: as the plan asks (`source` names who asked), else dense when a full
    cache fits in `budget_fraction` of the free memory, else 8-bit when its `int8_bytes` fit
    in `int8_fraction` of it, else off."""
    if weights.cache != "auto":
        asked = source if source.startswith("RETRO_") else f"requested {weights.cache}"
        return weights.cache, asked
    free = available_memory(device)
    gib = free / (1 << 30)
    if dense_bytes <= weights.budget_fraction * free:
        return "on", f"fits in {gib:.1f} GiB available"
    if int8_bytes and int8_bytes <= weights.int8_fraction * free:
        return "int8", f"dense would not fit comfortably in {gib:.1f} GiB available; 8-bit does"
    return "off", f"would not fit comfortably in {gib:.1f} GiB available, nor in 8 bits"


def build_decoder(
    g: GGUFFile,
    device: torch.device,
    dtype: torch.dtype,
    cache: str = "auto",
    plan: ComputePlan | None = None,
) -> tuple[Decoder, Resolved]:
    """The decoder of `g` on `device` computing in `dtype`, and what loading decided from
    `plan` (the dense cache, the decode graph); without one, the environment's plan with this
    `cache` mode."""
    started = time.perf_counter()
    if plan is None:
        plan = ComputePlan.of(environ.read(), cache=cache)
    for info in g.tensors.values():
        check_supported(info.ggml_type, where=f"{g.path.name}: tensor {info.name}")
    cfg = ModelConfig.from_gguf(g)
    matmul = [
        t for t in g.tensors.values() if t.name.endswith(".weight") and len(t.shape) in (2, 3)
    ]
    dense_bytes = sum(t.n_elements for t in matmul) * torch.finfo(dtype).bits // 8
    int8_bytes = _int8_bytes(g, matmul)
    mode, reason = decide_cache(dense_bytes, device, plan.weights, plan.source("cache"), int8_bytes)
    dense = DenseCache(mode == "on", int8=mode == "int8")

    def frozen(name: str) -> FrozenTensor:
        raw = tensor_bytes(g.tensor(name), device)
        return FrozenTensor(g.tensor(name), raw, dense, mapped=device.type == "cpu")

    def opt(name: str):
        return g.tensors.get(name)

    by_layer: dict[int, list[TensorInfo]] = {il: [] for il in range(cfg.n_layer)}
    for info in g.tensors.values():
        parts = info.name.split(".", 2)
        if parts[0] == "blk" and int(parts[1]) in by_layer:
            by_layer[int(parts[1])].append(info)
    blocks = []
    for il in range(cfg.n_layer):
        parts = _block_parts(by_layer[il], cfg, frozen, lambda t: _float(t, device))
        _check_block(g, cfg, il, parts)
        blocks.append(Block(cfg, il, parts))
    output = opt("output.weight")
    freqs = opt("rope_freqs.weight")
    norm_name = f"{cfg.arch.output_norm}.weight"
    if not g.has_tensor(norm_name):
        raise GGUFError(f"{g.path.name}: {cfg.name} model is missing tensor {norm_name}")
    decoder = Decoder(
        cfg,
        frozen("token_embd.weight"),
        blocks,
        RMSNorm(_float(g.tensor(norm_name), device), cfg.rms_eps),
        None if output is None else Linear(frozen("output.weight")),
        None if freqs is None or not cfg.arch.rope_freqs_tensor else _float(freqs, device),
    )
    decoder.set_compute_dtype(dtype)
    decoder.plan = plan
    report = Resolved(
        plan,
        device,
        dtype,
        g.n_bytes,
        dense_bytes,
        mode == "on",
        reason,
        torch.get_num_threads(),
        decode.model_reason(decoder),
        int8_bytes if mode == "int8" else 0,
    )
    _log_decisions(g, cfg, report, time.perf_counter() - started)
    return decoder, report


def _int8_bytes(g: GGUFFile, matmul: list[TensorInfo]) -> int:
    """What the 8-bit store of the 2-D product weights takes (a byte a weight, 4 a row's
    scale); the token embedding counts only where it is also the head (its rows are read from
    the file)."""
    tied = not g.has_tensor("output.weight")
    return sum(
        t.n_elements + 4 * t.shape[0]
        for t in matmul
        if len(t.shape) == 2 and (tied or t.name != "token_embd.weight")
    )


def _log_decisions(g: GGUFFile, cfg: ModelConfig, report: Resolved, seconds: float) -> None:
    """[run].verbose: what the loader chose, and how long building the decoder took."""
    if not log.isEnabledFor(logging.INFO):
        return
    where = report.device.type
    if where == "cuda":
        where += f" ({torch.cuda.get_device_name(report.device)})"
    log.info("%s: %s", g.path.name, report.describe())
    log.info(
        "device %s; cpu threads %d intra-op, %d inter-op",
        where,
        torch.get_num_threads(),
        torch.get_num_interop_threads(),
    )
    for line in report.lines():
        log.info("%s", line)
    log.info(
        "decoder built in %.2f s: %s, %d layers, %d tensors",
        seconds,
        cfg.name,
        cfg.n_layer,
        len(g.tensors),
    )


def _block_parts(infos: list[TensorInfo], cfg: ModelConfig, frozen, dense) -> dict:
    """A layer's tensors by suffix (`blk.3.attn_q.weight` -> "attn_q"): matmul weights as
    Linear (with their bias), 3-D expert tensors as Experts, norms as RMSNorm, and every other
    tensor (conv kernels, scalars per head, lone biases) as a float32 tensor under its full
    suffix ("ssm_a", "ssm_dt.bias", "shortconv.conv.weight")."""
    by_suffix = {t.name.split(".", 2)[2]: t for t in infos}
    parts: dict = {}
    used: set[str] = set()
    for rest, info in by_suffix.items():
        if rest.endswith("norm") and len(info.shape) == 1:  # falcon-h1's "ffn_norm": no suffix
            parts[rest] = RMSNorm(dense(info), cfg.rms_eps)
            used.add(rest)
            continue
        if not rest.endswith(".weight") or rest in FLOAT_PARTS:
            continue
        base, n_dim = rest[: -len(".weight")], len(info.shape)
        bias = by_suffix.get(f"{base}.bias")
        if n_dim in (1, 2) and base.endswith("norm"):  # 2-D: per group (mamba2's ssm_norm)
            parts[base] = RMSNorm(dense(info), cfg.rms_eps)
        elif n_dim in (2, 3):
            b = None if bias is None else dense(bias)
            kind = Linear if n_dim == 2 else Experts
            parts[base] = kind(frozen(info.name), b)
            if bias is not None:
                used.add(f"{base}.bias")
        else:
            continue
        used.add(rest)
    for rest, info in by_suffix.items():
        if rest not in used:
            parts[rest] = dense(info)
    qkv = parts.get("attn_qkv")
    if isinstance(qkv, Linear) and qkv.bias is None and "attn_q.bias" in parts:
        # legacy files: a fused weight beside separate biases, which llama.cpp concatenates
        split = [parts.pop(f"attn_{x}.bias") for x in "qkv"]
        qkv.bias = torch.nn.Parameter(torch.cat(split).float(), requires_grad=False)
    return parts


def _check_block(g: GGUFFile, cfg: ModelConfig, il: int, parts: dict) -> None:
    mixer, ffn = cfg.layer_mixer[il], cfg.layer_ffn[il]
    need = ["attn_norm"] if cfg.arch.pre_norms else []
    if mixer.startswith("attention"):  # attention, or beside another mixer (falcon-h1)
        need.append("attn_output")
        need += (
            ["attn_qkv"]
            if "attn_qkv" in parts and "attn_q" not in parts
            else ["attn_q", "attn_k", "attn_v"]
        )
        if cfg.arch.qk_norm or cfg.arch.qk_norm_full:
            need += ["attn_q_norm", "attn_k_norm"]
    if ffn == "dense":
        need += ["ffn_up", "ffn_down"] + ([cfg.arch.ffn_norm_tensor] if cfg.arch.pre_norms else [])
        if not cfg.arch.fused_gate_up:
            need.append("ffn_gate")
    if cfg.arch.sandwich_norms:
        need += ["post_attention_norm", "post_ffw_norm"]
    missing = [f"blk.{il}.{n}.weight" for n in need if n not in parts]
    if missing:
        raise GGUFError(
            f"{g.path.name}: {cfg.name} model is missing tensor(s) {', '.join(missing)}"
        )
