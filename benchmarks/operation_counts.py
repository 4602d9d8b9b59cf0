"""Count the tensor operations of one ``generate``, stock and patched, on the CPU.

On a GPU a tiny model's generation is bound by kernel launches, not bytes: each operation that
computes (not a view) is one launch. This counts every aten operation of one greedy cached
``HookedTransformer.generate`` through a ``TorchDispatchMode``, split into views (no kernel)
and the rest, so the launch count of both paths can be compared on a machine without a GPU.

    HF_HUB_OFFLINE=1 python benchmarks/operation_counts.py [--shape 640,160,4] [--shape 8,48,1]
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Sequence
from typing import Any

import kv_cache  # this script's own folder is on sys.path
from rich.console import Console
from rich.table import Table
from torch.utils._python_dispatch import TorchDispatchMode

#: aten operations that only make a view of existing memory: no kernel runs for them.
VIEWS = frozenset(
    [
        "view",
        "_unsafe_view",
        "as_strided",
        "narrow",
        "slice",
        "select",
        "transpose",
        "permute",
        "expand",
        "unsqueeze",
        "squeeze",
        "t",
        "alias",
        "detach",
        "_reshape_alias",
        "split",
        "unbind",
    ]
)
SHAPES = ((640, 160, 4), (8, 48, 1))


# torch's TorchDispatchMode has no type hints: its calls are untyped to mypy.
class OperationCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the aten operations dispatched while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def count(prompt: int, new: int, batch: int) -> dict[str, collections.Counter[str]]:
    """Operations of one generation of ``new`` tokens after ``prompt``, stock and patched."""
    model = kv_cache.long_model(prompt + new + 8)
    tokens = kv_cache._tokens(model, prompt, batch)
    counts = {}
    for variant in ("stock", "patched"):
        with kv_cache.patched(variant == "patched"):
            kv_cache.greedy_generate(model, tokens, 2)  # first-call work is no one's
            counter = OperationCounter()
            with counter:
                kv_cache.greedy_generate(model, tokens, new)
        counts[variant] = counter.counts
    return counts


def table(rows: Sequence[tuple[tuple[int, int, int], dict[str, Any]]]) -> Table:
    """One row per shape: operations, kernel-launching ones and views, stock and patched."""
    result = Table(title="aten operations of one generate (GPT-2-like model, CPU)")
    for column in ("prompt+new x batch", "stock", "patched", "stock kernels", "patched kernels"):
        result.add_column(column, justify="right")
    result.add_column("patched - stock, by operation")
    for (prompt, new, batch), counts in rows:
        stock, ours = counts["stock"], counts["patched"]
        kernels = {
            name: sum(n for op, n in c.items() if op not in VIEWS) for name, c in counts.items()
        }
        names = sorted(set(stock) | set(ours), key=lambda op: -abs(ours[op] - stock[op]))
        changes = ", ".join(
            f"{op} {ours[op] - stock[op]:+d}" for op in names if ours[op] != stock[op]
        )
        result.add_row(
            f"{prompt}+{new} x {batch}",
            f"{sum(stock.values()):,}",
            f"{sum(ours.values()):,}",
            f"{kernels['stock']:,}",
            f"{kernels['patched']:,}",
            changes or "none",
        )
    return result


def main(argv: list[str] | None = None) -> int:
    """Count and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape",
        action="append",
        metavar="PROMPT,NEW,BATCH",
        help="repeatable; default 640,160,4 and 8,48,1",
    )
    args = parser.parse_args(argv)
    shapes: list[tuple[int, int, int]] = []
    for text in args.shape or []:
        parts = text.split(",")
        if len(parts) != 3 or not all(part.strip().isdigit() and int(part) > 0 for part in parts):
            parser.error(
                f"--shape: expected three positive integers PROMPT,NEW,BATCH; received {text!r}"
            )
        shapes.append((int(parts[0]), int(parts[1]), int(parts[2])))
    rows = [(shape, count(*shape)) for shape in shapes or SHAPES]
    Console(width=200).print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
