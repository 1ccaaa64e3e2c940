"""`retrograd scenarios generate` (formats.md §4.6): scenarios asked of an LLM in batches,
checked line by line as the scenario reader checks them, written atomically beside a
`.manifest.json` sidecar.

The prompt shows the tool catalog (JSON, cut to max_catalog_bytes), the difficulty range and
the custom instructions, and asks for `{"scenarios": [...]}` (response_format json_object).
A reply is read from its first "{" to its last "}"; a scenario the reader refuses is dropped
and counted, and so is a repeated id; batches go on until `count` scenarios are in hand or
twice the planned batches were asked. The sidecar records the sha256 of the prompt, of the
catalog shown and of the written file: `check_manifest` (training calls it) refuses a
scenario file edited since, while a file without a sidecar is taken as it is. Knows the
endpoint and the scenario format, not environments.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrograd import nesting
from retrograd.agent.endpoint import ChatEndpoint
from retrograd.agent.scenarios import parse_scenario, scenario_json_lines
from retrograd.errors import DataError, RetrogradError

MANIFEST_SUFFIX = ".manifest.json"

SYSTEM = """\
You write training scenarios for a tool-using AI agent. Each scenario is one task the agent \
must solve by calling the tools below; a good scenario is self-contained, unambiguous, \
solvable with these tools alone, and has an answer that can be checked.

Reply with one JSON object and nothing else:
{{"scenarios": [{{"id": "short-kebab-case-id", "user": "the task, as the user asks it", \
"system": "optional system prompt", "metadata": {{"difficulty": 3}}}}]}}
Keys allowed in a scenario: id, user, system, metadata (an object; put anything else there). \
Ids must be unique.

Difficulty runs from 1 (one obvious tool call) to 5 (many steps, careful reasoning); use \
difficulties from {lo} to {hi}.

