"""The package's layers, read from its imports: no import runs up a layer, no files import each
other in a circle (DESIGN.md, "Layers").

Every `import retrograd.X` and `from retrograd.X import ...` in src/ counts, at module level,
inside a function or under `if TYPE_CHECKING:` (it loads nothing, but the file then knows the
type of a layer above it, and the import graph `farm-studio look` draws counts it too). An
import goes to its own package or a lower row; two packages of one row do not import each
other; nothing inside the package imports the package root (the doors' facade).

Run as a script to print every import that crosses a layer, and every circle:
    .venv/bin/python -m tests.unit.test_layers
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "retrograd"
ARCHITECTURE = SRC.parents[1] / "docs" / "architecture.md"  # draws LAYERS for readers
ROOT = "retrograd"  # the package root, src/retrograd/__init__.py

# bottom to top: a package or top-level module of retrograd imports only its own row's self and
# the rows below
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "seeds", "nesting", "text", "version"),  # leaves
    ("environ", "replies"),  # every environment variable, parsed once; caps on HTTP replies
    ("threads",),  # thread count and OpenMP's wait policy
    ("compute",),  # the compute plan
    ("compiled", "losses", "gguf"),  # fused kernels; pure loss functions; the file format
    ("observe",),  # metric sinks, names, logging, the [observe] writer
    ("tokenizer",),
    ("config",),  # run file schema and rules, no torch
    ("data",),  # datasets, prompts, pairs, .topk
    ("model",),  # decoder, block, decode graph, frozen weights, logprobs
    ("trainable", "optim"),  # LoRA, base tensors, preflight; optimizers, schedules
    ("distributed",),  # ranks, collectives, replicas, fsdp2 sharding
    ("checkpoint",),  # .state dirs, run save and restore, ranks' dcp, export
    ("sampling", "rewards"),  # sampler and backends; reward programs, judges
    ("rollout",),  # records, streams, passes, shaping, spread, metrics
    ("agent", "openai_app"),  # scenarios, tools, environments; `retrograd serve`'s app
    ("algorithms",),  # the loops and what they share
    ("server",),  # the run server
    ("cli", "api"),  # the commands; the Python API (Trainer)
    (ROOT,),  # the doors: load, load_tokenizer
)


def module_of(path: Path) -> str:
    """src/retrograd/model/decoder.py -> retrograd.model.decoder (a package: its __init__)."""
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def files() -> dict[str, Path]:
    return {module_of(p): p for p in sorted(SRC.rglob("*.py"))}


def _walk(node: ast.AST):
    """Every import node under `node`, in functions and under `if TYPE_CHECKING:` too (a
    type named from a higher layer is still that layer's knowledge)."""
    return (n for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom))


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The retrograd modules a file imports (a name imported from a package that is a module
    of it counts as that module)."""
    found = set()
    for node in _walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == ROOT}
        elif node.level == 0 and node.module and node.module.split(".")[0] == ROOT:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in known else node.module)
    return found


def graph() -> dict[str, set[str]]:
    """module -> the modules it imports, each resolved to a file of src/ (the nearest one:
    retrograd.model.decoder.X is retrograd.model.decoder)."""
    known = files()
    edges = {}
    for module, path in known.items():
        targets = set()
        for name in imports(path, known):
            while name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in known and name != module:
                targets.add(name)
        edges[module] = targets
    return edges


def top(module: str) -> str:
    """The LAYERS name a module belongs to: retrograd.model.decoder -> model."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def row_of(name: str) -> int:
    for i, row in enumerate(LAYERS):
        if name in row:
            return i
    raise AssertionError(f"src/retrograd/{name}: in no row of LAYERS (tests/unit/test_layers.py)")


def label(module: str) -> str:
    """retrograd.model.decoder -> model/decoder.py (as KNOWN writes the importer)."""
    return str(files()[module].relative_to(SRC))


def violations() -> set[str]:
    """Every import from a file to a package of a higher row, or of the same row but another
    package, "importer -> imported"."""
    found = set()
    for module, targets in graph().items():
        here = top(module)
        for target in targets:
            there = top(target)
            if there == here:
                continue
            if row_of(there) >= row_of(here):
                found.add(f"{label(module)} -> {target}")
    return found


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    break
                if child in on:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


# -- the tests ----------------------------------------------------------------------------------


def test_every_package_and_module_has_a_row():
    names = {
        p.stem
        for p in SRC.iterdir()
        if not p.name.startswith(("_", "."))
        and ((p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py")
    }
    placed = {n for row in LAYERS for n in row} - {ROOT}
    assert names - placed == set(), "add these to a row of LAYERS"
    assert placed - names == set(), "LAYERS names what src/retrograd no longer has"


def test_no_import_runs_up_a_layer():
    assert sorted(violations()) == [], "imports that run up a layer (DESIGN.md, Layers)"


def test_no_import_cycle():
    assert circles(graph()) == [], "files that import each other"


def drawn_layers(text: str) -> tuple[tuple[str, ...], ...]:
    """The rows of the first fenced block of docs/architecture.md: `NN  name name   what`,
    the names up to the first run of two spaces after them."""
    block = text.split("```")[1]
    rows = []
    for line in block.strip().splitlines():
        number, rest = line.strip().split(maxsplit=1)
        assert int(number) == len(rows) + 1, line
        rows.append(tuple(rest.split("  ")[0].split()))
    return tuple(rows)


def test_the_architecture_page_draws_these_layers():
    assert drawn_layers(ARCHITECTURE.read_text()) == LAYERS, (
        "docs/architecture.md's block differs from LAYERS"
    )
    # the reading can fail: a page with two rows swapped is not LAYERS
    swapped = (
        "```\n 1  errors seeds nesting text version  leaves\n 2  threads  x\n 3  environ  y\n```"
    )
    assert drawn_layers(swapped)[1:] == (("threads",), ("environ",)) != LAYERS[1:3]


def test_the_tarjan_pass_finds_a_circle_and_the_scan_sees_function_imports(tmp_path):
    """The checks can fail: a made-up circle is found; a function-level import counts, and
    one under TYPE_CHECKING."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    f = tmp_path / "m.py"
    f.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from retrograd.cli import main\n"
        "def g():\n    from retrograd.model import decoder\n    import retrograd\n"
    )
    known = {"retrograd.model.decoder": f, "retrograd.cli": f}
    assert imports(f, known) == {"retrograd.cli", "retrograd.model.decoder", "retrograd"}


if __name__ == "__main__":
    for line in sorted(violations()):
        print(line)
    for circle in circles(graph()):
        print("circle:", " <-> ".join(circle))
    sys.exit(0)
