"""Preflight: run one LoRA training step on a tiny batch and record where every op ran.

An op whose tensors sit on another device than the one asked for (a host fallback), or
that the device refuses (NotImplementedError), slows or breaks every training step; this
check finds them before a run starts. It knows the decoder and LoRA, not optimizers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from retrograd.model.decoder import Decoder
from retrograd.trainable.lora import attach_lora


@dataclass
class PreflightReport:
    device: torch.device
    dtype: torch.dtype
    targets: list[str]
    n_ops: int = 0
    seconds: float = 0.0
    loss: float = 0.0
    fallbacks: dict[str, int] = field(default_factory=dict)  # op -> calls on another device
    failures: dict[str, str] = field(default_factory=dict)  # op -> error

    @property
    def problems(self) -> list[str]:
        return sorted(self.fallbacks) + sorted(self.failures)


class _DeviceAudit(TorchDispatchMode):
    def __init__(self, report: PreflightReport):
        super().__init__()
        self.report = report
        self.want = report.device.type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket.__name__)
        try:
            out = func(*args, **kwargs)
        except NotImplementedError as e:
            self.report.failures[name] = str(e).splitlines()[0]
            raise
        self.report.n_ops += 1
        leaves, _ = tree_flatten((args, kwargs, out))
        for t in leaves:
            # 0-dim CPU tensors are scalars every device accepts.
            if isinstance(t, torch.Tensor) and t.device.type != self.want and t.dim() > 0:
                self.report.fallbacks[name] = self.report.fallbacks.get(name, 0) + 1
                break
        return out


def preflight(decoder: Decoder, targets: list[str], tokens: int = 16) -> PreflightReport:
    """One forward and backward through fresh LoRA adapters on `targets`, audited."""
    report = PreflightReport(decoder.device, decoder.compute_dtype, [])
    adapters = attach_lora(decoder, targets, rank=8, alpha=16.0, seed=0)
    report.targets = list(adapters)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, decoder.cfg.n_vocab, (1, tokens), generator=gen).to(decoder.device)
    start = time.perf_counter()
    try:
        with _DeviceAudit(report):
            logits = decoder.head(decoder(ids))
            loss = F.cross_entropy(logits[0, :-1], ids[0, 1:])
            loss.backward()
        report.loss = float(loss.detach())
    except NotImplementedError:
        pass
    finally:
        modules = dict(decoder.named_modules())
        for name in adapters:  # leave the model as it was
            modules[name].lora = None
    report.seconds = time.perf_counter() - start
    return report
