"""Instructions executed by one ``generate``, stock against patched, counted by valgrind.

Wall-clock time on a shared 2-core machine moves by several percent from one run to the next,
more than what a short generation on a tiny model can show. The number of instructions the CPU
executes moves by a few hundredths of a percent (see below), so it tells whether the patched
path does more or less work than stock, without the noise. It does not see cache misses or
memory bandwidth, which the wall-clock tables do.

How: one child process per variant runs under valgrind's callgrind tool with counting off. The
stock child never activates safelens-tl; the patched child activates it once, before it builds the
model, as auto-activation does. Neither switches afterwards: switching changes TransformerLens's
classes, and Python's specialized bytecode then runs its generic form for a while, more
instructions for whichever variant the history hurts (docs/performance.md, "Method and noise":
counts taken while switching differed by up to 0.3%, a size that how a process is set up can
also give). Each child runs
:data:`WARM_UPS` uncounted generations of each shape, then counts ``rounds`` of them: around each
``generate`` (nothing else) a tiny C helper, compiled on the spot against ``valgrind/callgrind.h``,
turns counting on and writes the count under a label. Only the main thread is counted (TL's
progress-bar thread is switched off), less what it spent spinning on a lock (:data:`SPIN`: an
artefact of valgrind running one thread at a time, 0.3-1 million instructions in some rounds and
not others). The two children run side by side (a count does not depend on the load); the table
keeps each variant's smallest count, and the spread between its rounds.

Needs ``valgrind`` with its headers (Debian: ``valgrind``) and a C compiler. Without them the
section is skipped with a note. Under valgrind everything runs ~50x slower: a full run takes a few
minutes, most of it importing torch.

Run ``python benchmarks/instruction_counts.py [--model llama-like-gqa]`` alone, or as the
``instructions`` section of ``benchmarks/kv_cache.py`` (the GPT-2-like model).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

HELPER_SOURCE = r"""
#include <valgrind/callgrind.h>
void safelens_count_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void safelens_count_stop(const char *label) {
    CALLGRIND_STOP_INSTRUMENTATION;
    CALLGRIND_DUMP_STATS_AT(label);
}
"""

#: (prompt, new tokens) of each generation counted, batch 1.
GENERATIONS: tuple[tuple[int, int], ...] = ((8, 48), (1, 16))
ROUNDS = 5
#: The model counted by default: the verifier's GPT-2-like model (learned positions).
MODEL = "gpt2-like"


def build_helper(folder: Path) -> Path | str:
    """Compile the helper into ``folder``; return its path, or why it cannot be had here."""
    if shutil.which("valgrind") is None:
        return "valgrind is not installed"
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return "no C compiler (cc) to build the callgrind helper"
    source, library = folder / "helper.c", folder / "libsafelens_count.so"
    source.write_text(HELPER_SOURCE)
    built = subprocess.run(
        [compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(source)],
        capture_output=True,
        text=True,
        check=False,
    )
    if built.returncode != 0:
        return f"the callgrind helper did not compile (valgrind headers?): {built.stderr[-200:]}"
    return library


#: Uncounted generations of each shape in each child before its counted ones.
WARM_UPS = 3
#: One child process per variant; "patched" activates safelens-tl once, "stock" never.
VARIANTS = ("stock", "patched")


class Counter(Protocol):
    """What :func:`count_generations` counts with: the helper's two functions."""

    def safelens_count_start(self) -> Any:
        """Zero the counts and start counting."""

    def safelens_count_stop(self, label: bytes) -> Any:
        """Stop counting and write the count under ``label``."""


