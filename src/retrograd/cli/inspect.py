"""Show a GGUF model: architecture, tensor types, LoRA targets, what can be trained, device.

Reads only the file's header and metadata (no torch, no weights), so it answers in about a
second even for a 262k-token vocabulary.

Example:
  retrograd inspect --model gemma-3-270m-q4_k_m.gguf --ranks 4
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from retrograd.cli.common import add_device_flag, add_model_flag
from retrograd.gguf import GGUFFile
from retrograd.model.arch import FLOAT_PARTS, TARGET_ALIASES, alias_suffixes, auto_targets
from retrograd.model.config import ModelConfig
from retrograd.model.device import probe_device
from retrograd.text import printable


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flag(p)
    add_device_flag(p)
    p.add_argument(
        "--ranks",
        type=_positive,
        default=2,
        metavar="N",
        help="the world size for the memory per rank under none, ddp and fsdp2 "
        "(torchrun's ranks, all machines together; default 2; docs/distributed.md)",
    )


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"--ranks {text}: must be a whole number of at least 1")
    return n


def _group(name: str) -> str:
    return re.sub(r"^blk\.\d+\.", "blk.*.", name)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def hyperparameters(cfg: ModelConfig) -> list[tuple[str, str]]:
    swa = (
        f"{cfg.swa_window} on {sum(cfg.swa_layers)} of {cfg.n_layer} layers"
        if cfg.swa_window
        else "none"
    )
    rows = [
        ("layers", str(cfg.n_layer)),
        ("token mixers", _kinds(cfg.layer_mixer)),
        ("feed-forward kinds", _kinds(cfg.layer_ffn)),
        ("embedding", str(cfg.n_embd)),
        ("feed-forward", str(cfg.n_ff)),
        ("attention heads", f"{cfg.n_head} query, {cfg.n_head_kv} key/value, {cfg.head_dim} dims"),
        (
            "rope",
            f"{cfg.arch.rope}, {cfg.n_rot} dims, base {cfg.rope_base:g}"
            + (f" (local layers {cfg.rope_base_swa:g})" if cfg.swa_window else ""),
        ),
        ("sliding window", swa),
        ("vocabulary", f"{cfg.n_vocab:,}"),
        ("context (trained)", f"{cfg.n_ctx_train:,}"),
        ("rms eps", f"{cfg.rms_eps:g}"),
        ("output head", "tied to token_embd" if cfg.tied_output else "output.weight"),
    ]
    if cfg.final_softcap:
        rows.append(("logit soft-cap", f"{cfg.final_softcap:g}"))
    if cfg.attn_softcap:
        rows.append(("attention soft-cap", f"{cfg.attn_softcap:g}"))
    return rows + _scalings(cfg)


def _scalings(cfg: ModelConfig) -> list[tuple[str, str]]:
    """Rows for the families' rope scaling, layers without rope and constant multipliers."""
    rows = []
    if cfg.yarn is not None and cfg.yarn.ext_factor:
        factor = 1.0 / cfg.rope_freq_scale
        rows.append(("rope scaling", f"yarn x{factor:g} from {cfg.yarn.n_ctx_orig:,} tokens"))
    elif cfg.rope_freq_scale != 1.0:
        rows.append(("rope scaling", f"linear x{1.0 / cfg.rope_freq_scale:g}"))
    if cfg.layer_rope and not all(cfg.layer_rope):
        off = [str(il) for il, on in enumerate(cfg.layer_rope) if not on]
        rows.append(("layers without rope", ", ".join(off)))
    scales = [
        (name, v)
        for name, v in (
            ("embeddings", cfg.embedding_scale),
            ("residual", cfg.residual_scale),
            ("logits /", cfg.logit_scale),
        )
        if v != 1.0
    ]
    if scales:
        rows.append(("multipliers", ", ".join(f"{n} {v:g}" for n, v in scales)))
    if cfg.attn_temp_scale:
        temp = f"1 + {cfg.attn_temp_scale:g} ln(floor(pos / {cfg.attn_temp_floor}) + 1)"
        rows.append(("query temperature", temp))
    return rows


def _kinds(per_layer: tuple[str, ...]) -> str:
    """ "attention in 1, 3; shortconv in 0, 2" (every layer alike: just the name)."""
    layers: dict[str, list[int]] = defaultdict(list)
    for il, kind in enumerate(per_layer):
        layers[kind].append(il)
    if len(layers) == 1:
        return f"{per_layer[0]} in every layer"
    return "; ".join(f"{k} in {', '.join(map(str, ils))}" for k, ils in layers.items())


