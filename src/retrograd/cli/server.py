"""`retrograd-server`: the run server's command line.

For now it has one subcommand, `config-schema`, which prints the JSON Schema of run files.
Later subcommands (serving runs, `openapi`, `view`) join the same table. Nothing imported here
pulls in torch: the schema prints in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from retrograd.errors import RetrogradError

EPILOG = """\
examples:
  retrograd-server config-schema > retrograd.schema.json
      then point Taplo or Even Better TOML at the file (see docs/configuration.md)
"""


def config_schema(args: argparse.Namespace) -> int:
    from retrograd.config import json_schema

    text = json.dumps(json_schema(), indent=None if args.compact else 2, ensure_ascii=False)
    if args.output is None:
        sys.stdout.write(text + "\n")
    else:
        with open(args.output, "w", encoding="utf-8") as out:
            out.write(text + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="retrograd-server",
        description="Retrograd's run server and its tools.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    schema = commands.add_parser(
        "config-schema",
        help="print the JSON Schema (draft 2020-12) of run files",
        description="Print the JSON Schema (draft 2020-12) of Retrograd run files, generated "
        "from the same models that validate them. Editors use it to complete and check a "
        "run file as you type.",
        epilog="example: retrograd-server config-schema > retrograd.schema.json",
    )
    schema.add_argument("--compact", action="store_true", help="print on one line")
    schema.add_argument("-o", "--output", metavar="FILE", help="write to FILE, not stdout")
    schema.set_defaults(handler=config_schema)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return handler(args)
    except RetrogradError as error:
        print(f"retrograd-server: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
