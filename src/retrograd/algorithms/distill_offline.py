"""Offline top-k distillation: the teacher's predictions stored once, then SFT's steps with a
KL loss toward them.

Two commands:
- `retrograd distill-teacher` (write_sidecar): the teacher alone is loaded; every trained
  position of the chat corpus (assistant tokens, as SFT tokenizes them at the sidecar's ctx)
  gets the teacher's k most likely next tokens and their log-probabilities, in a .topk sidecar
  (data/topk.py) whose header records the corpus's, the tokenizer's and the teacher's
  fingerprints.
- `retrograd train` with mode = "topk_offline" (run_distill_offline): the sidecar is checked
  against the corpus, the tokenizer and the ctx before the student loads, then the SFT loop
  (sft.fit: windows, passes, steps, checkpoints, exact resume) runs with the loss
  losses.distill.topk_forward_kl at each trained position instead of the NLL: the mean over a
  step's trained positions of KL(teacher ‖ student) on the k tokens and the tail. It reports
  SFT's metrics (train/loss is that KL). No scheduled evaluation: `retrograd bench` measures
  KL to the teacher, top-1 agreement and perplexity.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from retrograd.algorithms import context, frame
from retrograd.algorithms.sft import Corpus, fit
from retrograd.checkpoint import outputs
from retrograd.data.sft import SFTDataset, load_sft_data
from retrograd.data.topk import TopK, read_topk, tokenizer_fingerprint, write_topk
from retrograd.errors import ConfigError, DataError
from retrograd.losses.distill import topk_forward_kl
from retrograd.model.logprobs import ids_logprobs, topk_logprobs

log = logging.getLogger(__name__)
DEFAULT_K = 16
HEAD_CHUNK = 64  # positions whose full-vocabulary logits live at once


# -- the teacher's sidecar ------------------------------------------------------------------


@dataclass
class SidecarSummary:
    path: Path
    examples: int
    positions: int
    k: int
    seconds: float
    top1_agreement: float  # share of positions whose teacher top-1 is the corpus's token


def write_sidecar(
    cfg,
    *,
    data: str | Path | None = None,
    out: str | Path | None = None,
    k: int = DEFAULT_K,
    ctx: int | None = None,
    teacher: str | Path | None = None,
    progress=None,
) -> SidecarSummary:
    """The teacher's top-k predictions at every trained position of the corpus, written
    atomically to `out` ([distill].sidecar by default). Everything checkable is checked
    before the teacher's weights load."""
    from retrograd.checkpoint import model_identity
    from retrograd.gguf import GGUFFile

    d = cfg.distill
    started = time.perf_counter()
    teacher = Path(teacher or d.teacher_path)
    data = Path(data or getattr(d, "data", None) or _missing("--data", "[distill].data"))
    out = Path(out or getattr(d, "sidecar", None) or _missing("--out", "[distill].sidecar"))
    ctx = ctx or cfg.training.ctx
    if k < 1:
        raise ConfigError(f"--k {k}: must be at least 1")
    if ctx < 2:
        raise ConfigError(f"--ctx {ctx}: must be at least 2")
    if not teacher.is_file():
        raise ConfigError(f"teacher {teacher}: no such file")
    for name, path in (("the corpus", data), ("the teacher", teacher)):
        if path.exists() and out.exists() and path.resolve() == out.resolve():
            raise ConfigError(f"--out {out}: it is {name}; choose another file")
    outputs.check_writable("--out", out)
    gguf = GGUFFile(teacher)
    vocab = len(gguf.get("tokenizer.ggml.tokens") or [])
    if vocab and k > vocab:
        raise ConfigError(f"--k {k}: more than the teacher's {vocab} tokens")
    chat = context.file_chat_format(teacher)
    corpus = load_sft_data(data, chat.tokenizer, ctx, "jsonl", chat)
    from retrograd.model.model import load

    model = load(teacher, device=cfg.model.device, threads=cfg.training.threads)
    decoder = model.decoder
    counts, targets, ids, lps = [], [], [], []
    agree = 0
    for n, example in enumerate(corpus.examples):
        positions = trained_positions(example)
        with torch.no_grad():
            x = torch.tensor([example.ids], dtype=torch.long, device=decoder.device)
            h = decoder(x)[0][torch.as_tensor(positions, device=decoder.device)]
            top_ids, top_lps = topk_logprobs(decoder, h, k, seq_chunk=HEAD_CHUNK)
        want = np.asarray([example.ids[p + 1] for p in positions], dtype=np.int32)
        counts.append(len(positions))
        targets.append(want)
        ids.append(top_ids.cpu().numpy().astype(np.int32))
        lps.append(top_lps.cpu().numpy().astype(np.float32))
        agree += int((ids[-1][:, 0] == want).sum())
        if progress is not None:
            progress(n + 1, len(corpus.examples))
    topk = TopK(
        k,
        ctx,
        {"file": data.name, "sha256": corpus.fingerprint},
        tokenizer_fingerprint(gguf.metadata),
        {"file": teacher.name, "fingerprint": model_identity(teacher).fingerprint},
        np.asarray(counts, dtype=np.int32),
        np.concatenate(targets),
        np.concatenate(ids),
        np.concatenate(lps),
    )
    write_topk(out, topk)
    total = int(topk.counts.sum())
    return SidecarSummary(
        out, len(counts), total, k, time.perf_counter() - started, agree / max(total, 1)
    )


