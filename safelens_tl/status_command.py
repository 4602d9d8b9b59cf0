"""``safelens-tl status``: what is installed and what is patched (placeholder until issue 3)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(subcommands: Any) -> None:
    """Add the ``status`` subcommand to the parser."""
    parser: argparse.ArgumentParser = subcommands.add_parser(
        "status", help="show the installed TransformerLens release and what safelens-tl patches"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(run=run)


def run(arguments: argparse.Namespace) -> int:
    """Activate and print the report."""
    import safelens_tl

    report = safelens_tl.activate().to_dict()
    if arguments.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    return 0
