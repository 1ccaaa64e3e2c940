"""`retrograd.load`: a GGUF model with its tokenizer, ready for notebooks, tests and commands.

The `Model` owns the file, the decoder and the tokenizer, and offers the small public API
(tokenize, detokenize, logits, log-probabilities). Training loops reach into `model.decoder`;
`model.report` is what loading decided from the compute plan (retrograd/compute.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from retrograd import environ
from retrograd.compute import ComputePlan, Resolved
from retrograd.gguf import GGUFFile
from retrograd.model.config import ModelConfig
from retrograd.model.decoder import Decoder
from retrograd.model.device import apply_threads, configure_allocator, parse_dtype, resolve_device
from retrograd.model.loader import build_decoder


class Model:
    def __init__(self, gguf: GGUFFile, decoder: Decoder, report: Resolved):
        self.gguf = gguf
        self.decoder = decoder
        self.report = report
        self._tokenizer = None

    def __repr__(self) -> str:
        return f"Model({self.gguf.path.name!r}, {self.report.describe()})"

    @property
    def config(self) -> ModelConfig:
        return self.decoder.cfg

    @property
    def device(self) -> torch.device:
        return self.report.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.compute_dtype

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from retrograd.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_gguf(self.gguf)
        return self._tokenizer

    def tokenize(self, text: str, add_bos: bool = True, parse_special: bool = False) -> list[int]:
        return self.tokenizer.tokenize(text, add_bos=add_bos, parse_special=parse_special)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.detokenize(ids)

    def _ids(self, ids) -> torch.Tensor:
        t = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        return t[None] if t.dim() == 1 else t

    @torch.no_grad()
    def logits(self, ids) -> torch.Tensor:
        """float32 (len(ids), n_vocab); row i predicts token i + 1. A 2-D batch gives (B, T, V)."""
        batch = self._ids(ids)
        out = self.decoder.head(self.decoder(batch))
        return out[0] if torch.as_tensor(ids).dim() == 1 else out

    @torch.no_grad()
    def logprobs(self, ids) -> torch.Tensor:
        """float32 (len(ids) - 1,): log p(ids[i + 1] | ids[: i + 1])."""
        t = self._ids(ids)
        h = self.decoder(t)[0, :-1]
        target = t[0, 1:]
        out = torch.empty(target.shape[0], dtype=torch.float32, device=self.device)
        for s in range(0, target.shape[0], 256):  # bounded memory over a large vocabulary
            lp = torch.log_softmax(self.decoder.head(h[s : s + 256]), dim=-1)
            out[s : s + 256] = lp.gather(-1, target[s : s + 256, None])[:, 0]
        return out


def load(
    path: str | Path,
    device: str = "auto",
    dtype=None,
    threads: int | None = None,
    cache: str = "auto",
    plan: ComputePlan | None = None,
) -> Model:
    """Open a GGUF model.

    device: auto, cpu or gpu. dtype: torch.float32 (exactness), torch.bfloat16 (speed), or
    None for the fast one the device has (an adapter on top: trainable.lora.load_adapted).
    cache: auto, on or off for the dequantized-weight cache. plan: the compute plan a command
    built (retrograd/compute.py); by default one is built here from these arguments and the
    environment, whose variables win over them (RETRO_THREADS, RETRO_DEQUANT_CACHE).
    """
    if plan is None:
        plan = ComputePlan.of(
            environ.read(), device=device, dtype=dtype, threads=threads, cache=cache
        )
    apply_threads(plan.threads.intra)
    configure_allocator()
    dev = resolve_device(plan.device)
    g = GGUFFile(path)
    decoder, report = build_decoder(g, dev, parse_dtype(plan.dtype, dev), plan=plan)
    return Model(g, decoder, report)
