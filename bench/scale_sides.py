"""The measurements of bench/scale.py, one per process: what each runs on a Llama-shaped model.

The Gemma benchmarks' sides, pointed at another model: SFT is bench/sft_sides.py's `worker_ours`
(`run_sft` from a run file) and `worker_loop` (PEFT + transformers), GRPO is bench/grpo_sides.py's
`measure_ours`, generation is bench/generate.py's `Ours` and bench/llamacpp.py's `LlamaBatched`.
Those modules name their model through `gemma()` and `hf_model()`; `point_at` replaces both in
this process. Here also: building the model file (with its memory sampled as it goes), the
transformers model made from the same GGUF (dequantized by gguf-py, tensor by tensor), and the
prompts every generation side reads. Each worker returns a dict of plain numbers; the driver,
the memory estimates and the report are bench/scale.py's.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from bench import grpo_sides, sft_sides
from bench.sft_sides import maxrss_mib

ROOT = Path(__file__).resolve().parent.parent
LENGTH_REWARD = ROOT / "examples/rewards/length.py"


def point_at(args) -> None:
    """Make the Gemma benchmarks' sides, in this process, train and load args.model."""
    path = Path(args.model)
    sft_sides.gemma = grpo_sides.gemma = lambda: path
    sft_sides.hf_model = lambda variant: hf_llama(path, args.size, variant)


# -- building the file -----------------------------------------------------------------------


