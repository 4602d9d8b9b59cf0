"""State-space mixers of TransformerBridge get the attention mask of the positions they run.

At every cached step, ``TransformerBridge.generate`` (TransformerLens 3.x/4.x) passes the whole
running attention mask, one column per position so far, while the model runs only the newest
position. Hugging Face's Mamba and FalconMamba hand that mask to their mixers as they get it, and
the mixers multiply their input by it: ``hidden_states * attention_mask[:, :, None]`` with one
position of input and a mask of every position broadcasts to ``[batch, positions, d_model]``.
Hugging Face's own ``generate`` never shows this, because it drops the mask at cached steps of
these models (their ``prepare_inputs_for_generation``). So through TransformerBridge a batch of
prompts (a single prompt gets no mask) was silently wrong at every step after the first, with any
transformers release. Mamba-2 and the hybrid models (Bamba, Jamba, NemotronH, ...) are not
affected: their own ``forward`` trims the mask, or drops it at cached steps, before their mixers
see it.

The mixer bridge's ``forward`` here keeps the mask's last columns, one per position of its input,
the rule Mamba-2's own ``forward`` applies (transformers' ``create_recurrent_attention_mask``):
those are the positions being run (prompts are left-padded and generated tokens are always
attended). A mask as long as the input, or none, passes unchanged.

The same wrapper keeps the mixers' opt-in eager scan (``eager_scan=True``) to calls without a
cache where transformers passes the cache as ``cache`` (5.24 on): one patch per method.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from safelens_tl import targets
from safelens_tl.fixes.bridge import cache as bridge_cache
from safelens_tl.registry import Context, Fix, Wrap, frozen

#: The keyword the Hugging Face mixers take the mask under.
MASK_ARGUMENT = "attention_mask"


def _input_positions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    hidden_states = args[0] if args else kwargs.get("hidden_states")
    if isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 3:
        return int(hidden_states.shape[1])
    return None


def trim_mask(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Cut a mask longer than the input to the input's positions (its last columns), in the
    call's own ``kwargs``."""
    mask = kwargs.get(MASK_ARGUMENT)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        positions = _input_positions(args, kwargs)
        if positions is not None and mask.shape[1] > positions:
            kwargs[MASK_ARGUMENT] = mask[:, -positions:]


def adapting_mixer_forward(
    original: Callable[..., Any], trims_mask: bool, keeps_eager_scan_uncached: bool
) -> Callable[..., Any]:
    """Wrap a state-space mixer bridge's ``forward``, once for both adaptations it may need.

    ``trims_mask``: :func:`trim_mask`. ``keeps_eager_scan_uncached``: a call that carries a cache
    under the name transformers 5.24 uses runs with the opt-in eager scan off
    (:func:`safelens_tl.fixes.bridge.cache.eager_scan_would_miss_the_cache`).
    """

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if trims_mask:
            trim_mask(args, kwargs)
        if keeps_eager_scan_uncached and bridge_cache.eager_scan_would_miss_the_cache(self, kwargs):
            # TransformerLens decides on this flag and the arguments alone, with no other way
            # in: it is off for this call only. (Another thread running the same module at this
            # moment would take the Hugging Face mixer too: the same outputs, without the
            # eager-scan hooks.)
            self.eager_scan = False
            try:
                return original(self, *args, **kwargs)
            finally:
                self.eager_scan = True
        return original(self, *args, **kwargs)

    return forward


def trimming_mask_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a state-space mixer bridge's ``forward``: a mask longer than the input is cut to the
    input's positions (its last columns)."""
    return adapting_mixer_forward(original, trims_mask=True, keeps_eager_scan_uncached=False)


def _mixers(context: Context) -> tuple[list[type], tuple[type, ...]]:
    """Every mixer to adapt, and those whose eager scan is kept to calls without a cache (where
    transformers passes it as ``cache``)."""
    bridge = context.bridge
    renamed = bridge_cache.attention_cache_argument() == bridge_cache.NEW_NAME
    eager = bridge.eager_scan_mixers if renamed else ()
    return list(dict.fromkeys((*bridge.state_space_mixers, *eager))), eager


def _applies(context: Context) -> tuple[bool, str]:
    if not _mixers(context)[0]:
        return False, "this release has no state-space mixer bridge to adapt"
    return True, "state-space mixers get the whole running mask"


def _patches(context: Context) -> list[Wrap]:
    mixers, eager = _mixers(context)
    # One wrapper of the original for whichever adaptations apply: one patch per method.
    return [
        Wrap(
            mixer,
            "forward",
            functools.partial(
                adapting_mixer_forward,
                trims_mask=mixer in context.bridge.state_space_mixers,
                keeps_eager_scan_uncached=mixer in eager,
            ),
            "state-space mixers",
            "its cached generation may be wrong (for a batch of prompts, or with eager_scan=True)",
        )
        for mixer in mixers
    ]


FIX = Fix(
    id="bridge_state_mask",
    symptom="cached TransformerBridge.generate silently wrong on Mamba and FalconMamba for a "
    "batch of prompts (a single prompt too with transformers 5.24)",
    affects=frozen({"transformer-lens": ">=3.0,<5"}),
    remedy="state-space mixers get the mask of the positions they run",
    applies=_applies,
    patches=_patches,
    test_module="tests/test_bridge_state_mask.py",
    changes=("forward",),
    when_imported=(targets.BRIDGE_MODULE,),
)
