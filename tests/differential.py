"""The patched-against-stock guard's machinery: a seeded sample of a grid of ``generate`` calls,
each run stock and patched on one model, and the rule every result must keep; and what the
forward half of the guard (``tests/test_differential_forward.py``: every way a forward is run,
compiled, exported, fake, subclassed, with gradients) measures, peak memory and the ATen
operations run.

**The rule.** Patched gives stock's result bitwise, and shows hooks the same batch shapes in
the same order, unless stock is wrong in that configuration and patched is right; even then,
hooks see the shapes stock shows them, unless stock raised. Wrong means an
exception, or logits that are not each prompt's own: at every step, the logits ``generate`` used
for a row are held to the model's uncached forward of that prompt alone followed by the tokens
the row generated (teacher-forced, so greedy and sampled calls are judged alike), within a
tolerance of the dtype's rounding. Such a difference is what a fix claims; any other difference
is a regression.

The grid is sampled with a fixed seed, ``SAMPLES`` configurations per test module (seconds
per environment on 2 cores). A larger or another sample on demand::

    SAFELENS_TL_DIFFERENTIAL_SAMPLES=500 SAFELENS_TL_DIFFERENTIAL_SEED=7 \
        pytest tests/test_differential_hooked.py tests/test_differential_bridge.py
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import safelens_tl

SAMPLES = int(os.environ.get("SAFELENS_TL_DIFFERENTIAL_SAMPLES", "200"))
SEED = int(os.environ.get("SAFELENS_TL_DIFFERENTIAL_SEED", "0"))
NEW_TOKENS = 5

#: Prompts of the tiny word-level tokenizers: equal and different word counts.
EQUAL = ["the cat runs", "a dog sleeps", "the bird sings"]
DIFFERENT = ["the cat runs in the river", "a dog", "the big old bird sings"]


def sample_grid(
    axes: dict[str, Sequence[Any]], count: int = SAMPLES, seed: int = SEED
) -> list[Any]:
    """``count`` distinct points of the product of ``axes`` (all of them when fewer), chosen with
    ``seed``, each a dict of axis name to value, in a stable order."""
    names = list(axes)
    points = [dict(zip(names, values, strict=True)) for values in itertools.product(*axes.values())]
    chosen = random.Random(seed).sample(range(len(points)), min(count, len(points)))
    return [points[index] for index in sorted(chosen)]


def point_id(point: dict[str, Any]) -> str:
    """A test id naming every axis value of a grid point."""
    return "-".join(str(value).replace("torch.", "") for value in point.values())


@dataclass
class Outcome:
    """What one ``generate`` call gave: its result or the error it raised, what hooks saw, and
    the logits of every step (``[batch, vocab]`` each)."""

    result: Any = None
    error: BaseException | None = None
    #: ``(hook name, shape)`` of every recorded activation, in order.
    seen: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    def same_as(self, other: Outcome) -> bool:
        """Bitwise the same result (or the same kind of error) and the same view to hooks."""
        if (self.error is None) != (other.error is None):
            return False
        if self.error is not None:
            return type(self.error) is type(other.error) and self.seen == other.seen
        return equal(self.result, other.result) and self.seen == other.seen

    def describe(self) -> str:
        """One line for a failure message."""
        if self.error is not None:
            return f"raised {self.error!r}"
        return f"{self.result!r}, hooks saw {self.seen[:4]}..."


def equal(first: Any, second: Any) -> bool:
    """Bitwise equality of results: tensors, strings, and lists or tuples of them."""
    if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
        return (
            first.shape == second.shape
            and first.dtype == second.dtype
            and bool(torch.equal(first, second))
        )
    if isinstance(first, (list, tuple)) and isinstance(second, (list, tuple)):
        return len(first) == len(second) and all(
            equal(a, b) for a, b in zip(first, second, strict=True)
        )
    return type(first) is type(second) and bool(first == second)


def run(
    model: Any,
    call: Callable[[], Any],
    hook_names: Sequence[str],
    logits_module: torch.nn.Module,
    seed: int | None,
) -> Outcome:
    """``call()`` under hooks that record the shape of each named activation and, from the
    output of ``logits_module`` (the unembedding) at its last position, each step's logits; the
    random stream seeded with ``seed`` first (for sampling)."""
    outcome = Outcome()

    def record(activation: torch.Tensor, hook: Any) -> None:
        outcome.seen.append((hook.name, tuple(activation.shape)))

    def record_logits(module: Any, inputs: Any, output: torch.Tensor) -> None:
        outcome.logits.append(output[:, -1].detach().float())

    if seed is not None:
        torch.manual_seed(seed)
    handle = logits_module.register_forward_hook(record_logits)
    try:
        with model.hooks(fwd_hooks=[(name, record) for name in hook_names]):
            outcome.result = call()
    except Exception as error:  # stock's failures are part of what is compared
        outcome.error = error
    finally:
        handle.remove()
    return outcome


def teacher_forced_error(
    outcome: Outcome,
    prompts: Sequence[torch.Tensor],
    forward: Callable[[torch.Tensor], torch.Tensor],
) -> float:
    """The largest difference between the logits ``generate`` used for each row and the uncached
    forward of the row's prompt alone (``[1, n]`` tokens) followed by the tokens the row
    generated, relative to the largest logit of the forward; ``inf`` for an error."""
    if outcome.error is not None or not isinstance(outcome.result, torch.Tensor):
        return float("inf")
    steps = len(outcome.logits)
    worst = 0.0
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            generated = outcome.result[row, outcome.result.shape[1] - steps :]
            tokens = torch.cat([prompt, generated[: steps - 1].unsqueeze(0).to(prompt)], dim=1)
            expected = forward(tokens)[0, prompt.shape[1] - 1 :].float()
            used = torch.stack([step[row] for step in outcome.logits])
            scale = float(expected.abs().max()) or 1.0
            worst = max(worst, float((used - expected).abs().max()) / scale)
    return worst


@dataclass(frozen=True)
class Verdict:
    """How a configuration came out: ``kind`` is ``"same"`` (patched is stock, bitwise),
    ``"claimed"`` (stock wrong, patched right) or ``"regression"``, with the evidence."""

    kind: str
    detail: str


def judge(
    stock: Outcome, patched: Outcome, error_of: Callable[[Outcome], float], tolerance: float
) -> Verdict:
    """Apply the rule (module docstring) to one configuration; ``error_of`` gives an outcome's
    :func:`teacher_forced_error`, computed only where the two differ."""
    if patched.same_as(stock):
        return Verdict("same", "")
    detail = f"stock {stock.describe()}\npatched {patched.describe()}"
    if stock.error is None and patched.seen != stock.seen:
        # Even a fix shows hooks what stock shows them: the batch as passed, one forward a step.
        return Verdict("regression", "hooks saw other shapes than stock shows them\n" + detail)
    patched_error = error_of(patched)
    if patched_error > tolerance:
        return Verdict(
            "regression",
            f"patched differs from stock and is off the forward by {patched_error:.2e} "
            f"(tolerance {tolerance:.0e})\n{detail}",
        )
    stock_error = error_of(stock)
    if stock_error <= tolerance:
        return Verdict(
            "regression",
            f"stock is right (off by {stock_error:.2e}) and patched differs from it\n{detail}",
        )
    return Verdict("claimed", f"stock off by {stock_error:.2e}, patched by {patched_error:.2e}")


def prompts_of(point: dict[str, Any]) -> list[str]:
    """The point's prompts: equal or different lengths; one of them for a string input."""
    prompts = EQUAL if point["lengths"] == "equal" else DIFFERENT
    return prompts[1:2] if point["input"] == "str" else list(prompts)


