"""Flags every command shares (--model, --device) and how they are described."""

from __future__ import annotations

import argparse

DEVICE_HELP = "auto (a GPU if PyTorch sees one, else the CPU), cpu, or gpu (fail without one)"


def add_model_flag(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument(
        "--model",
        required=required,
        metavar="MODEL.gguf",
        help="the GGUF model file (quantized or not)",
    )


def add_device_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"), help=DEVICE_HELP)
