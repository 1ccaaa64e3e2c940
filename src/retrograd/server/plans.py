"""A run's plan (formats.md §9.3 PlanResponse.plan): steps, memory, levers, and the budgets.

`build_plan(cfg, server, provenance)` answers what a run will do before it starts: its
optimizer steps and iterations (counted as the loop counts them: the data tokenized with the
model's tokenizer for SFT and preference runs, the section's keys for rollout runs), an
estimate of its memory per post, the levers that would lower it, the share of examples cut to
`training.ctx`, the judge calls it will make, and warnings. `check_budget` refuses a plan over
the server's budgets (`insufficient-memory`, with the dominant posts and the levers that
would make it fit).

The memory estimate reads the GGUF header only (no weights):
- `base_weights`: the tensors as stored (quantized blocks stay quantized; the optional
  dequantized-weight cache is taken only where it fits, so it is not counted);
- `adapters_and_optimizer`: the trained parameters in f32, their gradients and the
  optimizer's state (adamw 8 bytes a parameter, muon 4, gefen 2, sgd 0);
- `activations`: what one pass of `micro_batch` tokens keeps for its backward, per layer
  (about 16 values a token per embedding dimension and 4 per feed-forward dimension) plus
  the attention scores against the `ctx` window; gradient checkpointing keeps one layer in
  `checkpoint_every_n_layers`;
- `kv_cache`: the window's keys and values (SFT), or the generation cache of
  `generation_concurrency` sequences of `ctx` tokens (rollout algorithms);
- `logits`: a pass's logits and their gradient, in vocabulary tiles when chunked;
- `reference` / `teacher`: the other model a run loads, as stored.
On a GPU every post counts against `vram_budget` and the memory-mapped file against
`ram_budget`; on the CPU everything counts against `ram_budget`. It is an estimate: a
calibrated plan (`?calibrate=true`) measures one step instead (probe.py).
"""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path
from typing import Any

from retrograd import environ
from retrograd.server.config import ServerConfig
from retrograd.server.problems import FieldError, Problem, pointer

SCHEMA_VERSION = 1
OPTIMIZER_BYTES = {"adamw": 8, "muon": 4, "gefen": 2, "sgd": 0}
ROLLOUT = ("ppo", "grpo", "agent_grpo")
MAX_COUNTED_BYTES = 64 << 20  # larger data is not tokenized for a plan (data_not_counted)