Tools the agent has (OpenAI function format):
{catalog}
{custom}"""

BATCH = """\
Write {n} new scenarios (batch {b} of {total}; seed {seed}). Spread them over difficulties \
{lo} to {hi} and over the tools. Use ids that start with "b{b}-"."""


@dataclass(frozen=True)
class Prompt:
    system: str
    catalog: str  # the catalog text shown (maybe cut)
    left_out: int  # tools left out to fit max_catalog_bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.system.encode()).hexdigest()

    @property
    def catalog_sha256(self) -> str:
        return hashlib.sha256(self.catalog.encode()).hexdigest()


@dataclass
class Generated:
    scenarios: list[dict] = field(default_factory=list)
    requests: int = 0
    invalid: int = 0  # refused by the scenario reader
    duplicates: int = 0  # ids already taken
    unreadable: int = 0  # replies without a JSON object of scenarios
    warnings: list[str] = field(default_factory=list)


def catalog_text(tools: list[dict], cap: int) -> tuple[str, int]:
    """The catalog as indented JSON, sorted by name; tools are left out from the end until it
    fits `cap` bytes. Returns (text, tools left out)."""
    tools = sorted(tools, key=_tool_name)
    for n in range(len(tools), -1, -1):
        text = json.dumps(tools[:n], indent=1, ensure_ascii=False)
        if len(text.encode()) <= cap:
            return text, len(tools) - n
    return "[]", len(tools)


def _tool_name(t: dict) -> str:
    fn = t.get("function", t)
    return str(fn.get("name", "")) if isinstance(fn, dict) else ""


def build_prompt(gen, tools: list[dict]) -> Prompt:
    """The system message every batch shares (`gen`: [agent.scenario_generation])."""
    catalog, left_out = catalog_text(tools, gen.max_catalog_bytes)
    if left_out:
        catalog += f"\n({left_out} more tools are not shown)"
    custom = (
        f"\nAlso follow these instructions:\n{gen.custom_instructions}\n"
        if gen.custom_instructions
        else ""
    )
    system = SYSTEM.format(
        lo=gen.min_difficulty, hi=gen.max_difficulty, catalog=catalog, custom=custom
    )
    return Prompt(system, catalog, left_out)


def batch_message(gen, b: int, total: int, n: int, seed: int) -> str:
    return BATCH.format(
        n=n, b=b + 1, total=total, seed=seed, lo=gen.min_difficulty, hi=gen.max_difficulty
    )


def plan(gen) -> list[int]:
    """Scenarios asked per planned batch."""
    total = math.ceil(gen.count / gen.batch_size)
    return [min(gen.batch_size, gen.count - b * gen.batch_size) for b in range(total)]


def generate(gen, prompt: Prompt, endpoint: ChatEndpoint, seed: int) -> Generated:
    """Ask batch after batch until `gen.count` scenarios pass the reader (or twice the planned
    batches were asked); shuffled with `seed` when gen.shuffle."""
    out = Generated()
    sizes = plan(gen)
    seen: set[str] = set()
    b = 0
    while len(out.scenarios) < gen.count and b < 2 * len(sizes):
        n = min(gen.batch_size, gen.count - len(out.scenarios))
        user = batch_message(gen, b, len(sizes), n, seed + b)
        reply = endpoint.complete(
            [{"role": "system", "content": prompt.system}, {"role": "user", "content": user}],
            response_format={"type": "json_object"},
            seed=seed + b,
        )
        out.requests += 1
        _take(reply.get("content") or "", b, out, seen)
        b += 1
    out.scenarios = out.scenarios[: gen.count]
    if gen.shuffle:
        random.Random(seed).shuffle(out.scenarios)
    return out


def _take(content: str, b: int, out: Generated, seen: set[str]) -> None:
    items = parse_reply(content)
    if items is None:
        out.unreadable += 1
        out.warnings.append(f"batch {b + 1}: the reply holds no JSON object of scenarios")
        return
    for i, item in enumerate(items):
        place = f"batch {b + 1} scenario {i + 1}"
        try:
            s = parse_scenario(item, place)
        except RetrogradError as e:
            out.invalid += 1
            out.warnings.append(f"dropped {e}")
            continue
        if s.id in seen:
            out.duplicates += 1
            out.warnings.append(f'dropped {place}: id "{s.id}" is taken already')
            continue
        seen.add(s.id)
        out.scenarios.append(s.as_json())


def parse_reply(content: str) -> list[Any] | None:
    """The scenarios of a reply: the JSON from its first "{" to its last "}" (a code fence or
    prose around it is ignored), as {"scenarios": [...]} or one scenario object."""
    start, end = content.find("{"), content.rfind("}")
    if start < 0 or end < start:
        return None
    try:
        value = nesting.loads(content[start : end + 1])
    except ValueError:  # not JSON, or nested deeper than nesting.MAX_DEPTH
        return None
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("scenarios"), list):
        return value["scenarios"]
    if "id" in value and "user" in value:
        return [value]
    return None


# -- files -----------------------------------------------------------------------------------


def manifest_path(scenario_file: str | Path) -> Path:
    p = Path(scenario_file)
    return p.with_name(p.name + MANIFEST_SUFFIX)


def write_scenarios(
    path: Path, scenarios: list[dict], prompt: Prompt, gen, seed: int
) -> dict[str, Any]:
    """The scenario file, then its sidecar, each written to a temporary name and renamed."""
    from retrograd.gguf.writer import atomic_path

    data = scenario_json_lines(scenarios)
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    manifest = {
        "format": 1,
        "corpus_sha256": hashlib.sha256(data).hexdigest(),
        "prompt_sha256": prompt.sha256,
        "catalog_sha256": prompt.catalog_sha256,
        "model": gen.model,
        "count": len(scenarios),
        "requested": gen.count,
        "seed": seed,
    }
    with atomic_path(manifest_path(path)) as tmp:
        tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def check_manifest(scenario_file: str | Path, where: str = "[agent].scenarios") -> None:
    """When `scenarios generate` left a sidecar beside the file, the file must still be what it
    wrote; DataError otherwise. A file without a sidecar is not checked."""
    path = Path(scenario_file)
    sidecar = manifest_path(path)
    if not sidecar.is_file():
        return
    try:
        recorded = json.loads(sidecar.read_text(encoding="utf-8"))["corpus_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        raise DataError(
            f"{sidecar}: not a scenario manifest (no corpus_sha256); delete it or regenerate "
            "the scenarios"
        ) from None
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    if actual != recorded:
        raise DataError(
            f"{where} = {path}: the file changed since `retrograd scenarios generate` wrote it "
            f"(sha256 {actual[:12]}, the manifest records {recorded[:12]}); regenerate it with "
            f"--force, or delete {sidecar.name} to train on the edited file"
        )
