"""Run the verifier's checks and collect a :class:`~safelens_tl.verify.report.Report`.

Every check catches its own exceptions: a check that raises is a failed check whose ``error`` says
what was raised, never a crash of the run. TransformerLens prints progress chatter ("Moving model
to device") and warnings while models are built; both are kept out of the report's output.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from safelens_tl.verify import checks, diagnostics, oracle
from safelens_tl.verify.report import CheckResult, Report

DEFAULT_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
#: Tokens each HookedTransformer ``generate`` call adds (timing, and greedy on each prompt alone).
GENERATE_TOKENS = 8
SPLIT_DEVICE = "cuda (2 GPUs)"


@dataclass(frozen=True)
class Depth:
    """How far each row reaches: the default run, or ``--thorough``."""

    #: Tokens TransformerBridge's cached ``generate`` adds to each batch. Every step is compared;
    #: with 64 the last one reads the prompt and 62 generated positions from the cache.
    bridge_tokens: int
    #: Prefix forwards that measure ``order`` (``None``: one per step).
    order_steps: int | None
    #: What HookedTransformer's teacher-forced runs feed after each prompt.
    continuation: str
    #: Tokens HookedTransformer's ``generate`` adds.
    generate_tokens: int


#: At least 64 cached positions per row; ``order`` from 8 prefixes per batch.
DEFAULT_DEPTH = Depth(64, oracle.ORDER_STEPS, checks.LONG_CONTINUATION, GENERATE_TOKENS)
#: ``--thorough``: longer runs (the built-in HookedTransformer models' context is 128 positions,
#: the built-in GPT-2 checkpoint's 256),
#: ``order`` at every step, and HookedTransformer's ``generate`` long enough for its buffer to
#: grow.
THOROUGH_DEPTH = Depth(160, None, checks.THOROUGH_CONTINUATION, 80)


def depth_for(thorough: bool) -> Depth:
    """:data:`THOROUGH_DEPTH` or :data:`DEFAULT_DEPTH`."""
    return THOROUGH_DEPTH if thorough else DEFAULT_DEPTH


class Listener(Protocol):
    """Told about each check as it starts and ends (the command's progress display)."""

    def planned(self, total: int) -> None:
        """``total`` checks are about to run."""

    def started(self, label: str) -> None:
        """A check labelled ``label`` is about to run."""

    def finished(self, result: CheckResult) -> None:
        """A check has ended with ``result``."""


class _Silent:
    def planned(self, total: int) -> None:
        pass

    def started(self, label: str) -> None:
        pass

    def finished(self, result: CheckResult) -> None:
        pass


@dataclass(frozen=True)
class Task:
    """One planned check: a label for the progress display and the function that runs it."""

    label: str
    run: Callable[[], CheckResult]


class ModelLoadError(RuntimeError):
    """``--model NAME`` could not be loaded (unknown name, offline and not cached, ...)."""


@contextlib.contextmanager
def quietly() -> Iterator[None]:
    """Keep TransformerLens's prints, log records and warnings out of the verifier's output.

    TransformerLens logs advice such as "float16 models may not work on CPU" to the root logger;
    the report says what actually works, so the advice is held back while the checks run.
    """
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def short_error(error: BaseException, limit: int = 240) -> str:
    """``Type: first line of the message``, cut before long lists and at ``limit`` characters."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = text.split(" Valid official model names", 1)[0]
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def tolerance_for(dtype: torch.dtype) -> float:
    """The least allowance of ``dtype`` (:data:`safelens_tl.verify.oracle.FLOORS`); dtypes
    without one (float64) use float32's."""
    return oracle.floor_for(dtype)


def _device_text(model: Any) -> str:
    n_devices = int(getattr(model.cfg, "n_devices", 1) or 1)
    device = torch.device(model.cfg.device).type
    return f"{device} ({n_devices} GPUs)" if n_devices > 1 else device


def _record_cache(result: CheckResult, model: Any, cache: Any) -> None:
    keys = cache.entries[0].past_keys
    result.cache_dtype = diagnostics.dtype_name(keys.dtype)
    result.cache_device = keys.device.type
    result.cache_heads = int(keys.shape[2])
    result.expected_cache_heads = checks.expected_cache_heads(model.cfg)


def check_hooked(model: Any, name: str, depth: Depth | None = None) -> CheckResult:
    """Run every check on a ``HookedTransformer`` as it is (its own dtype and device).

    The teacher-forced runs (:func:`checks.teacher_forced`, a batch of one prompt and a
    left-padded batch of two) are judged by :mod:`~safelens_tl.verify.oracle`; ``generate``
    itself is run for time and held to greedy on each prompt alone."""
    depth = depth or DEFAULT_DEPTH
    dtype = model.cfg.dtype
    result = CheckResult(
        model=name,
        dtype=diagnostics.dtype_name(dtype),
        device=_device_text(model),
        tolerance=tolerance_for(dtype),
    )
    problems: list[str] = []
    trap = diagnostics.half_trap(model)
    if trap is not None:
        problems.append(trap)
    raised: dict[str, list[str]] = {}
    bound = oracle.allowance(dtype if isinstance(dtype, torch.dtype) else torch.float32, None)
    try:
        forced = checks.teacher_forced_batches(
            model, continuation=depth.continuation, order_steps=depth.order_steps
        )
        order = oracle.worst_error(run.order for run in forced if run.order is not None)
        bound = oracle.allowance(bound.dtype, order)
        result.order_rel_err = order
        result.tolerance = bound.value
        result.allowance = bound.basis()
        result.max_rel_err = oracle.worst_error(run.max_rel_err for run in forced)
        result.cached_positions = min(run.cached_positions for run in forced)
        result.greedy_agreement = min(run.top1_agreement for run in forced)
        _record_cache(result, model, forced[-1].cache)
        for run in forced:
            problems.extend(checks.cache_problems(model, run.cache, run.cached.shape[1]))
        problems.extend(
            oracle.judge(
                result.max_rel_err,
                bound,
                result.greedy_agreement,
                "cached logits differ from uncached",
            )
        )
    except Exception as error:
        raised.setdefault(short_error(error), []).append("the cached forward")
    try:
        timed = checks.timed_generation(model, depth.generate_tokens, small_cache=True)
        result.generate_ok = timed.cached_tokens.shape[0] == len(checks.PROMPTS)
        result.ms_per_token_cached = 1000 * timed.seconds_cached / timed.new_tokens
        result.ms_per_token_uncached = 1000 * timed.seconds_uncached / timed.new_tokens
        result.speedup = timed.speedup
        problems.extend(_alone_problems(result, model, timed, bound))
    except Exception as error:
        result.generate_ok = False
        raised.setdefault(short_error(error), []).append("generate(use_past_kv_cache=True)")
    for message, places in raised.items():
        problems.append(f"{' and '.join(places)} raised {message}")
    result.passed = not problems
    result.error = "; ".join(problems) or None
    return result


def _alone_problems(
    result: CheckResult, model: Any, timed: checks.TimedGeneration, bound: oracle.Allowance
) -> list[str]:
    """Hold ``generate``'s rows to greedy on each prompt alone (see
    :func:`checks.batch_against_alone`), within twice the allowance (each of the two logits
    compared may be off by it); record the gap on ``result``."""
    against = checks.batch_against_alone(model, timed.cached_tokens, timed.new_tokens)
    result.alone_gap = against.worst_gap
    problems = [
        f"generate's row {row} does not hold its prompt's own tokens at its end"
        for row in against.misplaced_rows
    ]
    allowed = 2 * bound.value
    if not against.worst_gap <= allowed:
        problems.append(
            f"generate picks tokens that are not greedy for each prompt alone (a pick's logit "
            f"{against.worst_gap:.2e} below the top one, relative; allowed {allowed:.1e}): this "
            "release's generate gives a padded batch's rows, or every prompt's positions, other "
            "logits than the model's own forward (docs/verify.md)"
        )
    return problems


def _timed(run: Callable[[], CheckResult]) -> CheckResult:
    start = time.perf_counter()
    with quietly():
        result = run()
    result.seconds = time.perf_counter() - start
    return result


def _guarded(model: str, dtype: torch.dtype, device: str, run: Callable[[], CheckResult]) -> Task:
    """Wrap ``run`` so that an exception (e.g. while building the model) is a failed check."""

    def guarded() -> CheckResult:
        try:
            return run()
        except ModelLoadError:
            raise  # the model itself cannot be had: said once, exit 2
        except Exception as error:
            return CheckResult(
                model=model,
                dtype=diagnostics.dtype_name(dtype),
                device=device,
                tolerance=tolerance_for(dtype),
                error=short_error(error),
            )

    return Task(f"{model} {diagnostics.dtype_name(dtype)} {device}", lambda: _timed(guarded))


def run_tasks(tasks: Sequence[Task], listener: Listener | None = None) -> list[CheckResult]:
    """Run the tasks in order, telling ``listener``; return their results."""
    listener = listener or _Silent()
    results = []
    listener.planned(len(tasks))
    for task in tasks:
        listener.started(task.label)
        result = task.run()
        listener.finished(result)
        results.append(result)
    return results


def _new_report() -> Report:
    import safelens_tl
    from safelens_tl import targets

    return Report(
        patched=safelens_tl.is_active(),
        transformer_lens=targets.installed_release(),
        torch=torch.__version__,
        safelens_tl=safelens_tl.__version__,
        transformers=_transformers_version(),
        tolerances={diagnostics.dtype_name(d): t for d, t in checks.TOLERANCES.items()},
    )


def _transformers_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def default_devices() -> list[str]:
    """``cpu``, plus ``cuda`` when torch sees a GPU."""
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def _device_notes(devices: Sequence[str]) -> list[str]:
    notes = []
    if not torch.cuda.is_available():
        notes.append("cuda: torch sees no GPU here, so only the cpu was checked")
    elif any(d.startswith("cuda") for d in devices) and torch.cuda.device_count() < 2:
        notes.append("a model split over two GPUs: torch sees only one GPU")
    return notes


def _split(devices: Sequence[str]) -> bool:
    """Whether to add a model split over two GPUs (cuda requested and two GPUs present)."""
    wanted = any(d.startswith("cuda") for d in devices)
    return wanted and torch.cuda.is_available() and torch.cuda.device_count() >= 2


def _bridge_only_folder(name: str) -> bool:
    """A checkpoint folder of a text generator ``HookedTransformer`` does not take but this
    TransformerBridge boots: on TransformerLens 3.x, which has both, checked through the bridge
    rather than refused. (Masked language models and classifiers are refused as before.)"""
    from safelens_tl import targets
    from safelens_tl.verify import local_model

    if not local_model.is_checkpoint_folder(name):
        return False
    architecture = local_model.architecture_of(name)
    return (
        architecture is not None
        and architecture.endswith(local_model.TEXT_GENERATOR_SUFFIXES)
        and not local_model.hooked_transformer_takes(architecture)
        and architecture in targets.bridge_architectures()
    )


def _has_hooked_transformer() -> bool:
    from safelens_tl import targets

    return targets.locate().known.has_hooked_transformer


def _builtin_hooked_tasks(
    dtypes: Sequence[torch.dtype], devices: Sequence[str], depth: Depth
) -> list[Task]:
    from safelens_tl.verify import models

    tasks = []
    placements = [(device, 1) for device in devices]
    if _split(devices):
        placements.append(("cuda", 2))
    for name in models.BUILTIN_MODELS:
        for dtype in dtypes:
            for device, n_devices in placements:
                label = SPLIT_DEVICE if n_devices > 1 else device

                def run(
                    name: str = name,
                    dtype: torch.dtype = dtype,
                    device: str = device,
                    n_devices: int = n_devices,
                ) -> CheckResult:
                    model = models.build_model(name, dtype, device, n_devices=n_devices)
                    return check_hooked(model, name, depth)

                tasks.append(_guarded(name, dtype, label, run))
    return tasks


def _cache_class_check(dtype: torch.dtype, device: str) -> CheckResult:
    from safelens_tl.verify import cache_class_checks

    problems = cache_class_checks.cache_class_problems(dtype, device)
    return CheckResult(
        model="cache classes (GQA)",
        dtype=diagnostics.dtype_name(dtype),
        device=device,
        kind="cache-class",
        passed=not problems,
        cache_heads=cache_class_checks.N_KEY_VALUE_HEADS if not problems else None,
        expected_cache_heads=cache_class_checks.N_KEY_VALUE_HEADS,
        cached_positions=sum(cache_class_checks.STEPS) - 1,
        error="; ".join(problems) or None,
    )


def bridge_label(name: str) -> str:
    """How a TransformerBridge model is named in the report (``llama-like-gqa [bridge]``)."""
    return f"{name} [bridge]"


def _bridge_check(
    label: str,
    dtype: torch.dtype,
    device: str,
    folder: str | None = None,
    depth: Depth | None = None,
) -> CheckResult:
    """A TransformerBridge model: cached ``generate`` replayed against its own uncached forward
    and Hugging Face's, judged by :mod:`~safelens_tl.verify.oracle`. The built-in model
    ``label`` unless ``folder`` names a checkpoint."""
    import safelens_tl
    from safelens_tl.verify import bridge

    depth = depth or DEFAULT_DEPTH
    source = folder if folder is not None else bridge.model_folder(label)
    try:
        model = bridge.boot_folder(source, dtype, device)
        reference = bridge.reference_from(source, dtype, device)
    except Exception as error:
        if folder is None:
            raise  # a built-in model: a failed check
        # The user's checkpoint: a load error, not a broken cache (exit 2, one line).
        raise ModelLoadError(
            f"--model {folder}: cannot load the checkpoint in {diagnostics.dtype_name(dtype)} "
            f"({short_error(error)}); check its config.json, weights and tokenizer files"
        ) from error
    runs = bridge.run_batches(
        model,
        reference,
        depth.bridge_tokens,
        uncached_generate=False,
        order_steps=depth.order_steps,
        # Hugging Face's loop over the bridge's modules: on the padded batch, which holds every
        # cache path the batch of one does, and more (padding, rows of other lengths).
        hf_generate_batches=(max(bridge.BATCHES),),
    )
    del reference
    if dtype != torch.float32:
        runs = bridge.add_float32_rounding(model, runs)  # the bridge is float32 from here on
    del model
    bound = bridge.allowance_of(runs, dtype)
    order, rounding = bound.order, bound.rounding
    reference_tolerance: float | None = None
    if all(run.reference_held for run in runs):
        reference_tolerance = oracle.reference_bound(dtype, rounding)
    worst = max(runs, key=lambda run: math.inf if math.isnan(run.max_rel_err) else run.max_rel_err)
    cached = sum(run.seconds_cached for run in runs)
    timed_uncached = [run.seconds_uncached for run in runs if run.seconds_uncached is not None]
    uncached = sum(timed_uncached) if len(timed_uncached) == len(runs) else None
    tokens = sum(run.cached_tokens.numel() for run in runs)
    result = CheckResult(
        model=bridge_label(label),
        dtype=diagnostics.dtype_name(dtype),
        device=device,
        kind="bridge",
        architecture=worst.architecture,
        tolerance=bound.value,
        allowance=bound.basis(),
        order_rel_err=order,
        rounding_rel_err=rounding,
        cached_positions=min(run.cached_positions for run in runs),
        max_rel_err=worst.max_rel_err,
        reference_rel_err=bridge.worst_error(run.reference_rel_err for run in runs),
        reference_tolerance=reference_tolerance,
        generate_ok=True,
        greedy_agreement=min(run.top1_agreement for run in runs),
        expected_cache_heads=worst.expected_cache_heads,
        ms_per_token_cached=1000 * cached / tokens,
        ms_per_token_uncached=None if uncached is None else 1000 * uncached / tokens,
        speedup=None if uncached is None else uncached / max(cached, 1e-9),
    )
    problems = oracle.judge(
        worst.max_rel_err,
        bound,
        result.greedy_agreement,
        f"cached generate's logits (batch of {worst.batch}) differ from the bridge's uncached "
        "forward",
    )
    diagnosis = None if safelens_tl.is_active() else bridge.cache_argument_diagnosis()
    if problems and diagnosis:
        problems[0] = f"{problems[0]}: {diagnosis}"
    reference_bound = result.reference_tolerance
    if reference_bound is not None and not (result.reference_rel_err or 0.0) <= reference_bound:
        problems.append(
            f"cached generate's logits differ from Hugging Face's own uncached forward by "
            f"{result.reference_rel_err:.2e} (relative), above {reference_bound:.1e}"
        )
    problems.extend(_hf_generate_problems(runs, bound.value))
    hf_errors = [run.hf_generate_rel_err for run in runs if run.hf_generate_rel_err is not None]
    result.hf_generate_rel_err = max(hf_errors, default=None)
    for run in runs:
        problems.extend(_bridge_cache_problems(run, dtype, device))
    first = runs[0]
    if first.cache_dtype is not None and first.cache_device is not None:
        result.cache_dtype = diagnostics.dtype_name(first.cache_dtype)
        result.cache_device = first.cache_device.type
        result.cache_heads = first.cache_heads
    result.passed = not problems
    result.error = "; ".join(dict.fromkeys(problems)) or None
    return result


def _hf_generate_problems(runs: list[Any], tolerance: float) -> list[str]:
    """What is wrong with ``hf_generate`` through the bridge, held to the same bound as the
    bridge's own cached ``generate``."""
    problems = []
    for run in runs:
        if run.hf_generate_error is not None:
            problems.append(f"hf_generate (batch of {run.batch}) raised {run.hf_generate_error}")
        # Written as "not <=" so that a NaN error fails too.
        elif run.hf_generate_rel_err is not None and not run.hf_generate_rel_err <= tolerance:
            problems.append(
                f"hf_generate's cached logits differ from the bridge's uncached forward by "
                f"{run.hf_generate_rel_err:.2e} (relative, batch of {run.batch}), above "
                f"{tolerance:.1e}"
            )
    return problems


def _bridge_cache_problems(run: Any, dtype: torch.dtype, device: str) -> list[str]:
    """What is wrong with the Hugging Face cache the bridge filled over a prompt."""
    if run.state_only:
        return []  # recurrent state only: no KV cache; the generation itself was checked
    if run.cache_dtype is None or run.cache_device is None:
        return ["after a cached forward over the prompt the cache is still empty"]
    problems = []
    if run.cache_dtype != dtype or run.cache_device.type != torch.device(device).type:
        problems.append(
            f"the cache holds {run.cache_dtype} on {run.cache_device}; the model runs in "
            f"{dtype} on {device}"
        )
    if run.cache_heads != run.expected_cache_heads:
        problems.append(
            f"the cache has {run.cache_heads} heads, {run.expected_cache_heads} expected"
        )
    return problems


def _per_dtype_and_device(
    label: str,
    check: Callable[[torch.dtype, str], CheckResult],
    dtypes: Sequence[torch.dtype],
    devices: Sequence[str],
) -> list[Task]:
    """One guarded task running ``check(dtype, device)`` for each dtype and device."""
    return [
        _guarded(label, dtype, device, functools.partial(check, dtype, device))
        for dtype in dtypes
        for device in devices
    ]


def _control(dtypes: Sequence[torch.dtype]) -> dict[str, Any] | None:
    """Run the frozen-cache control once; ``None`` when it cannot run."""
    from safelens_tl.verify import models

    try:
        with quietly():
            model = models.build_model("gpt2-like", torch.float32, "cpu")
            error = checks.frozen_cache_control(model)
    except Exception:
        return None
    return {
        "model": "gpt2-like",
        "dtype": "float32",
        "device": "cpu",
        "max_rel_err": error,
        # The control runs in float32: its own tolerance, and the loosest one of the run.
        "tolerance": tolerance_for(torch.float32),
        "loosest_tolerance": max(tolerance_for(dtype) for dtype in dtypes),
    }


def builtin_tasks(
    dtypes: Sequence[torch.dtype], devices: Sequence[str], depth: Depth | None = None
) -> list[Task]:
    """The default run: built-in models where HookedTransformer exists, cache classes, and the
    TransformerBridge models where the release has TransformerBridge."""
    from safelens_tl import targets

    depth = depth or DEFAULT_DEPTH
    tasks: list[Task] = []
    if _has_hooked_transformer():
        tasks.extend(_builtin_hooked_tasks(dtypes, devices, depth))
    tasks.extend(_per_dtype_and_device("cache classes (GQA)", _cache_class_check, dtypes, devices))
    if targets.has_bridge():
        from safelens_tl.verify import bridge

        for name in bridge.BRIDGE_MODELS:
            check = functools.partial(_bridge_check, name, depth=depth)  # dtype, device follow
            label = bridge_label(name)
            tasks.extend(_per_dtype_and_device(label, check, dtypes, devices))
    return tasks


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch's operations on one CPU thread within this block, then restore the count.

    The built-in models are too small to gain from a second thread: their matrices hold a few
    thousand numbers, and each operation's hand-off between threads costs more than it saves.
    On a 2-core CPU shared with other work, ``safelens-tl verify`` took 47-72 s with torch's two
    threads and 14 s with one (docs/verify.md).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def verify_builtin(
    dtypes: Sequence[torch.dtype] = DEFAULT_DTYPES,
    devices: Sequence[str] | None = None,
    listener: Listener | None = None,
    thorough: bool = False,
) -> Report:
    """Check the built-in tiny models (nothing downloaded) in each dtype on each device;
    ``thorough``: :data:`THOROUGH_DEPTH`."""
    start = time.perf_counter()
    devices = list(devices) if devices is not None else default_devices()
    report = _new_report()
    with one_thread():
        report.checks = run_tasks(builtin_tasks(dtypes, devices, depth_for(thorough)), listener)
    if _has_hooked_transformer():
        report.control = _control(dtypes)
    else:
        release = report.transformer_lens
        report.not_checked.append(
            f"HookedTransformer.generate: TransformerLens {release} has no HookedTransformer; "
            "the patched cache classes and TransformerBridge were checked instead"
        )
    report.not_checked.extend(_device_notes(devices))
    report.seconds = time.perf_counter() - start
    return report


def load_pretrained(name: str, dtype: torch.dtype, device: str) -> Any:
    """``HookedTransformer.from_pretrained(name)``, or the local checkpoint folder ``name``
    loaded by TransformerLens's own loader; :class:`ModelLoadError` on any failure."""
    from safelens_tl import targets
    from safelens_tl.verify import local_model

    if not _has_hooked_transformer():
        raise ModelLoadError(
            f"--model {name}: TransformerLens {targets.installed_release()} has no "
            f"HookedTransformer to load it into; verify_pretrained boots it through "
            f"TransformerBridge instead"
        )
    folder = local_model.is_checkpoint_folder(name)
    if folder or not _is_official_name(name):
        # A folder, or a fine-tune or any other Hub repository (from_pretrained takes official
        # names only): loaded as a checkpoint, by TransformerLens's own loader.
        try:
            with quietly():
                return local_model.load_hooked(name, dtype, device)
        except local_model.UnsupportedCheckpointError as error:
            raise ModelLoadError(str(error)) from error
        except Exception as error:
            release = targets.installed_release()
            why = (
                f"cannot load the checkpoint in {name} with TransformerLens {release}'s loader "
                f"({short_error(error)}); it needs config.json, the weights and the tokenizer files"
                if folder
                else f"cannot load model {name!r}: it is not one of TransformerLens {release}'s "
                f"official model names, and not a checkpoint on the Hugging Face Hub either "
                f"({short_error(error)}); check the name, and when offline (HF_HUB_OFFLINE=1) "
                f"download it once while online"
            )
            raise ModelLoadError(why) from error
    from transformer_lens import HookedTransformer

    try:
        with quietly():
            return HookedTransformer.from_pretrained(name, dtype=dtype, device=device)
    except Exception as error:
        raise ModelLoadError(
            f"cannot load model {name!r} with HookedTransformer.from_pretrained "
            f"({short_error(error)}); check the name, and when offline (HF_HUB_OFFLINE=1) "
            f"download it once while online"
        ) from error


def _is_official_name(name: str) -> bool:
    """Whether TransformerLens (2.x/3.x) knows ``name`` as an official model name or alias."""
    from safelens_tl import targets

    loading = importlib.import_module(targets.HOOKED_LOADING_MODULE)
    try:
        loading.get_official_model_name(name)
    except ValueError:  # "<name> not found. Valid official model names ..."
        return False
    return True


def _require_hub_model(name: str) -> None:
    """Raise :class:`ModelLoadError` unless Hugging Face finds the config of model ``name``,
    before any dtype or device is tried with it."""
    from transformers import AutoConfig

    auto_config: Any = AutoConfig
    try:
        with quietly():
            auto_config.from_pretrained(name)
    except Exception as error:
        raise ModelLoadError(
            f"cannot load model {name!r} from Hugging Face ({short_error(error)}); check the "
            f"name, and when offline (HF_HUB_OFFLINE=1) download it once while online, or give a "
            f"local checkpoint folder"
        ) from error


def verify_pretrained(
    name: str,
    dtypes: Sequence[torch.dtype] = DEFAULT_DTYPES,
    devices: Sequence[str] | None = None,
    listener: Listener | None = None,
    thorough: bool = False,
) -> Report:
    """Check the model ``name`` (a Hugging Face model name, or a local checkpoint folder) in
    each dtype on each device (``thorough``: :data:`THOROUGH_DEPTH`).

    With a ``HookedTransformer`` (TransformerLens 2.x/3.x) it is loaded once and converted to
    each dtype. Without one (4.x), or for a folder it does not take but TransformerBridge boots
    (3.x: :func:`_bridge_only_folder`), it boots through TransformerBridge in each dtype, from the
    folder or, for a name, from Hugging Face (its cache when offline). Raises
    :class:`ModelLoadError` when the model cannot be loaded.
    """
    from safelens_tl import targets
    from safelens_tl.verify import local_model

    start = time.perf_counter()
    depth = depth_for(thorough)
    problem = local_model.checkpoint_problem(name)
    if problem is not None:
        raise ModelLoadError(problem)
    devices = list(devices) if devices is not None else default_devices()
    if targets.has_bridge() and (not _has_hooked_transformer() or _bridge_only_folder(name)):
        if local_model.is_checkpoint_folder(name):
            label = Path(name).name or name
        else:
            _require_hub_model(name)
            label = name
        check = functools.partial(_bridge_check, label, folder=name, depth=depth)
        report = _new_report()
        report.checks = run_tasks(_per_dtype_and_device(label, check, dtypes, devices), listener)
        report.not_checked.extend(_device_notes(devices))
        report.seconds = time.perf_counter() - start
        return report
    model = load_pretrained(name, dtypes[0], devices[0])
    label = Path(name).name if local_model.is_checkpoint_folder(name) else name
    tasks = []
    for dtype in dtypes:
        for device in devices:

            def run(dtype: torch.dtype = dtype, device: str = device) -> CheckResult:
                # model.to(dtype) updates cfg.dtype as well; .half() would not.
                return check_hooked(model.to(dtype).to(device), label, depth)

            tasks.append(_guarded(label, dtype, device, run))
    report = _new_report()
    report.checks = run_tasks(tasks, listener)
    report.not_checked.extend(_device_notes(devices))
    report.seconds = time.perf_counter() - start
    return report


def verify_model(
    model: Any, name: str | None = None, listener: Listener | None = None, thorough: bool = False
) -> Report:
    """Check a ``HookedTransformer`` the caller already has, in its own dtype and on its device.

    The model is not converted or moved, and safelens-tl's activation is left as it is (the
    report's ``patched`` says which it was). A model whose weights' dtype differs from
    ``cfg.dtype`` (the ``model.half()`` trap) fails with a diagnostic that names the fix.
    """
    start = time.perf_counter()
    label = name or str(getattr(model.cfg, "model_name", None) or type(model).__name__)
    dtype = model.cfg.dtype if isinstance(model.cfg.dtype, torch.dtype) else torch.float32
    depth = depth_for(thorough)
    task = _guarded(label, dtype, _device_text(model), lambda: check_hooked(model, label, depth))
    report = _new_report()
    report.checks = run_tasks([task], listener)
    trap = diagnostics.half_trap(model)
    if trap is not None:
        report.diagnostics.append(f"{label}: {trap}")
    report.seconds = time.perf_counter() - start
    return report