def _missing(flag: str, key: str):
    raise ConfigError(f"{flag}: required (the run file has no {key})")


def trained_positions(example) -> list[int]:
    """Positions p whose next token ids[p + 1] trains (mask[p + 1] = 1), in order."""
    return [p for p in range(len(example.ids) - 1) if example.mask[p + 1]]


def check_sidecar_header(topk: TopK, tokenizer: str, ctx: int, where: str) -> None:
    """Refuse a sidecar written with another tokenizer or at another ctx (before the corpus
    is tokenized: at another ctx its examples may not even be the same)."""
    again = "; write it again with `retrograd distill-teacher`"
    if topk.tokenizer != tokenizer:
        raise DataError(
            f"{where}: written with another tokenizer than the model's ({topk.teacher.get('file')}"
            f" does not share its vocabulary){again} from a teacher with the model's tokenizer"
        )
    if topk.ctx != ctx:
        raise DataError(
            f"{where}: written at ctx {topk.ctx}, the run has [training].ctx = {ctx}; set "
            f"ctx = {topk.ctx}, or write it again with `retrograd distill-teacher --ctx {ctx}`"
        )


def check_sidecar_ids(topk: TopK, n_vocab: int, where: str) -> None:
    """Every teacher id and target a token of the model's vocabulary: a sidecar may be anyone's,
    and an id past the vocabulary would fail inside the loss's gather (a device assert on a
    GPU) rather than here, naming the file."""
    for name in ("ids", "targets"):
        values = getattr(topk, name)
        outside = values[(values < 0) | (values >= n_vocab)]
        if outside.size:
            raise DataError(
                f"{where}: {name} holds token {int(outside[0])}, outside the model's vocabulary "
                f"of {n_vocab}; write it again with `retrograd distill-teacher`"
            )