def _gpu() -> tuple[str, int] | None:
    """(name, bytes) of the first GPU, from nvidia-smi (no torch), or None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        name, mib = out.splitlines()[0].rsplit(",", 1)
        return name.strip(), int(mib) << 20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def host_memory() -> tuple[int | None, int | None]:
    """(total, available) bytes of host memory, from /proc/meminfo where there is one."""
    try:
        fields = dict(
            line.split(":", 1)
            for line in Path("/proc/meminfo").read_text().splitlines()
            if ":" in line
        )
        total = int(fields["MemTotal"].split()[0]) * 1024
        free = int(fields["MemAvailable"].split()[0]) * 1024
        return total, free
    except (OSError, KeyError, ValueError):
        return None, None


def total_ram() -> int | None:
    return host_memory()[0]


_GPU: list[tuple[str, int] | None] = []


def gpu() -> tuple[str, int] | None:
    """The first GPU (name, total bytes), asked once per process."""
    if not _GPU:
        _GPU.append(_gpu())
    return _GPU[0]


def total_vram() -> int | None:
    found = gpu()
    return found[1] if found is not None else None


def on_gpu(cfg) -> bool:
    return cfg.model.device == "gpu" or (cfg.model.device == "auto" and total_vram() is not None)


def _compute_bytes(gpu: bool) -> int:
    forced = environ.get("RETRO_DTYPE")
    if forced:
        return 4 if forced == "float32" else 2
    return 2 if gpu else 4


# -- the model's shape, from its header ----------------------------------------------------


class Shape:
    """What the estimate needs of a GGUF: its config and tensors, read from the header."""

    def __init__(self, path: Path):
        from retrograd.gguf import GGUFFile
        from retrograd.model.config import ModelConfig

        self.gguf = GGUFFile(path)
        self.cfg = ModelConfig.from_gguf(self.gguf)
        self.file_bytes = self.gguf.n_bytes
        self.linears = {
            n.removesuffix(".weight"): t
            for n, t in self.gguf.tensors.items()
            if n.endswith(".weight") and len(t.shape) in (2, 3)
        }

    def tokenizer(self):
        from retrograd.tokenizer import Tokenizer

        return Tokenizer.from_gguf(self.gguf)

    def lora_params(self, targets: list[str], rank: int) -> int:
        from retrograd.model.arch import auto_targets, match_targets

        names = list(self.linears)
        chosen: set[str] = set()
        for target in targets:
            expanded = (
                auto_targets(names, self.cfg.arch.lora_targets_auto)
                if target == "auto"
                else (target,)
            )
            for t in expanded:
                chosen.update(match_targets(names, t))
        total = 0
        for name in chosen:
            shape = self.linears[name].shape
            experts = shape[2] if len(shape) == 3 else 1
            total += rank * (shape[0] + shape[1]) * experts
        return total

    def base_params(self) -> int:
        """Float base tensors full training could train (an upper bound for partial)."""
        return sum(
            t.n_elements
            for n, t in self.gguf.tensors.items()
            if t.is_float and n != "token_embd.weight" and len(t.shape) <= 2
        )


def _trained_params(cfg, shape: Shape) -> int:
    mode = cfg.training.trainable
    if mode == "lora" and cfg.lora is not None and cfg.lora.init_adapter is not None:
        from retrograd.gguf import GGUFFile

        return sum(t.n_elements for t in GGUFFile(cfg.lora.init_adapter).tensors.values())
    lora = cfg.lora
    adapter = shape.lora_params(list(lora.targets), lora.rank) if lora is not None else 0
    if mode == "lora":
        return adapter
    if mode == "hybrid":
        return adapter + sum(
            t.n_elements
            for n, t in shape.gguf.tensors.items()
            if t.is_float and len(t.shape) == 1 and (n.endswith("norm.weight") or ".bias" in n)
        )
    return shape.base_params()


def _concurrency(cfg) -> int:
    t = cfg.training
    if t.generation_concurrency:
        return t.generation_concurrency
    algorithm = cfg.run.algorithm
    if algorithm == "grpo":
        answers = cfg.grpo.prompts_per_update * cfg.grpo.group_size
    elif algorithm == "ppo":
        answers = cfg.ppo.rollout_batch_size
    elif algorithm == "agent_grpo":
        answers = cfg.agent.scenarios_per_update * cfg.agent.group_size
    elif algorithm == "distill" and cfg.distill.mode == "on_policy":
        answers = cfg.distill.prompts_per_update * cfg.distill.samples_per_prompt
    else:
        return 0
    return min(answers, t.ctx, 256)


def memory_posts(cfg, shape: Shape, training=None) -> dict[str, int]:
    """Bytes per post for `cfg` (with `training` in place of cfg.training when given)."""
    t = training or cfg.training
    c = shape.cfg
    gpu = on_gpu(cfg)
    act = _compute_bytes(gpu)
    trained = _trained_params(cfg, shape)
    posts = {
        "base_weights": shape.file_bytes,
        "adapters_and_optimizer": trained * (8 + OPTIMIZER_BYTES.get(t.optimizer, 8)),
    }
    tokens = t.micro_batch
    per_layer = tokens * (16 * c.n_embd + 4 * c.n_ff) * act
    per_layer += tokens * min(t.ctx, c.n_ctx_train or t.ctx) * max(c.n_head, 1) * act
    layers = c.n_layer
    if t.gradient_checkpointing:
        layers = math.ceil(c.n_layer / t.checkpoint_every_n_layers) + 1
    posts["activations"] = per_layer * layers
    kv_bytes = 2 if t.kv_dtype == "f16" else 4
    per_token_kv = c.n_layer * c.n_head_kv * (c.head_dim + c.head_dim_v) * kv_bytes
    sequences = max(1, _concurrency(cfg)) if cfg.run.algorithm in (*ROLLOUT, "distill") else 1
    posts["kv_cache"] = per_token_kv * t.ctx * sequences
    if t.chunked_cross_entropy:
        rows = min(tokens, t.chunked_ce_seq_chunk or tokens)
        posts["logits"] = rows * math.ceil(c.n_vocab / t.chunked_ce_tiles) * 4 * 2
    else:
        posts["logits"] = tokens * c.n_vocab * 4 * 3
    if cfg.reference is not None:
        posts["reference"] = Path(cfg.reference.model).stat().st_size
    distill = getattr(cfg, "distill", None)
    if distill is not None and getattr(distill, "mode", None) == "on_policy":
        posts["teacher"] = Path(distill.teacher_path).stat().st_size
    return posts


def levers(cfg, shape: Shape, posts: dict[str, int]) -> list[dict[str, Any]]:
    """What the run could change to need less memory, each with the bytes it saves (applied
    one after the other, in this order)."""
    t = cfg.training
    out = []
    candidates: list[tuple[str, Any, str]] = []
    if not t.gradient_checkpointing:
        candidates.append(("training.gradient_checkpointing", True, "recompute activations"))
    if not t.chunked_cross_entropy:
        candidates.append(("training.chunked_cross_entropy", True, "logits in vocabulary tiles"))
    mb = t.micro_batch
    while mb > 1 and mb % 2 == 0:
        mb //= 2
        candidates.append(("training.micro_batch", mb, "fewer tokens per pass"))
    if cfg.run.algorithm in (*ROLLOUT, "distill"):
        concurrency = _concurrency(cfg)
        if concurrency > 1:
            candidates.append(
                (
                    "training.generation_concurrency",
                    max(1, concurrency // 4),
                    "fewer answers generated at once",
                )
            )
    training = t
    before = sum(posts.values())
    for path, value, why in candidates:
        key = path.split(".", 1)[1]
        changed = training.model_copy(update={key: value})
        if key == "micro_batch" and cfg.run.algorithm == "sft":  # the window stays whole
            ratio = t.micro_batch * t.gradient_accumulation // value
            changed = changed.model_copy(update={"gradient_accumulation": ratio})
        after = sum(_posts_for(cfg, shape, changed).values())
        if after < before:
            out.append({"path": path, "value": value, "saves_bytes": before - after, "why": why})
            training, before = changed, after
    return out


def _posts_for(cfg, shape: Shape, training) -> dict[str, int]:
    if training.generation_concurrency != cfg.training.generation_concurrency:
        cfg = cfg.model_copy(update={"training": training})
    return memory_posts(cfg, shape, training)


def memory(cfg, shape: Shape) -> dict[str, Any]:
    """The plan's memory: posts, where they count (vram or ram) and the totals."""
    posts = memory_posts(cfg, shape)
    gpu = on_gpu(cfg)
    total = sum(posts.values())
    dense = sum(t.n_elements for t in shape.linears.values()) * _compute_bytes(gpu)
    return {
        "estimated": True,
        "device": "cuda" if gpu else "cpu",
        "posts": [{"post": k, "bytes": v} for k, v in posts.items()],
        # taken at load only where it fits in the memory then free (model/loader.py)
        "optional": [{"post": "dequantized_weight_cache", "bytes": dense}],
        "vram_bytes": total if gpu else 0,
        "ram_bytes": shape.file_bytes if gpu else total,
        "total_bytes": total,
    }


