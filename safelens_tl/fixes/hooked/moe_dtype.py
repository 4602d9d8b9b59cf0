"""HookedTransformer's mixture-of-experts layers built in the model's dtype (Mixtral, OLMoE).

TransformerLens's ``MoE`` (TransformerLens 2.x and 3.x) builds its router and its experts'
matrices as ``nn.Linear`` in torch's default dtype, whatever ``cfg.dtype`` says, and loading a
checkpoint copies the weights into those float32 parameters. So
``HookedTransformer.from_pretrained(..., dtype=torch.bfloat16)`` of Mixtral or OLMoE gives a model
whose experts are float32 while everything else is bfloat16, and its first forward fails, cached
or not: ``RuntimeError: expected m1 and m2 to have the same dtype, but got: c10::BFloat16 !=
float``. Hugging Face keeps the router and experts in the model's dtype.

The fix: once ``MoE.__init__`` has built the layer, its parameters are cast to ``cfg.dtype``
(on their device), so weights are loaded into parameters of the right dtype. GPT-OSS's own MoE
class builds in ``cfg.dtype`` already and is not touched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from safelens_tl import targets
from safelens_tl.fixes.hooked._layer_classes import builds, wrapping_init
from safelens_tl.kv.entry import resolve_dtype
from safelens_tl.registry import Fix, frozen


def in_model_dtype(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``MoE.__init__`` so that the layer's parameters end in ``cfg.dtype``."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        dtype = resolve_dtype(getattr(self.cfg, "dtype", None))
        if any(p.is_floating_point() and p.dtype != dtype for p in self.parameters()):
            self.to(dtype=dtype)

    return __init__


_applies = builds(targets.HOOKED_MOE_CLASS)
_patches = wrapping_init(targets.HOOKED_MOE_CLASS, in_model_dtype)


FIX = Fix(
    id="hooked_moe_dtype",
    symptom="HookedTransformer Mixtral or OLMoE loaded in bfloat16 fails with a dtype mismatch",
    affects=frozen({"transformer-lens": ">=2.0,<4"}),
    remedy="mixture-of-experts layers are built in cfg.dtype",
    applies=_applies,
    patches=_patches,
    test_module="tests/test_hooked_moe_dtype.py",
    changes=("conversion",),
)
