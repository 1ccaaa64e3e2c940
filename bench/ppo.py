"""PPO update speed and memory on Gemma 3 270M Q4_K_M: Retrograd's PPO against TRL, one run.

  .venv/bin/python bench/ppo.py [--threads 2] [--updates 2] [--warmup 1] [--trl f32,f32+gc]
                                [--prompts 4] [--group 8] [--new 64] [--rest 20] [--rounds 1]

TRL's PPO cannot be the peer: trl 1.16.0 (the bench extra) ships no PPO trainer (PPOTrainer left
trl for trl.experimental and is gone from both in this version), and the last one took a reward
*model* and a value *model* (two more transformers models), not a reward program. The closest
TRL trainer is GRPOTrainer, which takes a Python reward function and runs the same clipped
surrogate: it is measured exactly as bench/grpo.py measures it (bench/grpo_sides.py), and this
file reuses that driver and report. The update is the same work on both sides: a LoRA (rank 8,
alpha 16, q k v o gate up down), 32 answers of exactly 64 new tokens (end of generation
ignored) to the same 4 arithmetic prompts (TRL: 4 prompts x 8 generations; ours: a prompt file
holding each of them 8 times, one PPO answer per line), rewarded by
examples/rewards/arithmetic.py, one pass of the clipped surrogate over the update's tokens, no
KL term, one AdamW step (lr 2e-4 constant, weight decay 0, clipping at 1.0).

Ours is `run_ppo`, the loop `retrograd train` runs for algorithm = "ppo", with the critic on
(the spec's default): its scoring phase is the pass that stores the value head's features
(the layers alone; the old log-probabilities come from the first policy pass, as TRL's do at
num_iterations 1), and its optimizer phase includes the value head's 8 steps. PPO samples one answer a prompt, so ours
has no shared-prefix fan-out: each answer is its own row, its prompt prefilled and scored with
it. Results go to docs/performance.md by hand, with this command.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import json

from bench import grpo
from bench.grpo_sides import PROMPTS, REWARD, ignore_end_of_generation, measure_ours, worker_trl
from bench.sft_sides import ALPHA, OURS_TARGETS, RANK, gemma
from bench.sft_sides import RUN_FILE as SFT_RUN_FILE

LR = 2e-4
CLIP = 0.2
# [run] to [lora] as bench/sft_sides.py writes them, for algorithm "ppo"
RUN_FILE = (
    SFT_RUN_FILE[: SFT_RUN_FILE.index("[training]")].replace('"sft"', '"ppo"')
    + """\
[training]
threads = {threads}
lr = {lr}
lr_scheduler = "constant"
ctx = {ctx}
micro_batch = {ctx}

[ppo]
prompts = "{prompts}"
reward_command = {reward}
updates = {updates}
rollout_batch_size = {answers}
ppo_epochs = 1
clip_range = {clip}
kl_coefficient = 0.0

[ppo.sampling]
temperature = 1.0
top_p = 1.0
max_new_tokens = {new}
seed = 1
"""
)


def repeated_prompts(workdir: Path, n: int, group: int) -> Path:
    """The first n prompts of the GRPO bench, each `group` times in a row: PPO's one answer a
    line then answers every prompt `group` times, as TRL's groups do."""
    lines = PROMPTS.read_text(encoding="utf-8").splitlines()[:n]
    path = workdir / "ppo-prompts.jsonl"
    path.write_text("".join(line + "\n" for line in lines for _ in range(group)))
    return path


def worker_ours(args) -> dict:
    """`run_ppo` from a run file, timed as bench/grpo_sides.py times `run_grpo`: generation
    = sampling; reward = the program's batch; scoring = the critic's pass (features and old
    log-probabilities); optimizer = the ppo_epochs passes and the value head's steps."""
    from retrograd.algorithms.ppo import run_ppo

    ignore_end_of_generation()
    workdir = Path(args.workdir)
    n = (args.warmup + args.updates) * args.prompts
    run_file = workdir / "ppo.toml"
    run_file.write_text(
        RUN_FILE.format(
            model=gemma().as_posix(),
            rank=RANK,
            alpha=ALPHA,
            targets=json.dumps(OURS_TARGETS),
            threads=args.threads,
            lr=LR,
            ctx=args.ctx,
            prompts=repeated_prompts(workdir, n, args.group).as_posix(),
            reward=json.dumps([sys.executable, REWARD.as_posix()]),
            updates=args.warmup + args.updates,
            answers=args.prompts * args.group,
            clip=CLIP,
            new=args.new,
        )
    )
    return measure_ours(args, run_ppo, run_file)


if __name__ == "__main__":
    grpo.main(
        script=__file__,
        ours_is="PPO (critic on)",
        workers={"trl": worker_trl, "ours": worker_ours},
        doc=__doc__,
    )
