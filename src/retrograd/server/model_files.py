"""GET /v1/model-files: the GGUF files a client may name, found under the path roots.

Each file's header is read (not its weights) for its role: `model`, `projector` (a clip
vision tower) or `vocab` (a vocabulary-only file); adapters and unreadable files are left out.
A listing is kept 30 seconds (`?refresh=true` rescans). Without path roots the server's working
directory is searched. Folders are searched to a depth of four, hidden ones skipped.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from retrograd.server.documents import inside

CACHE_SECONDS = 30.0
MAX_DEPTH = 4
MAX_FILES = 1000
MAX_NAME_CHARS = 200  # general.name as the listing shows it


class ModelFiles:
    def __init__(self, roots: list[Path]):
        self.roots = [Path(r) for r in roots] or [Path.cwd()]
        self.cached: tuple[float, list[dict[str, Any]]] | None = None

    def listing(self, refresh: bool = False) -> list[dict[str, Any]]:
        if refresh or self.cached is None or time.monotonic() - self.cached[0] > CACHE_SECONDS:
            self.cached = (time.monotonic(), [d for p in self._found() if (d := describe(p))])
        return self.cached[1]

    def _found(self) -> list[Path]:
        found: list[Path] = []
        for root in self.roots:
            base = len(root.parts)
            for folder, dirs, files in os.walk(root):
                depth = len(Path(folder).parts) - base
                dirs[:] = [] if depth >= MAX_DEPTH else sorted(d for d in dirs if d[0] != ".")
                found += [
                    Path(folder) / f
                    for f in sorted(files)
                    if f.endswith(".gguf")
                    and inside(Path(folder) / f, root)
                    and (Path(folder) / f).is_file()
                ]  # a symlink to a file outside the root is not the root's; a FIFO named
                # x.gguf is not a file (opening it would wait for a writer forever)
                if len(found) >= MAX_FILES:
                    return found[:MAX_FILES]
        return found


def describe(path: Path) -> dict[str, Any] | None:
    """{path, name, bytes, role, architecture}, or None for an adapter or an unreadable file."""
    from retrograd.gguf import GGUFFile

    try:
        gguf = GGUFFile(path)
        kind = gguf.file_kind
        architecture = gguf.get("general.architecture")
    except Exception:  # not ours to judge here: the run that names it says what is wrong
        return None
    if kind == "adapter" or not isinstance(kind, str) or not isinstance(architecture, str):
        return None  # one file's odd metadata (an array for a name) must not fail the listing
    role = "projector" if architecture == "clip" else ("vocab" if kind == "vocab" else "model")
    return {
        "path": str(path),
        "name": str(gguf.get("general.name") or path.stem)[:MAX_NAME_CHARS],
        "bytes": path.stat().st_size,
        "role": role,
        "architecture": architecture,
    }