# -- steps, iterations, truncation -----------------------------------------------------------


def chat_format(model: Path, template_variables=None):
    """The model's chat format from its header (no weights, no torch)."""
    from retrograd.tokenizer import ChatFormat, chat_template

    shape = Shape(model)
    tokenizer = shape.tokenizer()
    return ChatFormat(
        tokenizer, chat_template(tokenizer, shape.gguf.metadata, template_variables or {})
    )


def steps(cfg, warnings: list[dict]) -> dict[str, Any]:
    """total_steps, iterations and truncation fractions as the algorithm's loop counts them."""
    algorithm = cfg.run.algorithm
    out: dict[str, Any] = {"total_steps": None, "iterations": None, "truncation_fraction": None}
    rollouts = {
        "grpo": lambda: (cfg.grpo.updates, cfg.grpo.grpo_epochs),
        "ppo": lambda: (cfg.ppo.updates, cfg.ppo.ppo_epochs),
        "agent_grpo": lambda: (cfg.agent.updates, cfg.agent.epochs_per_update),
    }
    try:
        if algorithm == "sft":
            out.update(_sft_steps(cfg))
        elif algorithm in rollouts:
            updates, epochs = rollouts[algorithm]()
            out.update(total_steps=updates * epochs, iterations=updates)
        elif algorithm == "distill" and cfg.distill.mode == "on_policy":
            d = cfg.distill
            out.update(total_steps=d.updates * d.distill_epochs, iterations=d.updates)
        elif algorithm == "preference":
            out.update(_preference_steps(cfg))
        else:
            warnings.append(
                {
                    "code": "steps_counted_at_start",
                    "message": f"{algorithm} runs count their steps when they start",
                }
            )
    except Exception as error:  # noqa: BLE001 - the data's own problems surface when it runs
        warnings.append(
            {"code": "data_not_counted", "message": f"the data could not be counted: {error}"}
        )
    return out