def lora_targets(g: GGUFFile, cfg: ModelConfig) -> list[tuple[str, str, int, str]]:
    """(alias, tensor pattern, count, shape) for every alias this model has, then the other
    matrix weights a pattern can name (alias "-": short-convolution and SSM projections,
    routers, experts)."""
    rows, named = [], set()
    for alias in TARGET_ALIASES:
        if alias == "output" and cfg.tied_output:
            continue
        for suffix in alias_suffixes(alias):  # ffn_up: dense ffn_up, experts' ffn_up_exps
            names = [
                n for n in g.tensors if n == f"{suffix}.weight" or n.endswith(f".{suffix}.weight")
            ]
            if names:
                shape = "x".join(str(d) for d in g.tensors[names[0]].shape)
                rows.append((alias, _group(names[0]), len(names), shape))
                named.update(_group(n) for n in names)
    others: dict[str, list[str]] = defaultdict(list)
    for name, t in g.tensors.items():
        group = _group(name)
        part = group.removeprefix("blk.*.")
        if (
            group in named
            or not name.endswith(".weight")
            or len(t.shape) < 2
            or part in FLOAT_PARTS
            or part.endswith("norm.weight")  # norms per group (ssm_norm) are 2-D, not matrices
            or name == "token_embd.weight"
        ):
            continue
        others[group].append(name)
    for group, names in others.items():
        shape = "x".join(str(d) for d in g.tensors[names[0]].shape)
        rows.append(("-", group, len(names), shape))
    return rows


def trainability(g: GGUFFile, cfg: ModelConfig) -> tuple[dict, dict]:
    """Tensor groups that full/partial modes could train, and those that never can, with why."""
    can, never = defaultdict(int), defaultdict(int)
    for name, t in g.tensors.items():
        group = _group(name)
        why = _never(g, cfg, name, t)
        if why is None:
            can[(group, t.type_name)] += 1
        else:
            never[(group, why)] += 1
    return can, never


def _never(g: GGUFFile, cfg: ModelConfig, name: str, t) -> str | None:
    """Why a base tensor never trains (the reference's exclusions, and what this version
    does not train), or None when full could train it."""
    if name == "token_embd.weight":
        return "input embedding" + (" (and the tied output head)" if cfg.tied_output else "")
    if name.startswith("rope_") or ".rope_" in name:
        return "rotary constants"
    if not t.is_float:
        return f"quantized ({t.type_name})"
    part = _group(name).removeprefix("blk.*.")
    weight = g.tensors.get(name.removesuffix(".bias") + ".weight")
    if name.endswith(".bias") and weight is not None and len(weight.shape) == 2:
        return None  # a projection's bias
    if part in FLOAT_PARTS or not name.endswith(".weight") or len(t.shape) > 2:
        return "recurrence constants, lone biases and expert tensors (not trained)"
    return None


def _is_norm(name: str) -> bool:
    return _group(name).removesuffix(".weight").endswith("norm")


def per_mode(g: GGUFFile, cfg: ModelConfig) -> list[tuple[str, str]]:
    """(mode, what it would train on this model) for the four trainable modes."""
    can = [n for n, t in g.tensors.items() if _never(g, cfg, n, t) is None]
    norms = [n for n in can if _is_norm(n)]
    biases = [n for n in can if n.endswith(".bias")]
    matrices = [n for n in can if n not in norms and n not in biases]

    def count(names: list[str]) -> str:
        n = sum(g.tensors[x].n_elements for x in names)
        return f"{len(names)} tensors, {n:,} parameters"

    quantized = sum(1 for t in g.tensors.values() if not t.is_float)
    full = f"{count(can)}: {len(matrices)} matrices, {len(norms)} norms, {len(biases)} biases"
    if quantized:
        full += f"; its {quantized} quantized tensors stay frozen"
    rows = [
        ("lora", "an adapter on \\[lora].targets (LoRA targets above); base tensors frozen"),
        ("full", full),
        (
            "partial",
            "the \\[trainable] selection (layers, modules, norms, biases, output_head) "
            "among full's tensors",
        ),
        ("hybrid", f"an adapter, plus norms ({count(norms)}) and/or biases ({count(biases)})"),
    ]
    return rows


def _sharded(g: GGUFFile, name: str, t) -> bool:
    """Whether fsdp2 shards this tensor: a block's matrices (as stored), norms and the biases
    of its matrices are Parameters of the block; its other float tensors are buffers."""
    part = name.split(".", 2)[2] if name.startswith("blk.") else None
    if part is None or part in FLOAT_PARTS:
        return False
    weight = g.tensors.get(name.removesuffix(".bias") + ".weight")
    matrix_bias = name.endswith(".bias") and weight is not None and len(weight.shape) >= 2
    return len(t.shape) >= 2 or _is_norm(name) or matrix_bias


