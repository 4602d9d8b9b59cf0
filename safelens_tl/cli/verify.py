"""``safelens-tl verify``: parse the options, run the checks with a progress display, report.

Usage errors (a bad ``--dtype`` or ``--device``, a model that cannot be loaded, a ``--json`` path
that cannot be written) print one line on stderr and exit 2, before any check runs where possible.
What can be judged from the text alone, and a ``--model`` path from its files, is judged before
torch and TransformerLens are imported (seconds, on a laptop): a typo answers at once.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from rich.progress import Progress, TaskID

    from safelens_tl.verify.report import CheckResult

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
#: ``--json`` given without a path (or as ``-``): the report on stdout, as ``status --json``.
JSON_TO_STDOUT = "-"
#: When this module was imported: the start of a run that is not given ``arguments.started``.
STARTED = time.perf_counter()
DTYPE_NAMES = ("float16", "bfloat16", "float32")
_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32"}


class UsageError(ValueError):
    """A command-line value that cannot be used; its message is the one line shown."""


def register(subcommands: Any) -> None:
    """Add the ``verify`` subcommand to the parser."""
    parser: argparse.ArgumentParser = subcommands.add_parser(
        "verify",
        help="check cached fp16/bf16 generation against uncached",
        description=(
            "Check that cached generation (use_past_kv_cache=True) matches uncached generation, "
            "per model, dtype and device. Without --model, two tiny built-in models with random "
            "weights are used: nothing is downloaded."
        ),
    )
    parser.add_argument(
        "--model",
        metavar="NAME_OR_FOLDER",
        help="check this model: a model name (HookedTransformer.from_pretrained on TransformerLens "
        "2.x/3.x, TransformerBridge.boot_transformers on 4.x), or a local Hugging Face checkpoint "
        "folder (config.json, weights, tokenizer), offline",
    )
    parser.add_argument(
        "--dtype",
        action="append",
        metavar="DTYPES",
        help="comma-separated dtypes among float16, bfloat16, float32; may be repeated "
        "(default: float16,bfloat16)",
    )
    parser.add_argument(
        "--device",
        action="append",
        metavar="DEVICES",
        help="comma-separated devices such as cpu, cuda, cuda:1; may be repeated "
        "(default: cpu, plus cuda when a GPU is visible)",
    )
    parser.add_argument(
        "--no-patch",
        action="store_true",
        help="deactivate safelens-tl first: shows what stock TransformerLens does",
    )
    parser.add_argument(
        "--thorough",
        action="store_true",
        help="longer runs (about 160 generated tokens, 120 positions on HookedTransformer) and "
        "the rounding allowance measured at every step, not 8 of them: slower",
    )
    parser.add_argument(
        "--json",
        nargs="?",
        const=JSON_TO_STDOUT,
        metavar="PATH",
        help="the report as JSON: alone, on stdout (the summary line goes to stderr); with a "
        "PATH, written there besides the table",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no table and no progress: only the summary line"
    )
    parser.set_defaults(run=run)


def _split_list(values: list[str] | None) -> list[str]:
    items = [item.strip() for value in values or [] for item in value.split(",")]
    return [item for item in items if item]


def dtype_names(values: list[str] | None) -> list[str]:
    """``["fp16,bfloat16"]`` -> ``["float16", "bfloat16"]``, in order, without repeats.

    Needs no torch; raises :class:`UsageError`.
    """
    names = _split_list(values)
    if values is not None and not names:
        raise UsageError(f"--dtype: no dtype given; expected some of {', '.join(DTYPE_NAMES)}")
    chosen: list[str] = []
    for raw in names or ["float16", "bfloat16"]:
        name = _ALIASES.get(raw.lower().removeprefix("torch."), raw.lower().removeprefix("torch."))
        if name not in DTYPE_NAMES:
            raise UsageError(
                f"--dtype: unknown dtype {raw!r}; expected a comma-separated list of "
                f"{', '.join(DTYPE_NAMES)} (e.g. --dtype float16,bfloat16)"
            )
        if name not in chosen:
            chosen.append(name)
    return chosen


def parse_dtypes(values: list[str] | None) -> list[torch.dtype]:
    """``["float16,bfloat16"]`` -> dtypes, in order, without repeats; raise :class:`UsageError`."""
    import torch

    return [getattr(torch, name) for name in dtype_names(values)]


_DEVICE = re.compile(r"(?P<type>[a-z]+)(?::(?P<index>\d+))?")


def device_names(values: list[str] | None) -> list[str] | None:
    """Device names that are well formed (``cpu``, ``cuda``, ``cuda:N``), or ``None`` for the
    default. Needs no torch; raises :class:`UsageError`."""
    names = _split_list(values)
    if values is None:
        return None
    if not names:
        raise UsageError("--device: no device given; expected e.g. cpu or cuda")
    devices: list[str] = []
    for name in names:
        found = _DEVICE.fullmatch(name.strip().lower())
        if found is None or found["type"] not in ("cpu", "cuda"):
            raise UsageError(f"--device: {name!r} is not supported; expected cpu or cuda[:N]")
        if found["type"] == "cpu" and found["index"] not in (None, "0"):
            raise UsageError(f"--device: {name!r}: there is one CPU device; use cpu")
        if name not in devices:
            devices.append(name)
    return devices


def parse_devices(values: list[str] | None) -> list[str] | None:
    """:func:`device_names`, then each CUDA device checked against what torch sees."""
    import torch

    devices = device_names(values)
    for name in devices or []:
        device = torch.device(name)
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0:
                raise UsageError(f"--device: {name!r} requested but torch sees no GPU here")
            if device.index is not None and device.index >= count:
                raise UsageError(f"--device: {name!r} requested but torch sees {count} GPU(s)")
    return devices


class _ProgressListener:
    """Shows a rich progress bar on stderr while the checks run."""

    def __init__(self, progress: Progress, task: TaskID, announce: bool) -> None:
        self.progress, self.task, self.announce = progress, task, announce

    def planned(self, total: int) -> None:
        self.progress.update(self.task, total=total)

    def started(self, label: str) -> None:
        from rich.markup import escape

        self.progress.update(self.task, description=f"checking {escape(label)}")

    def finished(self, result: CheckResult) -> None:
        from rich.markup import escape

        if self.announce:
            mark = "[green]ok[/]  " if result.passed else "[red]FAIL[/]"
            self.progress.console.print(
                f"{mark} {escape(result.model)} {result.dtype} {result.device} "
                f"({result.seconds:.1f} s)",
                highlight=False,
            )
        self.progress.advance(self.task)


def _usage_error(message: str) -> int:
    print(f"safelens-tl verify: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def run(arguments: argparse.Namespace) -> int:
    """Run ``verify``; return 0 when every check passed, 1 when one failed, 2 on usage errors."""
    from safelens_tl.verify import report as report_module

    try:  # first what the text alone decides: no torch yet
        dtype_names(arguments.dtype)
        device_names(arguments.device)
        if arguments.json not in (None, JSON_TO_STDOUT):
            report_module.check_writable(Path(arguments.json))
    except (UsageError, report_module.ReportPathError) as error:
        return _usage_error(str(error))
    if arguments.model:
        # Then a --model path, from its files alone: a mistyped folder answers at once, not after
        # importing torch and TransformerLens (seconds).
        from safelens_tl.verify import local_model

        problem = local_model.checkpoint_problem(arguments.model)
        if problem is not None:
            return _usage_error(problem)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from safelens_tl.verify import runner

    try:
        dtypes = parse_dtypes(arguments.dtype)
        devices = parse_devices(arguments.device)
    except UsageError as error:
        return _usage_error(str(error))

    import safelens_tl

    # Logs and CI are not terminals: rich would wrap the table at 80 columns there.
    stdout = Console() if sys.stdout.isatty() else Console(width=160)
    stderr = Console(stderr=True)
    progress = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=stderr,
        transient=True,
        # Not on a terminal (CI logs, pipes) a live display only leaves blank lines behind.
        disable=arguments.quiet or not stderr.is_terminal,
    )
    with progress:
        task = progress.add_task("importing TransformerLens", total=None)
        try:
            # Imported first so that the start-up hook's auto-activation has happened already:
            # --no-patch then switches it off, and nothing switches it back on.
            importlib.import_module("transformer_lens")
        except Exception as error:
            progress.stop()
            return _usage_error(f"cannot import transformer_lens ({type(error).__name__}: {error})")
        status = safelens_tl.deactivate() if arguments.no_patch else safelens_tl.activate()
        first = f"loading {arguments.model}" if arguments.model else "building the tiny models"
        progress.update(task, description=first)
        listener = _ProgressListener(progress, task, announce=not arguments.quiet)
        try:
            if arguments.model:
                report = runner.verify_pretrained(
                    arguments.model, dtypes, devices, listener, thorough=arguments.thorough
                )
            else:
                report = runner.verify_builtin(
                    dtypes, devices, listener, thorough=arguments.thorough
                )
        except runner.ModelLoadError as error:
            progress.stop()
            return _usage_error(str(error))
    for failure in status.failures:
        report.diagnostics.append(f"activation: {failure}")
    # All of it: imports, models, checks. ``safelens-tl`` passes when it started (the command
    # layer above this one); called on its own, this module's import is the start.
    started = getattr(arguments, "started", STARTED)
    report.seconds = time.perf_counter() - started
    if arguments.json == JSON_TO_STDOUT:
        # stdout holds the JSON alone, for a pipe; the verdict goes to stderr.
        print(json.dumps(report.to_dict(), indent=2))
        stderr.print(report_module.summary_line(report), highlight=False)
    elif arguments.quiet:
        stdout.print(report_module.summary_line(report), highlight=False)
    else:
        report_module.render(report, stdout)
    if arguments.json not in (None, JSON_TO_STDOUT):
        try:
            report_module.write_json(report, Path(arguments.json))
        except report_module.ReportPathError as error:
            return _usage_error(str(error))
    return EXIT_OK if report.passed else EXIT_FAILED