def _sft_steps(cfg) -> dict[str, Any]:
    """SFT's steps as its loop counts them: the files tokenized with the model's template."""
    from retrograd.data.sft import infer_format, load_sft_data

    ctx, fmt = cfg.training.ctx, cfg.sft.data_format
    paths = [cfg.sft.data] + ([cfg.evaluation.data] if cfg.evaluation is not None else [])
    large = [p for p in paths if Path(p).stat().st_size > MAX_COUNTED_BYTES]
    if large:  # a plan answers within a request's time; the run counts its own steps
        raise ValueError(
            f"{Path(large[0]).name} is over {MAX_COUNTED_BYTES >> 20} MiB; the run counts "
            "its steps when it starts"
        )
    chat = None
    if any(infer_format(Path(p), fmt) == "jsonl" for p in paths):
        chat = chat_format(cfg.model.path, cfg.sft.template_variables)
    tokenizer = chat.tokenizer if chat is not None else Shape(cfg.model.path).tokenizer()
    sets = [load_sft_data(p, tokenizer, ctx, fmt, chat) for p in paths]
    out = {
        "total_steps": _sft_total(sets[0], cfg.training),
        "iterations": cfg.training.epochs,
        "truncation_fraction": sets[0].truncated / max(1, sets[0].rows),
    }
    if len(sets) > 1:
        out["eval_truncation_fraction"] = sets[1].truncated / max(1, sets[1].rows)
    return out


def _sft_total(data, training) -> int:
    """Optimizer steps as SFT's loop takes them (algorithms/step.py groups_of, without torch):
    each window of micro_batch x gradient_accumulation tokens with a trained target is one
    step (a window without one joins the next as its context)."""
    window = training.micro_batch * training.gradient_accumulation
    per_epoch = 0
    for example in data.examples:
        mask, n = example.mask, len(example.ids)
        per_epoch += sum(any(mask[a + 1 : min(a + window, n - 1) + 1]) for a in range(0, n, window))
    return per_epoch * training.epochs


def _preference_steps(cfg) -> dict[str, Any]:
    from retrograd.algorithms import preference

    pairs, _held, _prints = preference.load_pairs(cfg, chat_format(cfg.model.path))
    return {"total_steps": preference.total_steps(pairs, cfg), "iterations": cfg.training.epochs}


def judge_calls(cfg) -> int:
    """Calls the run's judge will answer: one per group of answers (rollouts), or 0."""
    if cfg.run.algorithm == "grpo" and cfg.grpo.judge is not None:
        return cfg.grpo.updates * cfg.grpo.prompts_per_update
    if cfg.run.algorithm == "agent_grpo" and cfg.agent.judge is not None:
        return cfg.agent.updates * cfg.agent.scenarios_per_update
    return 0


# -- the plan and the budgets ----------------------------------------------------------------


def leaves(value: Any, at: tuple[str, ...] = ()) -> list[str]:
    if isinstance(value, dict) and value:
        return [p for k, v in value.items() for p in leaves(v, (*at, str(k)))]
    return [".".join(at)] if at else []


