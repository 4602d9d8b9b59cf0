"""The verifier's report: one result per check, a rich table, a summary line and a JSON writer."""

from __future__ import annotations

import io
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table


@dataclass
class CheckResult:
    """One check of one model in one dtype on one device.

    ``kind`` is ``"generate"`` (a HookedTransformer), ``"cache-class"`` (the cache classes
    alone) or ``"bridge"`` (TransformerBridge). Fields a kind does not measure stay ``None``.
    """

    model: str
    dtype: str
    device: str
    kind: str = "generate"
    #: The Hugging Face architecture checked (TransformerBridge rows), e.g. ``LlamaForCausalLM``.
    architecture: str | None = None
    passed: bool = False
    max_rel_err: float | None = None
    tolerance: float | None = None
    #: TransformerBridge rows: the error against an independent Hugging Face forward, and its bound
    #: (``None``: reported, not held; encoder-decoder models in half precision).
    reference_rel_err: float | None = None
    reference_tolerance: float | None = None
    #: Where ``tolerance`` comes from (:meth:`safelens_tl.verify.oracle.Allowance.basis`).
    allowance: str | None = None
    #: How far the model's uncached forward moves when only the order of its sums changes, same
    #: dtype and tokens (:func:`safelens_tl.verify.oracle.order_error`): the allowance is twice
    #: this, at least the dtype's floor.
    order_rel_err: float | None = None
    #: TransformerBridge rows: the uncached forward in the dtype against float32 on the same
    #: tokens; bounds the reference comparison (and, with a recurrent state, the allowance).
    rounding_rel_err: float | None = None
    #: Cached positions the last compared step attended over; every step up to it is compared.
    cached_positions: int | None = None
    #: TransformerBridge rows: ``hf_generate`` (Hugging Face's loop over the bridge, cached)
    #: against the bridge's uncached forward, held to ``tolerance``; ``None`` where it is missing.
    hf_generate_rel_err: float | None = None
    generate_ok: bool | None = None
    #: HookedTransformer rows: how far ``generate``'s picks on the left-padded batch of two fall
    #: below greedy on each prompt alone (the largest shortfall of a pick's logit under the top
    #: one, relative to the largest |logit|), held to twice ``tolerance``.
    alone_gap: float | None = None
    #: Share of cached steps whose top token is the uncached forward's on the same tokens (the
    #: smallest over the row's batches); below 90% fails.
    greedy_agreement: float | None = None
    cache_dtype: str | None = None
    cache_device: str | None = None
    cache_heads: int | None = None
    expected_cache_heads: int | None = None
    ms_per_token_cached: float | None = None
    ms_per_token_uncached: float | None = None
    speedup: float | None = None
    seconds: float = 0.0
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON; ``error`` appears only on a failed check."""
        data = asdict(self)
        if self.error is None:
            del data["error"]
        return data


@dataclass
class Report:
    """Everything one ``verify`` run found."""

    patched: bool
    transformer_lens: str | None
    torch: str
    safelens_tl: str
    transformers: str | None = None
    checks: list[CheckResult] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)
    diagnostics: list[str] = field(default_factory=list)
    tolerances: dict[str, float] = field(default_factory=dict)
    control: dict[str, Any] | None = None
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        """True when there was at least one check and every check passed."""
        return bool(self.checks) and all(check.passed for check in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON, ``passed`` first."""
        data: dict[str, Any] = {"passed": self.passed}
        data.update(asdict(self))
        data["checks"] = [check.to_dict() for check in self.checks]
        return data


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _cache_cell(check: CheckResult) -> str:
    if check.cache_dtype is None:
        return "-"
    return f"{check.cache_dtype} {check.cache_device} {check.cache_heads}h"


def _error_cell(check: CheckResult) -> str:
    if check.max_rel_err is None:
        return "-"
    if check.tolerance is None:
        return f"{check.max_rel_err:.1e}"
    relation = "<=" if check.max_rel_err <= check.tolerance else ">"
    return f"{check.max_rel_err:.1e} {relation} {_bound(check.tolerance)}"


def _bound(value: float) -> str:
    """A tolerance as it was set (``2e-03``), or to two digits where derived (``1.1e-02``)."""
    short = f"{value:.0e}"
    return short if float(short) == value else f"{value:.1e}"


def _order_cell(check: CheckResult) -> str:
    return _number(check.order_rel_err, ".1e")


def table(report: Report, compact: bool = False) -> Table:
    """The human-readable table: one row per check. ``compact`` leaves out the columns a narrow
    terminal has no room for (the cache, the indicative timings, the order of sums) and shortens
    the headers; every check keeps its row, verdict, error and bound."""
    result = Table(
        title="safelens-tl verify: cached against uncached generation",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        # Narrow: one blank between columns instead of three.
        padding=(0, 0) if compact else (0, 1),
        pad_edge=not compact,
    )
    # A long --model name wraps in a narrow terminal rather than losing its end.
    result.add_column("model", no_wrap=not compact)
    for column in ("dtype", "device", "result"):
        result.add_column(column, no_wrap=True)
    result.add_column("err <= tol" if compact else "max rel err <= tol", no_wrap=True)
    if not compact:
        result.add_column("order**", justify="right")
    result.add_column("greedy" if compact else "greedy agree", justify="right")
    result.add_column("cached", justify="right")
    if not compact:
        result.add_column("cache", no_wrap=True)
        result.add_column("ms/tok cached*", justify="right")
        result.add_column("ms/tok uncached*", justify="right")
        result.add_column("speed-up*", justify="right", no_wrap=True)
    for check in report.checks:
        verdict = "[green]PASS[/]" if check.passed else "[bold red]FAIL[/]"
        agreement = "-" if check.greedy_agreement is None else f"{check.greedy_agreement:.0%}"
        cached = "-" if check.cached_positions is None else str(check.cached_positions)
        # Names such as "llama-like-gqa [bridge]" are not markup.
        cells = [escape(check.model), check.dtype, check.device, verdict, _error_cell(check)]
        if compact:
            cells += [agreement, cached]
        else:
            cells += [
                _order_cell(check),
                agreement,
                cached,
                _cache_cell(check),
                _number(check.ms_per_token_cached, ".0f"),
                _number(check.ms_per_token_uncached, ".0f"),
                "-" if check.speedup is None else f"{check.speedup:.2f}x",
            ]
        result.add_row(*cells)
    return result


