"""Train: run [run].algorithm (sft, ppo, grpo, preference, distill or agent_grpo) as the file says.

The run file is validated first (every problem at once, before any model is loaded). --resume
continues from the given checkpoint (a .state directory, or the adapter exported beside it),
or from the latest one in [checkpoint].directory; the run continues exactly and refuses a
changed model, data or algorithm.

Example:
  retrograd train examples/sft-lora.toml --model gemma-3-270m-q4_k_m.gguf
"""

from __future__ import annotations

import argparse

from rich.console import Console

from retrograd.cli.common import add_device_flag, add_model_flag


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG.toml", help="the run file")
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="CHECKPOINT.state",
        help="continue from this checkpoint, or (no value) the latest in [checkpoint].directory",
    )
    add_model_flag(p, required=False)
    add_device_flag(p)
    p.set_defaults(device=None)


def run(args: argparse.Namespace) -> int:
    from retrograd.config import load_run

    cfg = load_run(args.config, model=args.model, device=args.device, resume=args.resume)
    from retrograd import distributed
    from retrograd.algorithms import table
    from retrograd.observe.sinks import Sinks

    world = distributed.init_world(cfg)  # under torchrun: this rank's place (docs/distributed.md)
    console = Console()
    sinks = Sinks(console=console) if world.main else Sinks.quiet()  # rank 0 alone reports
    try:
        table.run(cfg, resume=args.resume, sinks=sinks, run_file=args.config)
        distributed.last_barrier()  # the ranks leave together, rank 0's output written
    except KeyboardInterrupt:
        sinks.fail("interrupted")
        raise
    except Exception as e:
        sinks.fail(f"{type(e).__name__}: {e}")
        raise
    finally:
        distributed.close_world()
    return 0