def build_plan(
    cfg, provenance: dict[str, dict[str, str]], prefix: tuple[str, ...] = ()
) -> dict[str, Any]:
    """PlanResponse.plan for a validated run config; fills `provenance` with the defaults.
    `prefix` is where the document sits in the request (its errors' pointers)."""
    warnings: list[dict[str, Any]] = []
    try:
        shape = Shape(cfg.model.path)
    except Exception as error:  # noqa: BLE001 - whatever the header's problem, it is the model's
        raise Problem(
            "invalid-request",
            f"model.path: not a model this server can read: {error}",
            [FieldError(pointer(*prefix, "model", "path"), "unsupported_format", str(error))],
        ) from None
    effective = cfg.model_dump(mode="json", exclude_none=True)
    defaults = [p for p in leaves(effective) if p not in provenance]
    for path in defaults:
        provenance[path] = {"source": "default"}
    counted = steps(cfg, warnings)
    posts = memory_posts(cfg, shape)
    t = cfg.training
    if counted.get("truncation_fraction"):
        warnings.append(
            {
                "code": "examples_truncated",
                "field": "training.ctx",
                "message": f"{counted['truncation_fraction']:.0%} of the examples are longer "
                f"than ctx = {t.ctx} and are cut",
            }
        )
    if t.ctx > shape.cfg.n_ctx_train > 0:
        warnings.append(
            {
                "code": "ctx_exceeds_train_context",
                "field": "training.ctx",
                "message": f"ctx = {t.ctx} is past the model's trained context "
                f"({shape.cfg.n_ctx_train})",
            }
        )
    distill = getattr(cfg, "distill", None)
    if distill is not None and getattr(distill, "mode", None) == "topk_offline":
        warnings.append(
            {
                "code": "teacher_absent_from_the_memory_budget",
                "message": "offline distillation reads the teacher's predictions from its "
                "sidecar; the teacher is not loaded",
            }
        )
    plan = {
        "schema_version": SCHEMA_VERSION,
        **counted,
        "memory": memory(cfg, shape),
        "execution": {
            "algorithm": cfg.run.algorithm,
            "device": "cuda" if on_gpu(cfg) else "cpu",
            "trainable": t.trainable,
            "optimizer": t.optimizer,
            "ctx": t.ctx,
            "micro_batch": t.micro_batch,
            "gradient_accumulation": t.gradient_accumulation,
            "gradient_checkpointing": t.gradient_checkpointing,
            "generation_concurrency": _concurrency(cfg) or None,
        },
        "defaults_applied": defaults,
        "levers": levers(cfg, shape, posts),
        "judge_calls_expected": judge_calls(cfg),
        "warnings": warnings,
    }
    plan["execution"] = {k: v for k, v in plan["execution"].items() if v is not None}
    return plan


def budgets(server: ServerConfig) -> tuple[int | None, int | None]:
    """(vram, ram) bytes plans may use: each budget less the margin (None: no limit known)."""
    vram = server.vram_budget.bytes_of(total_vram())
    ram = server.ram_budget.bytes_of(total_ram())
    keep = 1.0 - server.margin
    return (
        int(vram * keep) if vram is not None else None,
        int(ram * keep) if ram is not None else None,
    )


def overflow(plan: dict[str, Any], vram: int | None, ram: int | None) -> int:
    mem = plan["memory"]
    over = 0
    if vram is not None and mem["vram_bytes"]:
        over = max(over, mem["vram_bytes"] - vram)
    if ram is not None:
        over = max(over, mem["ram_bytes"] - ram)
    return over


def check_budget(
    plan: dict[str, Any],
    server: ServerConfig,
    limits: tuple[int | None, int | None] | None = None,
    applied: list[dict] | None = None,
) -> None:
    """`insufficient-memory` when the plan needs more than the budgets (or `limits`)."""
    vram, ram = budgets(server)
    if limits is not None:
        vram = min(v for v in (vram, limits[0]) if v is not None) if limits[0] else vram
        ram = min(v for v in (ram, limits[1]) if v is not None) if limits[1] else ram
    over = overflow(plan, vram, ram)
    if over <= 0:
        return
    posts = sorted(plan["memory"]["posts"], key=lambda p: -p["bytes"])
    unlocks, saved = [], 0
    for lever in plan["levers"]:
        unlocks.append({"path": lever["path"], "value": lever["value"]})
        saved += lever["saves_bytes"]
        if saved >= over:
            break
    else:
        unlocks = []  # even every lever leaves it over
    raise Problem(
        "insufficient-memory",
        f"the run needs {over:,} bytes more than the server's budget "
        f"({plan['memory']['device']}); the largest posts: "
        + ", ".join(f"{p['post']} {p['bytes']:,}" for p in posts[:3]),
        meta={
            "overflow_bytes": over,
            "vram_budget_bytes": vram,
            "ram_budget_bytes": ram,
            "dominant_posts": posts[:3],
            "levers_applied": applied or [],
            "unlocks": unlocks,
        },
    )