def fits(console: Console, renderable: Table) -> bool:
    """Whether ``renderable`` fits ``console``'s width without cutting a cell (rich shortens a
    cell that does not fit with an ellipsis): rendered once, off screen, to find out."""
    trial = Console(file=io.StringIO(), width=console.width, color_system=None)
    trial.print(renderable)
    return "\u2026" not in trial.file.getvalue()  # type: ignore[attr-defined]


def summary_line(report: Report) -> str:
    """One line: verdict, counts, what was run, and how long it took."""
    failed = [check for check in report.checks if not check.passed]
    patch = "patched" if report.patched else "NOT patched (stock TransformerLens)"
    hf = f", transformers {report.transformers}" if report.transformers else ""
    where = f"TransformerLens {report.transformer_lens}{hf}, torch {report.torch}, {patch}"
    if not report.checks:
        return f"FAILED: no check could run ({where}) in {report.seconds:.1f} s"
    count = len(report.checks)
    if failed:
        which = "the 1 check" if count == 1 else f"{len(failed)} of {count} checks"
        return f"FAILED: {which} failed ({where}) in {report.seconds:.1f} s"
    which = "the 1 check" if count == 1 else f"all {count} checks"
    return (
        f"PASSED: {which}: cached generation matches uncached ({where}) in {report.seconds:.1f} s"
    )


def render(report: Report, console: Console) -> None:
    """Print the table, the errors of failed checks, notes, diagnostics and the summary line.

    The full table where it fits the console (a file or a log is given 160 columns); in a
    narrower terminal, the compact one, and a line saying where the rest is."""
    full = table(report)
    compact = not fits(console, full)
    console.print(table(report, compact=True) if compact else full)
    if compact:
        console.print(
            "A wider terminal, or --json, shows the cache, the order of sums and the timings.",
            highlight=False,
        )
    elif any(check.speedup is not None for check in report.checks):
        console.print(
            "* indicative only: time per token with the cache and without it (uncached "
            "generate, or forwards over prefixes) on tiny models, where per-call overhead "
            "dominates; a value under 1x does not mean the cache is slow. For speed, see "
            "benchmarks/ and docs/performance.md.",
            highlight=False,
        )
    if not compact and any(check.order_rel_err is not None for check in report.checks):
        console.print(
            "** how far the model's uncached forward moves, in the same dtype on the same tokens, "
            "when only the order of its sums changes (over each prefix; behind more padding). "
            "The tolerance is twice this, at least the dtype's floor (docs/verify.md).",
            highlight=False,
        )
    for check in report.checks:
        if check.error:
            console.print(
                f"[red]x[/] {escape(check.model)} {check.dtype} {check.device}: "
                f"{escape(check.error)}",
                highlight=False,
            )
    if report.control is not None:
        control = report.control
        console.print(
            f"Control: a frozen cache (it drops every past token) on {control['model']} "
            f"{control['dtype']} gives max rel err {control['max_rel_err']:.2f}, "
            f"{control['max_rel_err'] / control['loosest_tolerance']:.0f}x the loosest "
            f"tolerance of this run: the comparison sees a broken cache.",
            highlight=False,
        )
    for note in report.not_checked:
        console.print(f"[yellow]Not checked:[/] {note}", highlight=False)
    for diagnostic in report.diagnostics:
        console.print(f"[bold yellow]Diagnostic:[/] {diagnostic}", highlight=False)
    style = "bold green" if report.passed else "bold red"
    console.print(summary_line(report), style=style, highlight=False)


class ReportPathError(ValueError):
    """The JSON report cannot be written where the user asked."""


def check_writable(path: Path) -> None:
    """Raise :class:`ReportPathError` when ``path`` cannot be written; called before any check.

    A symbolic link is followed to where it points, as writing will: one pointing into a folder
    that does not exist is refused here, not after the run.
    """
    if path.is_symlink():
        target = path.resolve()
        if not target.parent.is_dir():
            raise ReportPathError(
                f"--json {path}: a symbolic link to {target}, whose folder does not exist"
            )
        path = target
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ReportPathError(f"--json {path}: is a folder; give a file name such as {path}/x.json")
    if not folder.is_dir():
        raise ReportPathError(f"--json {path}: folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ReportPathError(f"--json {path}: not writable; choose a path you can write to")


def write_json(report: Report, path: Path) -> None:
    """Write the report as indented JSON; raise :class:`ReportPathError` when that fails."""
    try:
        path.write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
    except OSError as error:
        raise ReportPathError(
            f"--json {path}: cannot write the report ({error.strerror})"
        ) from error
