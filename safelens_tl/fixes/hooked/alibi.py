"""HookedTransformer's ALiBi bias sized to each forward (Bloom), so half precision stays exact.

TransformerLens keeps each attention layer's ALiBi bias (``attn.alibi``, ``[heads, n, n]``) at the
longest key length it has seen, and adds its *last* ``query`` rows and first ``key`` columns to
the attention scores. After a longer forward, a shorter one (the prompt and every step of a cached
generation, or any uncached forward) therefore gets the rows of later positions: the right bias
plus a constant per row, ``-(n - key) * slope``. Softmax ignores that constant in exact
arithmetic, but the scores are rounded in the model's dtype at the magnitude it adds. In float32
that costs a few units in the last place; in bfloat16 a constant of a few hundred rounds every
score to a multiple of 1 or more, and the attention pattern, the logits and the generated tokens
change with whatever ran before (measured in ``docs/reliability.md``).

The fix: before an ALiBi attention layer runs, a bias longer than this forward's keys (past plus
new) is cut to its top-left ``key x key`` block, which holds exactly the values a fresh model
computes for that length; TransformerLens then takes the rows it always takes. A bias that is
too short is left for TransformerLens to rebuild, as it does. Nothing changes for other
positional embeddings, and nothing runs for them: the hook is registered only on layers built
with ``positional_embedding_type == "alibi"`` while safelens-tl is active.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from safelens_tl import activation, targets
from safelens_tl.fixes.hooked._layer_classes import builds, wrapping_init
from safelens_tl.registry import Fix, frozen

#: TransformerLens's name for the positional embedding this fixes.
ALIBI = "alibi"
#: ``forward``'s parameters, in order, up to the ones read here (TransformerLens 2.x and 3.x).
_FORWARD_PARAMETERS = ("query_input", "key_input", "value_input", "past_kv_cache_entry")


def _argument(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if name in kwargs:
        return kwargs[name]
    index = _FORWARD_PARAMETERS.index(name)
    return args[index] if index < len(args) else None


def key_positions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """How many key positions the attention forward called with ``args``/``kwargs`` attends to:
    the cached past plus the new keys; ``None`` when the call does not show it."""
    key_input = _argument("key_input", args, kwargs)
    shape = getattr(key_input, "shape", None)
    if shape is None or len(shape) < 3:
        return None
    past = 0
    entry = _argument("past_kv_cache_entry", args, kwargs)
    if entry is not None:
        past_keys = getattr(entry, "past_keys", None)
        if past_keys is None:
            return None
        past = int(past_keys.shape[1])
    return past + int(shape[1])


def fit_alibi(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook: cut ``module.alibi`` to the key length of this call when it is longer.

    Does nothing once safelens-tl is deactivated, so the layer behaves as stock again.
    """
    bias = getattr(module, ALIBI, None)
    if bias is None or not activation.is_active():
        return
    keys = key_positions(args, kwargs)
    if keys is not None and 0 < keys < bias.shape[-1]:
        # The top-left block is create_alibi_bias(heads, keys) value for value; a view keeps
        # no more memory than TransformerLens already holds.
        module.alibi = bias[:, :keys, :keys]


def fitting_alibi(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap an attention class's ``__init__`` so that ALiBi layers get :func:`fit_alibi`."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if getattr(getattr(self, "cfg", None), "positional_embedding_type", None) == ALIBI:
            self.register_forward_pre_hook(fit_alibi, with_kwargs=True)

    return __init__


_applies = builds(targets.HOOKED_ATTENTION_CLASS)
_patches = wrapping_init(targets.HOOKED_ATTENTION_CLASS, fitting_alibi)


FIX = Fix(
    id="hooked_alibi",
    symptom="HookedTransformer Bloom (ALiBi) in float16/bfloat16 gives other logits after a "
    "longer forward",
    affects=frozen({"transformer-lens": ">=2.0,<4"}),
    remedy="each forward adds the ALiBi bias of its own length",
    applies=_applies,
    patches=_patches,
    test_module="tests/test_hooked_alibi.py",
    changes=("forward",),
)
