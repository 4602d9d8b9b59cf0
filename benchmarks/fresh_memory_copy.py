"""Why a regrowth costs more than its bytes: copying into fresh memory against touched memory.

A cache that regrows moves its past into a newly allocated buffer; the first write to each page of
that buffer is a page fault. This prints, per cached length, the time of one copy of the past
(batch 4, 8 heads, d_head 64, fp32, as in ``kv_cache.py``) into a fresh buffer 1.25 times larger,
and into the same buffer again once its pages are touched. Run it with and without
``THP_MEM_ALLOC_ENABLE=1`` (torch's switch for transparent huge pages on large CPU allocations) to
see the allocator's share. ``--threads`` sets torch's intra-op threads.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

BATCH, HEADS, D_HEAD = 4, 8, 64


def copy_times(cached: int, rounds: int) -> tuple[float, float]:
    """Best seconds of one copy of ``cached`` positions into fresh, then into touched memory."""
    past = torch.randn(BATCH, cached, HEADS, D_HEAD)
    fresh = touched = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        buffer = torch.empty(BATCH, cached * 5 // 4, HEADS, D_HEAD)
        buffer[:, :cached].copy_(past)
        fresh = min(fresh, time.perf_counter() - start)
        start = time.perf_counter()
        buffer[:, :cached].copy_(past)
        touched = min(touched, time.perf_counter() - start)
        del buffer
    return fresh, touched


def main(argv: list[str] | None = None) -> int:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=7, help="best of this many (default 7)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    table = Table(title=f"one copy of the past, ms (torch threads: {torch.get_num_threads()})")
    for column in ("cached", "MiB", "into fresh memory", "into touched memory", "fresh/touched"):
        table.add_column(column, justify="right")
    for cached in (1024, 4096, 8192):
        fresh, touched = copy_times(cached, args.rounds)
        mib = BATCH * cached * HEADS * D_HEAD * 4 / 2**20
        table.add_row(
            str(cached),
            f"{mib:.0f}",
            f"{fresh * 1e3:.2f}",
            f"{touched * 1e3:.2f}",
            f"{fresh / touched:.1f}x",
        )
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