def count_generations(
    counter: Counter,
    variant: str,
    generations: Sequence[tuple[int, int]],
    rounds: int,
    model_name: str = MODEL,
) -> None:
    """Count ``rounds`` generations of each shape as ``variant|prompt+new``, in one state
    throughout: safelens-tl active from before the model is built (``variant`` "patched") or
    never, as in a user's process."""
    import generation  # the benchmarks' shared helpers; this script's folder is on sys.path
    import torch

    from safelens_tl.verify.models import build_model

    if variant not in VARIANTS:
        raise ValueError(f"count_generations: expected a variant in {VARIANTS}; got {variant!r}")
    with generation.patched(variant == "patched"):
        model = build_model(model_name, torch.float32)
        for prompt, new in generations:
            tokens = generation.prompt_tokens(model, prompt, 1)
            for _ in range(WARM_UPS):
                generation.greedy_generate(model, tokens, new)
            for _ in range(rounds):
                gc.collect()
                gc.disable()  # a collection inside one count and not another is noise
                counter.safelens_count_start()
                generation.greedy_generate(model, tokens, new)
                counter.safelens_count_stop(f"{variant}|{prompt}+{new}".encode())
                gc.enable()


def child(
    helper: str,
    variant: str,
    generations: Sequence[tuple[int, int]],
    rounds: int,
    model_name: str = MODEL,
) -> None:
    """Under callgrind: :func:`count_generations` with the helper at ``helper``."""
    import ctypes

    import torch
    import tqdm  # type: ignore[import-untyped]

    tqdm.tqdm.monitor_interval = 0  # no monitor thread
    sys.setswitchinterval(1000.0)  # no forced switches to other threads while counting
    torch.set_num_threads(1)
    count_generations(ctypes.CDLL(helper), variant, generations, rounds, model_name)


#: Functions whose instructions are left out of each count: under valgrind, a thread handing over
#: torch's or Python's lock sometimes spins in them for hundreds of thousands of instructions
#: (+314,335 at a time, in some rounds and not others). Natively that hand-over is a few dozen.
SPIN = "pthread_cond_"


def _function_name(spec: str, names: dict[str, str]) -> str:
    """A callgrind ``fn=``/``cfn=`` value: ``(id) name`` defines the id, ``(id)`` reuses it."""
    match = re.match(r"\((\d+)\)(?: (.*))?$", spec)
    if match is None:
        return spec
    if match[2] is not None:
        names[match[1]] = match[2]
    return names.get(match[1], "")


def spin_instructions(text: str) -> int:
    """Instructions a callgrind dump spent in :data:`SPIN` functions themselves (exclusive)."""
    names: dict[str, str] = {}
    current, after_call, spin = "", False, 0
    for line in text.splitlines():
        if line.startswith("fn="):
            current = _function_name(line[3:], names)
        elif line.startswith("cfn="):
            _function_name(line[4:], names)
        elif line.startswith("calls="):
            after_call = True  # the next cost line is the callee's inclusive cost
        elif line[:1].isdigit() or line[:1] in "+-*":
            if after_call:
                after_call = False
            elif SPIN in current:
                parts = line.split()
                spin += int(parts[1]) if len(parts) > 1 else 0
    return spin


def _counts(folder: Path) -> dict[tuple[str, str], list[int]]:
    counts: dict[tuple[str, str], list[int]] = {}
    for dump in folder.glob("callgrind.out.*-01"):  # -01: the main thread
        text = dump.read_text(errors="replace")
        label = re.search(r"^desc: Trigger: Client Request: (\S+)\|(\S+)$", text, re.M)
        total = re.search(r"^totals: (\d+)", text, re.M)
        if label and total:
            count = int(total[1]) - spin_instructions(text)
            counts.setdefault((label[1], label[2]), []).append(count)
    return counts


