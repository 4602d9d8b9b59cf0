"""What an uncached ``generate`` of a state-space model asks, kept on its way to ``hf_generate``.

``TransformerBridge.generate`` runs a stateful model (Mamba, Mamba-2, Bamba, Nemotron-H: those
whose config says ``is_stateful``) through its own loop only with the cache; with
``use_past_kv_cache=False`` (or an image, or embeddings) it hands the call to ``hf_generate``
with some of its arguments. TransformerLens 3.x hands on neither ``stop_at_eos`` nor
``repetition_penalty``, and 3.x and 4.3 not ``return_type``; 3.x's ``hf_generate`` also stops at
the end-of-sequence token when told ``stop_at_eos=False`` (Hugging Face's generation config keeps
its own). So, silently: ``generate(..., use_past_kv_cache=False, stop_at_eos=False)`` ends at the
first end-of-sequence token the model picks (a batch's finished rows filled with padding), where
the cached ``generate`` goes on; a repetition penalty is ignored; and ``return_type="tokens"``
of a string prompt returns a string. A frequency penalty, which Hugging Face's ``generate`` has no
equivalent of, is dropped on 3.x without a word (4.3 refuses it).

While such a model's ``generate`` runs (:func:`recording_generate_options`), what it was asked
is kept; an ``hf_generate`` called from it (:func:`honouring_generate_options`) gets whichever of
``stop_at_eos``, ``return_type`` and ``repetition_penalty`` it was not handed, and any
``hf_generate`` told ``stop_at_eos=False`` without its own ``eos_token_id`` tells Hugging Face
to stop at no token. A sampling ``generate`` with a ``freq_penalty`` is refused there, before
anything runs, as TransformerLens 4.3 refuses it (greedy ``generate`` never applies one, so it is
let through). Models that are not stateful are left alone: their ``generate`` never calls
``hf_generate``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from safelens_tl import targets
from safelens_tl.registry import Context, Fix, Wrap, frozen

#: ``generate``'s arguments that TransformerLens's fallback to ``hf_generate`` may drop.
STOP_AT_EOS, RETURN_TYPE, REPETITION_PENALTY = "stop_at_eos", "return_type", "repetition_penalty"
FREQ_PENALTY, DO_SAMPLE = "freq_penalty", "do_sample"
#: What Hugging Face's ``generate`` takes as "stop at no token" (``None`` means its config's).
NO_STOP_TOKENS: list[int] = []


@dataclass(frozen=True)
class GenerateOptions:
    """What the running ``generate`` of a stateful model was asked."""

    stop_at_eos: bool
    return_type: str | None
    repetition_penalty: float
    freq_penalty: float = 0.0
    do_sample: bool = True


_running: ContextVar[GenerateOptions | None] = ContextVar(
    "safelens_tl_stateful_generate", default=None
)


def recording_generate_options(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``TransformerBridge.generate``: while it runs on a stateful model, keep what it was
    asked, for an ``hf_generate`` it falls back to."""
    signature = inspect.signature(original)
    defaults = {
        name: signature.parameters[name].default
        for name in (STOP_AT_EOS, RETURN_TYPE, REPETITION_PENALTY, FREQ_PENALTY, DO_SAMPLE)
        if name in signature.parameters
    }

    @functools.wraps(original)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(getattr(self, "cfg", None), "is_stateful", False):
            return original(self, *args, **kwargs)
        try:
            arguments = signature.bind(self, *args, **kwargs).arguments
        except TypeError:
            return original(self, *args, **kwargs)  # the original's own error
        asked = {**defaults, **{k: v for k, v in arguments.items() if k in defaults}}
        options = GenerateOptions(
            stop_at_eos=bool(asked.get(STOP_AT_EOS, True)),
            return_type=asked.get(RETURN_TYPE, "input"),
            repetition_penalty=float(asked.get(REPETITION_PENALTY, 1.0)),
            freq_penalty=float(asked.get(FREQ_PENALTY, 0.0)),
            do_sample=bool(asked.get(DO_SAMPLE, True)),
        )
        token = _running.set(options)
        try:
            return original(self, *args, **kwargs)
        finally:
            _running.reset(token)

    return generate


def honouring_generate_options(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``TransformerBridge.hf_generate``: called from a stateful model's ``generate``, it
    gets what that ``generate`` was asked and it was not handed; told ``stop_at_eos=False``, it
    stops at no token."""
    signature = inspect.signature(original)
    extra = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    @functools.wraps(original)
    def hf_generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return original(self, *args, **kwargs)  # the original's own error
        arguments = bound.arguments
        options = _running.get()
        if options is not None:
            _refuse_a_frequency_penalty(options)
            _fill_in(arguments, options, signature, extra)
        if arguments.get(STOP_AT_EOS, True) is False and arguments.get("eos_token_id") is None:
            arguments["eos_token_id"] = NO_STOP_TOKENS
        return original(*bound.args, **bound.kwargs)

    return hf_generate


def _refuse_a_frequency_penalty(options: GenerateOptions) -> None:
    """Raise where a sampling ``generate`` asked for a frequency penalty that ``hf_generate``
    cannot apply (it would sample without it)."""
    if options.do_sample and options.freq_penalty != 0.0:
        raise NotImplementedError(
            f"generate(freq_penalty={options.freq_penalty!r}, do_sample=True) on a state-space "
            "model without the cache: TransformerBridge hands that call to hf_generate, and "
            "Hugging Face's generate has no frequency penalty, so it would sample as if "
            "freq_penalty were 0. Use use_past_kv_cache=True (the default), which applies it, "
            "or repetition_penalty, which hf_generate applies; nothing was generated."
        )


def _fill_in(
    arguments: dict[str, Any],
    options: GenerateOptions,
    signature: inspect.Signature,
    extra: str | None,
) -> None:
    """Give ``arguments`` of an ``hf_generate`` call what ``options`` says and it lacks."""
    for name, value in ((STOP_AT_EOS, options.stop_at_eos), (RETURN_TYPE, options.return_type)):
        if name in signature.parameters and name not in arguments:
            arguments[name] = value
    if options.repetition_penalty == 1.0:
        return
    if REPETITION_PENALTY in signature.parameters:
        arguments.setdefault(REPETITION_PENALTY, options.repetition_penalty)
    elif extra is not None:
        generation_kwargs = dict(arguments.get(extra, {}))
        generation_kwargs.setdefault(REPETITION_PENALTY, options.repetition_penalty)
        arguments[extra] = generation_kwargs


def _patches(context: Context) -> list[Wrap]:
    bridge = context.bridge.bridge_class
    return [
        Wrap(
            bridge,
            "generate",
            recording_generate_options,
            "generate options",
            "an uncached generate of a state-space model may drop stop_at_eos, return_type and "
            "repetition_penalty",
        ),
        Wrap(bridge, "hf_generate", honouring_generate_options),
    ]


FIX = Fix(
    id="bridge_stateful_generate",
    symptom="an uncached TransformerBridge.generate of a state-space model drops stop_at_eos, "
    "repetition_penalty and return_type",
    affects=frozen({"transformer-lens": ">=3.0,<5"}),
    remedy="the options are kept on their way to hf_generate and honoured there",
    applies=lambda context: (True, "TransformerBridge hands uncached state-space runs on"),
    patches=_patches,
    test_module="tests/test_bridge_stateful_generate.py",
    changes=("generate",),
    when_imported=(targets.BRIDGE_MODULE,),
)
