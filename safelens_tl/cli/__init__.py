"""The ``safelens-tl`` command: ``verify`` and ``status`` subcommands.

Each subcommand lives in its own module and is imported only when chosen, so ``--help`` is fast.
Exit codes: 0 success, 1 a check failed, 2 a usage error.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from safelens_tl import __version__

#: When the command started: reports give the whole wall time, imports included.
STARTED = time.perf_counter()

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser with every subcommand registered."""
    from safelens_tl.cli import status as status_command
    from safelens_tl.cli import verify as verify_command

    parser = argparse.ArgumentParser(
        prog="safelens-tl",
        description="Safe cached generation for TransformerLens in fp16/bf16.",
    )
    parser.add_argument("--version", action="version", version=f"safelens-tl {__version__}")
    # Not required=True: argparse would then answer `safelens-tl --bogus` with "the following
    # arguments are required: COMMAND" and never name --bogus. main() asks for the command once
    # every argument is known.
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    verify_command.register(subcommands)
    status_command.register(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    parser = build_parser()
    try:
        arguments = parser.parse_args(argv)
        if arguments.command is None:
            parser.error("the following arguments are required: COMMAND (verify or status)")
    except SystemExit as exit_request:  # argparse exits 2 on usage errors, 0 on --help
        return int(exit_request.code or 0)
    # Reports give the whole wall time, this process's imports included.
    arguments.started = STARTED
    code: int = arguments.run(arguments)
    return code
