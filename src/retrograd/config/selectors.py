"""[trainable] selectors against a model's tensor names: what partial and hybrid runs train.

The caller passes the names from the GGUF (`GGUFFile(path).tensors`, a dict name -> TensorInfo,
or just a list of names); no torch and no weights are needed. The input embedding, rotary
constants and (when the mapping says so) quantized tensors are never trained: they come back in
`Selection.excluded` with the reason, for the run to list at start-up.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from retrograd.config.core import PROJECTIONS, TrainableSection
from retrograd.config.report import Issue
from retrograd.errors import ConfigError

_BLOCK = re.compile(r"^blk\.(\d+)\.([^.]+)\.(weight|bias)$")
NEVER_TRAINED = {
    "token_embd": "input embedding",
    "rope_freqs": "rotary constants",
    "rope_factors_long": "rotary constants",
    "rope_factors_short": "rotary constants",
}
ATTN = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv")


@dataclass(frozen=True)
class Selection:
    """The tensors a [trainable] section trains, and those it matched but may not train."""

    trained: tuple[str, ...]
    excluded: tuple[tuple[str, str], ...]  # (name, why)
    unmatched: tuple[str, ...]  # selectors that matched no tensor


def _component(name: str) -> tuple[int | None, str]:
    found = _BLOCK.match(name)
    if found:
        return int(found[1]), found[2]
    return None, name.split(".")[0]


def _is_norm(component: str) -> bool:
    return component.endswith("_norm") or component.endswith("_norm_b")


def _module_matches(spec: str, name: str, component: str) -> bool:
    if spec == "attn":
        return component in ATTN and name.endswith(".weight")
    if spec == "ffn":
        return component.startswith("ffn_") and not _is_norm(component) and name.endswith(".weight")
    if spec in PROJECTIONS:
        return component == spec and name.endswith(".weight")
    return fnmatch.fnmatchcase(name, spec)


def select_tensors(
    section: TrainableSection,
    tensors: Iterable[str] | Mapping[str, Any],
    *,
    mode: str = "partial",
    source: str = "run.toml",
) -> Selection:
    """Apply the selectors of `section` to the model's tensors; ConfigError when nothing trains.

    `mode` is training.trainable: with hybrid, biases are those of every module in the selected
    layers (the adapter covers the projections). A layer range beyond the model and an output
    head tied to the embedding are errors too.
    """
    names = sorted(tensors)
    floats = {n for n in names if getattr(tensors, "get", None) is None or _is_float(tensors[n])}
    n_layers = 1 + max((_component(n)[0] or 0 for n in names if n.startswith("blk.")), default=-1)
    problems = _layer_problems(section, n_layers)
    layers = set(section.layer_range(n_layers))
    picked: dict[str, list[str]] = {}

    def in_layers(name: str) -> bool:
        block, _ = _component(name)
        return block is None or block in layers

    for spec in section.modules or ():
        picked[spec] = [
            n for n in names if in_layers(n) and _module_matches(spec, n, _component(n)[1])
        ]
    if section.norms:
        last_selected = n_layers - 1 in layers
        picked["norms"] = [
            n
            for n in names
            if _is_norm(_component(n)[1])
            and (
                _component(n)[0] is not None
                and in_layers(n)
                or _component(n)[0] is None
                and last_selected
            )
        ]
    if section.biases:
        weights = {w for spec in section.modules or () for w in picked[spec]}
        picked["biases"] = [
            n
            for n in names
            if n.endswith(".bias")
            and in_layers(n)
            and not _is_norm(_component(n)[1])
            and (
                n[: -len(".bias")] + ".weight" in weights
                or (mode == "hybrid" and _component(n)[0] is not None)
            )
        ]
    if section.output_head:
        if "output.weight" not in names:
            problems.append(
                Issue(
                    ("trainable",),
                    "output_head",
                    "the model ties its output head to the input embedding, which is never trained",
                    True,
                )
            )
        picked["output_head"] = [n for n in ("output.weight", "output.bias") if n in names]
    return _finish(picked, floats, problems, source, section)


def _is_float(info: Any) -> bool:
    return bool(getattr(info, "is_float", True))


def _layer_problems(section: TrainableSection, n_layers: int) -> list[Issue]:
    span = section.layer_range(n_layers)
    wanted = section.layers
    too_far = (wanted.startswith("last:") and int(wanted[5:]) > n_layers) or (
        ".." in wanted and span.stop > n_layers
    )
    if too_far:
        return [
            Issue(
                ("trainable",),
                "layers",
                f"the model has {n_layers} layers (0..{n_layers - 1})",
                wanted,
            )
        ]
    return []


def _finish(
    picked: dict[str, list[str]],
    floats: set[str],
    problems: list[Issue],
    source: str,
    section: TrainableSection,
) -> Selection:
    trained: list[str] = []
    excluded: list[tuple[str, str]] = []
    for name in dict.fromkeys(n for found in picked.values() for n in found):
        component = _component(name)[1]
        if component in NEVER_TRAINED:
            excluded.append((name, f"{NEVER_TRAINED[component]}, never trained"))
        elif name not in floats:
            excluded.append((name, "quantized, never trained"))
        else:
            trained.append(name)
    unmatched = tuple(spec for spec, found in picked.items() if not found)
    if not trained and not problems:
        why = f" ({', '.join(unmatched)} matched nothing)" if unmatched else ""
        if excluded:
            why = f" (it matched only tensors never trained: {', '.join(n for n, _ in excluded)})"
        message = f"selects no trainable tensor of this model{why}; `retrograd inspect` lists them"
        problems.append(Issue(("trainable",), None, message))
    if problems:
        raise ConfigError("\n".join(p.render(source) for p in problems))
    return Selection(tuple(trained), tuple(excluded), unmatched)