def check_sidecar(topk: TopK, corpus: SFTDataset, where: str) -> None:
    """Refuse a sidecar written for another corpus, or whose positions are not this run's (a
    teacher whose chat template renders the corpus differently)."""
    again = "; write it again with `retrograd distill-teacher`"
    if topk.corpus.get("sha256") != corpus.fingerprint:
        raise DataError(
            f"{where}: written for {topk.corpus.get('file')} (sha256 "
            f"{str(topk.corpus.get('sha256'))[:12]}...), not for [distill].data = "
            f"{corpus.path.name} (sha256 {corpus.fingerprint[:12]}...){again}"
        )
    if len(topk.counts) != len(corpus.examples):
        raise DataError(
            f"{where}: holds {len(topk.counts)} examples, the corpus has "
            f"{len(corpus.examples)}{again}"
        )
    offsets = topk.offsets
    for n, example in enumerate(corpus.examples):
        want = [example.ids[p + 1] for p in trained_positions(example)]
        got = topk.targets[offsets[n] : offsets[n + 1]]
        if len(got) != len(want) or not np.array_equal(got, want):
            raise DataError(
                f"{where}: its tokens at {example.where} differ from this run's rendering of "
                f"the line (the teacher's chat template is not the model's){again}"
            )


# -- training --------------------------------------------------------------------------------


def run_distill_offline(cfg, door=None, *, resume=None, sinks=None, run_file=None) -> frame.Result:
    d = cfg.distill
    if cfg.evaluation is not None:
        raise ConfigError(
            "[evaluation]: offline distillation runs no scheduled evaluation; remove the "
            "section and measure with `retrograd bench` (KL to the teacher, top-1 agreement)"
        )
    door = frame.prepare(cfg, door, resume=resume, sinks=sinks, run_file=run_file)
    # the corpus, tokenized with the student's format, and the sidecar, checked against it,
    # before the weights load
    topk = read_topk(d.sidecar, f"[distill].sidecar = {d.sidecar}")
    metadata = _metadata(cfg.model.path)
    check_sidecar_header(topk, tokenizer_fingerprint(metadata), cfg.training.ctx, f"{d.sidecar}")
    check_sidecar_ids(topk, len(metadata.get("tokenizer.ggml.tokens") or ()), f"{d.sidecar}")
    chat = context.file_chat_format(cfg.model.path)
    train = load_sft_data(d.data, chat.tokenizer, cfg.training.ctx, "jsonl", chat)
    check_sidecar(topk, train, f"{d.sidecar}")
    model = frame.model_of(cfg, door)
    log.info("data: %s; sidecar: %d positions, k = %d", train.describe(), len(topk.targets), topk.k)
    epochs = d.offline_epochs
    corpus = Corpus(
        train,
        None,
        epochs,
        True,  # shuffled each epoch from [lora].seed (or its default), as SFT's default
        {"train": train.fingerprint, "sidecar": _sidecar_id(topk)},
        {"mode": "topk_offline", "k": topk.k},
        pass_loss=_TopKLoss(topk, train).of,
    )
    return fit(cfg, model, corpus, door)


def _metadata(path) -> dict:
    from retrograd.gguf import GGUFFile

    return GGUFFile(path).metadata


def _sidecar_id(topk: TopK) -> str:
    """What resume checks of the sidecar: its teacher and its predictions' bytes."""
    import hashlib

    h = hashlib.sha256(str(topk.teacher).encode())
    h.update(topk.ids.tobytes())
    h.update(topk.logprobs.tobytes())
    return "sha256:" + h.hexdigest()


class _TopKLoss:
    """Per example, step.PassLoss: the summed top-k KL at a pass's trained positions."""

    def __init__(self, topk: TopK, corpus: SFTDataset):
        self.topk, self.offsets = topk, topk.offsets
        # rank of each position among its example's trained positions: cumsum of the mask
        self.rank = [np.cumsum(np.asarray(e.mask[1:], dtype=np.int64)) - 1 for e in corpus.examples]

    def of(self, example: int):
        def pass_loss(decoder, h, positions, targets):
            rows = self.offsets[example] + self.rank[example][positions.cpu().numpy()]
            ids = torch.from_numpy(self.topk.ids[rows].astype(np.int64)).to(h.device)
            teacher = torch.from_numpy(np.array(self.topk.logprobs[rows])).to(h.device)
            student = ids_logprobs(decoder, h, ids, seq_chunk=HEAD_CHUNK)
            return topk_forward_kl(student, teacher).sum()

        return pass_loss
