"""``safelens-tl verify`` (placeholder until issue 4)."""

from __future__ import annotations

import argparse
from typing import Any


def register(subcommands: Any) -> None:
    """Add the ``verify`` subcommand to the parser."""
    parser: argparse.ArgumentParser = subcommands.add_parser(
        "verify", help="check cached fp16/bf16 generation against uncached"
    )
    parser.set_defaults(run=run)


def run(arguments: argparse.Namespace) -> int:
    """Not implemented yet."""
    raise NotImplementedError
