"""TransformerLens 3.9's hooked linear attention where transformers keeps its kernels elsewhere.

``GatedDeltaNetBridge`` (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) runs its own re-implementation of the
layer, with a hook at every step, whenever no state cache arrives: ``use_cache=False``, as its own
documentation asks for ``run_with_cache``, or ``hf_generate(use_cache=False)``. In TransformerLens
3.9 that code reads ``causal_conv1d_fn`` and ``chunk_gated_delta_rule`` from Hugging Face's layer,
where transformers before 5.15 stored them. Later releases (5.23 and 5.24 here) call module-level
functions of the modeling file instead, so every such forward raised ``AttributeError:
'Qwen3_5GatedDeltaNet' object has no attribute 'causal_conv1d_fn'``. TransformerLens 4.x looks in
both places and is left alone.

The first time the bridge meets a layer class without them, the class gets them, as patches that
``deactivate()`` removes:

- ``chunk_gated_delta_rule``: the modeling file's own ``torch_chunk_gated_delta_rule``, which
  Hugging Face's layer calls (and which takes a hub kernel where one is installed);
- ``causal_conv1d_fn = None``: the bridge then convolves with the layer's ``conv1d`` followed by
  SiLU, its own fallback and the computation of Hugging Face's. The modeling file's
  ``causal_conv1d_fn`` cannot stand in: TransformerLens 3.9 passes its input as ``x=``, which that
  function does not take.

An instance that has either (transformers before 5.15) keeps its own.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from safelens_tl import targets
from safelens_tl.patching import Patch
from safelens_tl.registry import Context, Fix, frozen

#: The attribute whose absence marks a transformers that moved the functions to module level.
CONVOLUTION = "causal_conv1d_fn"
CHUNKED_RULE = "chunk_gated_delta_rule"
#: What the modeling files call their chunked delta rule.
MODULE_CHUNKED_RULE = "torch_chunk_gated_delta_rule"
SOURCE = "safelens_tl.builtin_plugins.bridge"


def reads_functions_from_the_layer(hooked_forward: Any) -> bool:
    """Whether a ``GatedDeltaNetBridge._hooked_forward`` reads the convolution as an attribute of
    Hugging Face's layer (TransformerLens 3.9), rather than resolving it (4.x)."""
    code = getattr(hooked_forward, "__code__", None)
    return code is not None and CONVOLUTION in code.co_names


def layer_functions(layer_class: type) -> list[Patch]:
    """The class attributes ``layer_class`` lacks for TransformerLens 3.9's hooked forward."""
    patches = []
    if not hasattr(layer_class, CONVOLUTION):
        patches.append(Patch(layer_class, CONVOLUTION, None, plugin=SOURCE))
    chunked = getattr(sys.modules.get(layer_class.__module__), MODULE_CHUNKED_RULE, None)
    if not hasattr(layer_class, CHUNKED_RULE) and callable(chunked):
        patches.append(Patch(layer_class, CHUNKED_RULE, staticmethod(chunked), plugin=SOURCE))
    return patches


def supplying_layer_functions(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``GatedDeltaNetBridge._hooked_forward``: Hugging Face's layer class is given the two
    functions it reads (:func:`layer_functions`) before the first forward that needs them."""

    @functools.wraps(original)
    def _hooked_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        layer = getattr(self, "original_component", None)
        if layer is not None and not (hasattr(layer, CONVOLUTION) and hasattr(layer, CHUNKED_RULE)):
            from safelens_tl import activation  # at call time: activation loads this module

            activation.install_found(layer_functions(type(layer)))
        return original(self, *args, **kwargs)

    return _hooked_forward


def _applies(context: Context) -> tuple[bool, str]:
    gated_delta = context.bridge.gated_delta_net_class
    if gated_delta is None:
        return False, "this release has no GatedDeltaNetBridge"
    if not reads_functions_from_the_layer(gated_delta.__dict__.get("_hooked_forward")):
        return False, "GatedDeltaNetBridge finds transformers' kernels itself"
    return True, "GatedDeltaNetBridge reads its kernels from Hugging Face's layer"


def _patches(context: Context) -> list[Patch]:
    gated_delta = context.bridge.gated_delta_net_class
    assert gated_delta is not None  # _applies said so
    original = gated_delta.__dict__["_hooked_forward"]
    return [Patch(gated_delta, "_hooked_forward", supplying_layer_functions(original))]


FIX = Fix(
    id="bridge_gated_delta",
    symptom="Qwen3-Next and Qwen3.5 through TransformerBridge without a cache raise "
    "AttributeError (transformers 5.15+)",
    affects=frozen({"transformer-lens": ">=3.0,<4", "transformers": ">=5.15"}),
    remedy="the layer is handed the functions of its modeling file",
    applies=_applies,
    patches=_patches,
    test_module="tests/test_bridge_gated_delta.py",
    changes=("forward",),
    when_imported=(targets.BRIDGE_MODULE,),
)