def count_in_children(
    variants: Sequence[str], generations: Sequence[tuple[int, int]], rounds: int, model: str
) -> tuple[dict[tuple[str, str], list[int]], str | None]:
    """One callgrind child per variant, side by side (a count does not depend on the load): the
    counts by ``(variant, "prompt+new")``, each a list of ``rounds``, and ``None``; or nothing and
    why."""
    with tempfile.TemporaryDirectory(prefix="safelens-callgrind-") as name:
        folder = Path(name)
        helper = build_helper(folder)
        if isinstance(helper, str):
            return {}, helper
        shapes = ",".join(f"{prompt}+{new}" for prompt, new in generations)
        env = {**os.environ, "PYTHONHASHSEED": "0", "SAFELENS_TL_AUTOPATCH": "0"}
        env.setdefault("HF_HUB_OFFLINE", "1")
        command = ["valgrind", "--tool=callgrind", "--separate-threads=yes"]
        command += ["--instr-atstart=no", f"--callgrind-out-file={folder}/callgrind.out.%p"]
        command += [sys.executable, __file__, "--child", str(helper)]
        children = {
            variant: subprocess.Popen(
                [*command, variant, shapes, str(rounds), model],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for variant in variants
        }
        # Wait for every child before reporting any: one left running would write into the
        # folder being removed.
        errors = {variant: process.communicate()[1] for variant, process in children.items()}
        for variant, process in children.items():
            if process.returncode != 0:
                return {}, (
                    f"valgrind ({variant}) exited with {process.returncode}: "
                    f"{errors[variant][-300:]}"
                )
        counts = _counts(folder)
    for variant in variants:
        for prompt, new in generations:
            found = counts.get((variant, f"{prompt}+{new}"), [])
            if len(found) != rounds:
                return {}, f"expected {rounds} counts of {variant} {prompt}+{new}; got {counts}"
    return counts, None


def measure(
    generations: Sequence[tuple[int, int]] = GENERATIONS, rounds: int = ROUNDS, model: str = MODEL
) -> tuple[list[dict[str, Any]], str | None]:
    """Count every generation of ``model`` (a verifier model's name), stock and patched; return
    the rows and ``None``, or no rows and why."""
    counts, reason = count_in_children(VARIANTS, generations, rounds, model)
    if reason is not None:
        return [], reason
    rows = []
    for prompt, new in generations:
        shape = f"{prompt}+{new}"
        stock, ours = counts[("stock", shape)], counts[("patched", shape)]
        rows.append(
            {
                "generation": shape,
                "stock": min(stock),
                "patched": min(ours),
                "stock_spread": max(stock) - min(stock),
                "patched_spread": max(ours) - min(ours),
                "rounds": rounds,
            }
        )
    return rows, None


def table(rows: Sequence[dict[str, Any]]) -> Any:
    """The rows as a rich table: counts in millions, and stock over patched."""
    from rich.table import Table

    result = Table(
        title="Instructions per generate (callgrind, main thread, fewest of the rounds; "
        "stock/patched >= 1.00: patched executes no more than stock)"
    )
    for column in ("generation", "stock, M", "patched, M", "stock/patched", "spread, M", "rounds"):
        result.add_column(column, justify="right")
    for row in rows:
        spread = max(row["stock_spread"], row["patched_spread"]) / 1e6
        result.add_row(
            f"{row['generation']} b1",
            f"{row['stock'] / 1e6:,.3f}",
            f"{row['patched'] / 1e6:,.3f}",
            f"{row['stock'] / row['patched']:.4f}x",
            f"{spread:.3f}",
            str(row["rounds"]),
        )
    return result


def main(argv: list[str] | None = None) -> int:
    """Count, print the table; ``--child`` is the part that runs under valgrind."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument(
        "--model",
        default=MODEL,
        help=f"a verifier model: {MODEL} (learned positions) or llama-like-gqa (rotary)",
    )
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        helper, variant, shapes, rounds, model = args.child
        pairs = [tuple(int(n) for n in shape.split("+")) for shape in shapes.split(",")]
        child(helper, variant, [(prompt, new) for prompt, new in pairs], int(rounds), model)
        return 0
    from rich.console import Console

    rows, reason = measure(GENERATIONS, args.rounds, args.model)
    if reason is not None:
        print(f"instruction counts skipped: {reason}")
        return 0
    Console(width=120).print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
