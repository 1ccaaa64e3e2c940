"""Chat with the model in the terminal, through its chat template, text streamed as it comes.

The weights are the adapter the run file trains unless --adapter or --base-only says
otherwise; --compare answers every turn twice, base model first, then the adapter (the
adapter's answer stays in the history). A model without a chat template uses its family's
(docs/chat-templates.md). Type /reset to clear the history and /exit (or Ctrl-D) to quit.

Example:
  retrograd chat examples/sft-lora.toml --compare --temp 0
"""

from __future__ import annotations

import argparse
import secrets
import sys

from retrograd.cli.common import add_device_flag, add_model_flag
from retrograd.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG.toml", help="the run file")
    p.add_argument("--adapter", metavar="ADAPTER.gguf", help="chat with this LoRA adapter")
    p.add_argument("--compare", action="store_true", help="show the base and adapter answers")
    p.add_argument("--base-only", action="store_true", help="chat with the base model only")
    p.add_argument("--system", metavar="PROMPT", help="a system prompt")
    p.add_argument(
        "--temp", type=float, default=0.7, metavar="T", help="temperature (default 0.7; 0: greedy)"
    )
    p.add_argument(
        "--top-p", type=float, default=0.95, metavar="P", help="nucleus mass (default 0.95)"
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=512, metavar="N", help="per answer (default 512)"
    )
    p.add_argument("--seed", type=int, metavar="N", help="sampling seed (default: random)")
    p.add_argument(
        "--ctx",
        type=int,
        metavar="N",
        help="context length (default: 4096, or the model's trained context if shorter)",
    )
    add_model_flag(p, required=False)
    add_device_flag(p)
    p.set_defaults(device=None)


def _check(args: argparse.Namespace) -> None:
    if args.compare and args.base_only:
        raise ConfigError("--compare and --base-only: choose one")
    if args.temp < 0:
        raise ConfigError(f"--temp {args.temp}: must be at least 0")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p {args.top_p}: must be in (0, 1]")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")


def run(args: argparse.Namespace) -> int:
    from retrograd.config import load_run
    from retrograd.openai_app.weights import load_for_generation, resolve_adapter

    cfg = load_run(args.config, model=args.model, device=args.device)
    _check(args)
    adapter = resolve_adapter(cfg, args.adapter, base_only=args.base_only)
    loaded = load_for_generation(cfg, adapter, args.ctx, args.device)
    seed = args.seed if args.seed is not None else secrets.randbits(31)
    name = adapter.name if adapter else "base model"
    print(f"chatting with {name} ({loaded.model.report.describe()}); /reset clears, /exit quits")
    return Chat(loaded, args, seed).loop()


def _stream(_answer: int, delta: str) -> None:
    sys.stdout.write(delta)
    sys.stdout.flush()


class Chat:
    """The conversation: history, one turn at a time, trimmed to fit the context."""

    def __init__(self, loaded, args, seed: int):
        self.loaded = loaded
        self.args = args
        self.seed = seed
        self.turn = 0
        self.system = [{"role": "system", "content": args.system}] if args.system else []
        self.history: list[dict] = []

    def loop(self) -> int:
        while True:
            try:
                line = input("> ")
            except EOFError:
                print()
                return 0
            text = line.strip()
            if text == "/exit":
                return 0
            if text == "/reset":
                self.history = []
                print("(history cleared)")
            elif text:
                self.answer(text)

    def variants(self) -> list[tuple[str | None, bool]]:
        """(label, adapter on) per answer of a turn."""
        if self.args.compare:
            return [("base", False), ("adapter", True)]
        return [(None, self.loaded.adapter is not None)]

    def answer(self, text: str) -> None:
        from retrograd.openai_app.weights import set_adapter
        from retrograd.sampling import SampleRequest, SamplingParams
        from retrograd.seeds import SAMPLE, derive_seed

        self.history.append({"role": "user", "content": text})
        prompt = self.prompt()
        if prompt is None:
            return
        params = SamplingParams(
            temperature=self.args.temp,
            top_p=self.args.top_p,
            max_new_tokens=self.args.max_new_tokens,
            seed=derive_seed(self.seed, SAMPLE, prompt=self.turn),
        )
        self.turn += 1
        reply = ""
        for label, enabled in self.variants():
            set_adapter(self.loaded.model.decoder, enabled)
            if label:
                sys.stdout.write(f"[{label}] ")
            [[c]] = self.loaded.sampler.generate(
                [SampleRequest(tuple(prompt), params)], on_text=_stream
            )
            sys.stdout.write("\n" if c.finish_reason == "stop" else " [length]\n")
            sys.stdout.flush()
            reply = c.text
        self.history.append({"role": "assistant", "content": reply})

    def prompt(self) -> list[int] | None:
        """The prompt ids, dropping the oldest exchanges until an answer fits the context."""
        room = self.loaded.ctx - min(self.args.max_new_tokens, self.loaded.ctx // 2)
        while True:
            ids = self.loaded.chat.prompt_ids(self.system + self.history)
            if len(ids) <= room:
                return ids
            if len(self.history) <= 1:
                print(f"(message too long: {len(ids)} tokens, context {self.loaded.ctx})")
                self.history.pop()
                return None
            self.history = self.history[2:]
            print("(oldest exchange dropped to fit the context)")