class MemorySampler:
    """The process's peak resident memory split as /proc/self/status splits it: anonymous
    (what the machine must hold) and file-backed (pages of memory-mapped files: page cache)."""

    def __init__(self, every: float = 0.1):
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            for line in Path("/proc/self/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in self.peak:
                    self.peak[key] = max(self.peak[key], int(value.split()[0]) // 1024)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def worker_build(args) -> dict:
    """Write the F16 file as a stream, quantize it to Q4_K_M with llama.cpp, delete the F16."""
    from tests.factories import llama_shaped
    from tests.factories.llama_vendor import llama_vendor_dir

    vendor = llama_vendor_dir()
    shape = llama_shaped.SHAPES[args.size]
    started = time.perf_counter()
    with MemorySampler() as mem:
        out = llama_shaped.build(shape, Path(args.model), vendor, threads=args.build_threads)
    return {
        "seconds": time.perf_counter() - started,
        "maxrss_mib": maxrss_mib(),
        "anon_peak_mib": mem.peak["RssAnon"],
        "file_peak_mib": mem.peak["RssFile"],
        "file_bytes": out.stat().st_size,
        "threads": args.build_threads,
    }


def worker_inputs(args) -> dict:
    """The SFT windows (bench/sft.py's corpus, cut by this model's tokenizer) and the
    generation prompts, written to the work folder for every side to read."""
    import retrograd
    from bench import generate, sft

    sft.gemma = lambda: Path(args.model)
    sft.write_corpus(Path(args.workdir), args.warmup + args.steps)
    tok = retrograd.load_tokenizer(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    ids = {b: generate.prompts(tok, b, args.gen_prompt) for b in [1 + max(batches), *batches]}
    (Path(args.workdir) / "prompts.json").write_text(json.dumps(ids))
    return {"prompts": {b: len(p) for b, p in ids.items()}}


# -- the transformers peer -------------------------------------------------------------------

HF_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
ROWS = 4096  # rows dequantized at a time: gguf-py's numpy dequantizers make several copies


def hf_name(name: str) -> str | None:
    """The transformers parameter a GGUF tensor fills (None: rope_freqs, computed by HF)."""
    if name.startswith("blk."):
        _, il, part, _ = name.split(".")
        return f"model.layers.{il}.{HF_NAMES[part]}.weight"
    return {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }.get(name)


def unpermute(w, n_head: int):
    """llama.cpp's converter interleaves q and k rows for its rope; transformers' halves."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_llama(path: Path, size: str, variant: str):
    """transformers' LlamaForCausalLM holding the GGUF's weights in the variant's dtype: each
    tensor dequantized by gguf-py (a block of rows at a time) and copied into place, so that
    loading holds the model once plus one block in float32."""
    import numpy as np
    import torch
    from gguf.quants import dequantize
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    from retrograd.gguf import GGUFFile
    from tests.factories.llama_shaped import N_VOCAB, RMS_EPS, ROPE_BASE, SHAPES

    dtype = getattr(torch, sft_sides.parse_variant(variant)[0])
    s = SHAPES[size]
    config = LlamaConfig(
        vocab_size=N_VOCAB,
        hidden_size=s.n_embd,
        intermediate_size=s.n_ff,
        num_hidden_layers=s.n_layer,
        num_attention_heads=s.n_head,
        num_key_value_heads=s.n_head_kv,
        head_dim=s.head_dim,
        max_position_embeddings=s.context,
        rms_norm_eps=RMS_EPS,
        tie_word_embeddings=s.tied,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": ROPE_BASE,
            "factor": s.rope_factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        bos_token_id=128000,
        eos_token_id=128001,
    )
    with no_init_weights():  # allocated in dtype, left uninitialized: every tensor is copied in
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    params = dict(model.named_parameters())
    for info in GGUFFile(path).tensors.values():
        name = hf_name(info.name)
        if name is None:
            continue
        rows = info.shape[0] if len(info.shape) == 2 else 1
        raw = info.data.reshape(rows, -1)
        # q and k are unpermuted whole (a head's rows belong together); others by blocks
        step = rows if info.name.endswith(("attn_q.weight", "attn_k.weight")) else ROWS
        target = params[name].data.view(rows, -1)
        with torch.no_grad():
            for r in range(0, rows, step):
                block = dequantize(raw[r : r + step], info.ggml_type)
                if info.name.endswith("attn_q.weight"):
                    block = unpermute(block, s.n_head)
                elif info.name.endswith("attn_k.weight"):
                    block = unpermute(block, s.n_head_kv)
                target[r : r + step].copy_(torch.from_numpy(np.require(block, requirements="W")))
    if s.tied:
        model.tie_weights()
    return model


# -- SFT and GRPO: the Gemma benchmarks' workers on this model --------------------------------


def worker_sft_ours(args) -> dict:
    point_at(args)
    return sft_sides.worker_ours(args)


def worker_sft_peer(args) -> dict:
    point_at(args)
    return sft_sides.worker_loop(args)


def worker_grpo(args) -> dict:
    """bench/grpo.py's update (LoRA r8 on 7 projections, 32 answers of exactly args.new tokens,
    one pass, one AdamW step) rewarded by examples/rewards/length.py instead of arithmetic: a
    random model answers no sum right, every group's rewards would be equal and the loop would
    skip the optimizer pass. The reward falls linearly from args.new / 3 words to args.new,
    where the word counts of random tokens lie, so a group's answers get different rewards."""
    from retrograd.algorithms.grpo import run_grpo

    point_at(args)
    grpo_sides.ignore_end_of_generation()
    run_file = Path(args.workdir) / "grpo.toml"
    words = max(2, args.new // 3)
    reward = [sys.executable, LENGTH_REWARD.as_posix(), "--words", str(words)]
    run_file.write_text(
        grpo_sides.RUN_FILE.format(
            model=Path(args.model).as_posix(),
            rank=sft_sides.RANK,
            alpha=sft_sides.ALPHA,
            targets=json.dumps(sft_sides.OURS_TARGETS),
            threads=args.threads,
            lr=grpo_sides.LR,
            ctx=args.ctx,
            prompts=grpo_sides.PROMPTS.as_posix(),
            reward=json.dumps(reward),
            updates=args.warmup_updates + 1,
            prompts_per_update=args.prompts,
            group=args.group,
            clip_low=grpo_sides.CLIP_LOW,
            clip_high=grpo_sides.CLIP_HIGH,
            new=args.new,
        )
    )
    args.warmup = args.warmup_updates  # measure_ours times the updates after the warm-up
    positions = count_positions()
    return grpo_sides.measure_ours(args, run_grpo, run_file) | {"positions": positions}


def count_positions() -> list[int]:
    """Per optimizer pass of this process (policy.train), the positions its frozen products
    run over: each group's prompt once (the shared-prefix fan-out), then its answers' tokens.
    The list fills as the passes run."""
    from retrograd.algorithms import policy

    seen: list[int] = []
    train = policy.train

    def counted(run, backend, own, *rest, **kw):
        prompts = {id(r.prompt): len(r.prompt.ids) for r in own}
        seen.append(sum(r.n_tokens for r in own) + sum(prompts.values()))
        return train(run, backend, own, *rest, **kw)

    policy.train = counted
    return seen


# -- generation: ours and llama.cpp, each alone ----------------------------------------------


def prompts_of(args) -> dict[int, list[list[int]]]:
    ids = json.loads((Path(args.workdir) / "prompts.json").read_text())
    return {int(b): p for b, p in ids.items()}


def rates(generate, args) -> dict:
    """Generated tokens per second at each batch size, prefill included, after a warm-up of 8
    tokens at every size (fused kernels compile then; llama.cpp makes its contexts)."""
    batches = [int(b) for b in args.batches.split(",")]
    ids = prompts_of(args)
    for b in batches:
        generate(ids[1 + max(batches)][1 : b + 1], 8)  # other prompts than the timed ones
    out = {}
    for b in batches:
        t = time.perf_counter()
        made = generate(ids[b], args.gen_new)
        dt = time.perf_counter() - t
        assert all(len(m) == args.gen_new for m in made)
        out[str(b)] = b * args.gen_new / dt
    return {"tok_s": out, "maxrss_mib": maxrss_mib()}


def worker_gen_ours(args) -> dict:
    """Our sampler (bench/generate.py's `Ours`: greedy, fast sampling context, end of
    generation ignored), the model loaded with the cache the driver chose."""
    import torch

    from bench.generate import Ours

    torch.set_num_threads(args.threads)
    ours = Ours(args.model, [], args.gen_prompt)
    return rates(ours.generate, args) | {"cache": ours.model.report.describe()}


def worker_gen_llama(args) -> dict:
    from bench.llamacpp import LlamaBatched

    peer = LlamaBatched(args.model, args.threads, args.gen_prompt + args.gen_new + 8)
    return rates(peer.generate, args)