def rank_memory(g: GGUFFile, ranks: int) -> list[tuple[str, int, str]]:
    """(parallel, frozen-weight bytes a rank holds at most, what the figure counts) for none,
    ddp and fsdp2 over `ranks` ranks. The trained tensors, their optimizer state and the
    activations come on top, the same under each (each rank holds them whole)."""
    layers: dict[str, int] = defaultdict(int)
    whole = 0
    for name, t in g.tensors.items():
        if _sharded(g, name, t):
            layers[name.split(".")[1]] += t.n_bytes
        else:
            whole += t.n_bytes
    blocks = sum(layers.values())
    largest = max(layers.values(), default=0)
    shard = -(-blocks // ranks) + whole + min(2, len(layers)) * largest
    return [
        ("none", g.n_bytes, "one process: the whole file"),
        ("ddp", g.n_bytes, f"each of the {ranks} ranks holds the whole file"),
        (
            "fsdp2",
            shard if ranks > 1 else g.n_bytes,
            f"1/{ranks} of the blocks ({_mib(blocks)} whole) + what stays whole "
            f"(embedding, head, output norm: {_mib(whole)}) + 2 gathered blocks "
            f"({_mib(largest)} each) in flight; the dequantized-weight cache is off",
        ),
    ]


def _safe(value: object) -> str:
    """Text read from the file (a name, an architecture, tensor names) for a rich cell: its
    brackets not markup, its control characters shown (the file may be anyone's)."""
    return escape(printable(str(value)))


def run(args: argparse.Namespace) -> int:
    g = GGUFFile(args.model)
    cfg = ModelConfig.from_gguf(g)
    device = probe_device(args.device)
    con = Console()
    con.print(
        f"[bold]{_safe(g.path.name)}[/]  {_safe(g.get('general.name', ''))}  "
        f"architecture [bold]{_safe(cfg.name)}[/], {len(g.tensors)} tensors, {_mib(g.n_bytes)}"
    )

    t = Table(title="Hyper-parameters", show_header=False, title_justify="left")
    for k, v in hyperparameters(cfg):
        t.add_row(_safe(k), _safe(v))
    con.print(t)

    by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for info in g.tensors.values():
        by_type[info.type_name][0] += 1
        by_type[info.type_name][1] += info.n_bytes
    t = Table(title="Tensor types", title_justify="left")
    for col in ("type", "tensors", "bytes"):
        t.add_column(col, justify="right" if col != "type" else "left")
    for name, (count, size) in sorted(by_type.items(), key=lambda kv: -kv[1][1]):
        t.add_row(_safe(name), str(count), _mib(size))
    con.print(t)

    bases = [name.removesuffix(".weight") for name in g.tensors]
    t = Table(title="LoRA targets", title_justify="left")
    for col in ("alias", "tensors", "count", "shape (out x in)"):
        t.add_column(col)
    for alias, pattern, count, shape in lora_targets(g, cfg):
        t.add_row(_safe(alias), _safe(pattern), str(count), _safe(shape))
    con.print(t)
    con.print(
        "alias - : name the tensor pattern in \\[lora].targets\n"
        f"auto picks: {', '.join(auto_targets(bases, cfg.arch.lora_targets_auto))}"
        + ("  (the head is tied to token_embd: not a target)" if cfg.tied_output else "")
    )

    can, never = trainability(g, cfg)
    t = Table(
        title="Base tensors (training.trainable = full / partial / hybrid)", title_justify="left"
    )
    for col in ("tensors", "count", "trainable"):
        t.add_column(col)
    for (group, typ), n in sorted(can.items()):
        t.add_row(_safe(group), str(n), f"yes ({_safe(typ)})")
    for (group, why), n in sorted(never.items()):
        t.add_row(_safe(group), str(n), f"[red]never[/]: {_safe(why)}")
    con.print(t)
    t = Table(title="What each training.trainable mode trains", title_justify="left")
    t.add_column("mode")
    t.add_column("trains")
    for mode, what in per_mode(g, cfg):
        t.add_row(mode, _safe(what))
    con.print(t)
    ranks = getattr(args, "ranks", 2)
    t = Table(title=f"Frozen weights per rank on {ranks} ranks", title_justify="left")
    for col in ("\\[training].parallel", "per rank", "counts"):
        t.add_column(col)
    for mode, n, what in rank_memory(g, ranks):
        t.add_row(mode, _mib(n), _safe(what))
    con.print(t)
    con.print(
        "plus on every rank: the trained tensors and their optimizer state, activations, and "
        "under none/ddp the dequantized-weight cache when it is on (docs/distributed.md)"
    )
    con.print(f"device: {device}")
    return 0