#: ``to_tokens`` options of each kind of tensor input: padded on the model's side with its BOS
#: (as a user's own ``to_tokens`` pads them), on the left whatever the model's side, and on the
#: left without BOS.
TENSOR_INPUTS: dict[str, dict[str, Any]] = {
    "tensor": {},
    "tensor-left": {"padding_side": "left"},
    "tensor-left-no-bos": {"padding_side": "left", "prepend_bos": False},
}


def given_of(model: Any, point: dict[str, Any]) -> Any:
    """``generate``'s input: one string, a list, or the tokens of the prompts as the kind of
    tensor input says (:data:`TENSOR_INPUTS`)."""
    prompts = prompts_of(point)
    if point["input"] == "str":
        return prompts[0]
    if point["input"] == "list":
        return prompts
    return model.to_tokens(prompts, **TENSOR_INPUTS[point["input"]])


def prompt_rows(model: Any, point: dict[str, Any]) -> list[Any]:
    """Each prompt's tokens alone (``[1, n]``), with BOS where the point's input has one."""
    bos = TENSOR_INPUTS.get(point["input"], {}).get("prepend_bos")
    options = {} if bos is None else {"prepend_bos": bos}
    return [model.to_tokens(prompt, **options) for prompt in prompts_of(point)]


def generate_outcome(
    model: Any, point: dict[str, Any], active: bool, hook_names: Sequence[str]
) -> Outcome:
    """The point's ``generate`` call on ``model``, patched (``active``) or stock."""
    given = given_of(model, point)
    options = {
        "max_new_tokens": NEW_TOKENS,
        "use_past_kv_cache": point["cached"] == "cached",
        "do_sample": point["sampling"] == "sampled",
        "stop_at_eos": False,
        "verbose": False,
        "return_type": "tokens",
    }
    if active:
        safelens_tl.activate()
    try:
        return run(
            model,
            lambda: model.generate(given, **options),
            hook_names,
            model.unembed,
            seed=1234 if point["sampling"] == "sampled" else None,
        )
    finally:
        safelens_tl.deactivate()


def uncached_forward(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's uncached forward of one unpadded row: every position attended to (a generated
    pad token too, as ``generate`` attends to it), positions counted from 0."""
    return lambda tokens: model(tokens, attention_mask=torch.ones_like(tokens))


#: Where torch's profiler files an allocation of CPU memory (oneDNN's own allocations too).
CPU_MEMORY = ("CPU", "MKLDNN", "IDEEP")


def peak_bytes(call: Callable[[], Any]) -> tuple[Any, int]:
    """``call()``'s result and the most CPU memory it held at once, counted by torch's profiler
    from every allocation and free (those inside ATen kernels too), in the order they happened:
    deterministic for the same code and shapes, whatever else the machine is doing. Read from
    the profiler's raw records: building its per-operator table costs 0.15 s a call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        result = call()
    records = [
        (event.start_ns(), event.nbytes())
        for event in profiler.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type().name in CPU_MEMORY
    ]
    held = peak = 0
    for _, change in sorted(records, key=lambda record: record[0]):
        held += change
        peak = max(peak, held)
    return result, peak


class OperationRecorder(TorchDispatchMode):  # type: ignore[misc,no-untyped-call]
    """Every ATen operation a call runs, below autograd, with its inputs' shapes and dtypes: two
    calls that record the same list do the same work."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.operations: list[tuple[str, tuple[Any, ...]]] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        shapes = tuple(
            (tuple(arg.shape), arg.dtype) for arg in args if isinstance(arg, torch.Tensor)
        )
        self.operations.append((str(func), shapes))
        return func(*args, **(kwargs or {}))
