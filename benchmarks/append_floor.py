"""What one append costs in torch calls alone, on the short generation's shape: the floor.

Stock appends a token with two ``torch.cat`` (keys, values). An in-place cache driven from Python
needs, per tensor, a view of the next position to write into, a ``copy_`` of the token, and a new
view of the whole past to hand back: six torch calls against stock's two. This script times each
of them with nothing else around (no checks, no TransformerLens), under ``torch.inference_mode()``
as in ``generate``, and prints the floor of the in-place append next to stock's two ``cat``.

    python benchmarks/append_floor.py [--threads 1] [--cached 8,32,128]
"""

from __future__ import annotations

import argparse
import timeit

import torch
from rich.console import Console
from rich.table import Table

#: The verifier's GPT-2-like model: batch 1, 4 heads, d_head 16 (the short generation's shape).
BATCH, HEADS, D_HEAD = 1, 4, 16
NUMBER, REPEAT = 5000, 9


def microseconds(statement: str, names: dict[str, object]) -> float:
    """Best of ``REPEAT`` runs of ``NUMBER`` executions of ``statement``, µs per execution."""
    runs = timeit.repeat(statement, globals=names, number=NUMBER, repeat=REPEAT)
    return min(runs) / NUMBER * 1e6


def measure(cached: int) -> dict[str, float]:
    """µs per torch call at ``cached`` positions."""
    with torch.inference_mode():
        buffer = torch.empty(BATCH, HEADS, cached + 64, D_HEAD)
        strides = buffer.transpose(1, 2).stride()
        token = torch.randn(BATCH, 1, HEADS, D_HEAD)
        names: dict[str, object] = {
            "torch": torch,
            "buffer": buffer,
            "strides": strides,
            "token": token,
            "past": torch.randn(BATCH, cached, HEADS, D_HEAD),
            "full": (BATCH, cached + 1, HEADS, D_HEAD),
            "offset": cached * D_HEAD,
            "slot": buffer.as_strided(token.shape, strides, cached * D_HEAD),
        }
        return {
            "cat": microseconds("torch.cat([past, token], dim=1)", names),
            "view": microseconds("buffer.as_strided(full, strides)", names),
            "slot": microseconds("buffer.as_strided(token.shape, strides, offset)", names),
            "copy": microseconds("slot.copy_(token)", names),
        }


def main() -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, help="torch intra-op threads")
    parser.add_argument("--cached", default="8,32,128", help="cached lengths, comma-separated")
    arguments = parser.parse_args()
    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    table = Table(
        title=f"torch calls of one append (keys and values), batch {BATCH}, {HEADS} heads, "
        f"d_head {D_HEAD}, fp32, µs"
    )
    columns = ["cached", "stock: 2 x cat", "view to write", "copy_ of a token", "view handed back"]
    columns += ["in place: 2 x (3 calls)", "in place - stock"]
    for column in columns:
        table.add_column(column, justify="right")
    for cached in (int(n) for n in arguments.cached.split(",")):
        cost = measure(cached)
        stock = 2 * cost["cat"]
        in_place = 2 * (cost["slot"] + cost["copy"] + cost["view"])
        table.add_row(
            str(cached),
            f"{stock:.2f}",
            f"{cost['slot']:.2f}",
            f"{cost['copy']:.2f}",
            f"{cost['view']:.2f}",
            f"{in_place:.2f}",
            f"{in_place - stock:+.2f}",
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
