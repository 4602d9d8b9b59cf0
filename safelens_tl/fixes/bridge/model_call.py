"""TransformerBridge's call into the Hugging Face model, with arguments the model's forward reads.

TransformerLens 4.x calls the model from ``TransformersDriver.forward``; 3.x from
``TransformerBridge.forward``, which hands the model its keyword arguments as they are. Each
adaptation is a no-op unless its mismatch arrives:

- the KV cache under the name the model's ``forward`` gives it
  (:func:`safelens_tl.fixes.bridge.cache.pass_cache_by_the_models_name`);
- ``position_ids`` for a step given only as ``cache_position``, which transformers 5 models no
  longer read (:mod:`safelens_tl.fixes.bridge._positions`);
- positions of a cached step of a multimodal-rotary model (Qwen-VL) cut to the step's tokens
  (:mod:`safelens_tl.fixes.bridge._mrope_positions`);
- the image (or sound) of an uncached ``generate`` at every step, not only the prompt's
  (:mod:`safelens_tl.fixes.bridge.uncached_media`);
- on 3.0-3.7, the mask and positions of a padded batch of prompts that a patched ``generate``
  runs (:mod:`safelens_tl.fixes.bridge.generate_batch`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from safelens_tl import targets
from safelens_tl.fixes.bridge import _mrope_positions as bridge_mrope_positions
from safelens_tl.fixes.bridge import _positions as bridge_positions
from safelens_tl.fixes.bridge import cache as bridge_cache
from safelens_tl.fixes.bridge import generate_batch as bridge_generate_batch
from safelens_tl.fixes.bridge import uncached_media as bridge_uncached_media
from safelens_tl.registry import Context, Fix, Wrap, frozen


def adapting_model_call(
    original: Callable[..., Any], model_attribute: str, keep_accepted_old_name: bool
) -> Callable[..., Any]:
    """Wrap the method that calls the model found at ``self.<model_attribute>``.

    ``keep_accepted_old_name``: see
    :func:`~safelens_tl.fixes.bridge.cache.pass_cache_by_the_models_name`.
    """

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        model = getattr(self, model_attribute, None)
        if model is not None:
            # This call's own kwargs: the caller's dict is left as it was.
            bridge_cache.pass_cache_by_the_models_name(kwargs, type(model), keep_accepted_old_name)
            bridge_positions.add_positions_from_cache_position(args, kwargs, type(model))
            bridge_mrope_positions.fit_step_positions(model)
            bridge_uncached_media.restore_media(args, kwargs)
            step = bridge_generate_batch.mask_the_step(self, args, kwargs)
            if step is not None:
                try:
                    return original(self, *args, **kwargs)
                finally:
                    bridge_generate_batch.end_of_step(step)
        return original(self, *args, **kwargs)

    return forward


def _patches(context: Context) -> list[Wrap]:
    bridge = context.bridge
    if bridge.driver_class is not None:
        owner, model_attribute, keep_old_name = bridge.driver_class, "underlying_model", False
    else:  # TransformerLens 3.x hands the model its arguments from TransformerBridge.forward
        owner, model_attribute, keep_old_name = bridge.bridge_class, "original_model", True
    wrap = functools.partial(
        adapting_model_call, model_attribute=model_attribute, keep_accepted_old_name=keep_old_name
    )
    return [
        Wrap(
            owner,
            "forward",
            wrap,
            "transformers compatibility",
            "the model may not get its cache under the name it takes, nor the positions of "
            "stateful cached steps",
        )
    ]


# One record for the call's adaptations (bridge_positions, bridge_mrope_positions, the cache's
# name, the padded batch's step mask): they share one wrapper of one method.
FIX = Fix(
    id="bridge_model_call",
    symptom="the Hugging Face model gets its cache under a name it ignores, or no positions "
    "(Bamba: every token at position 0; Qwen-VL after an image: a size error)",
    affects=frozen({"transformer-lens": ">=3.0,<5"}),
    remedy="the call into the model passes the cache under the model's name and the positions "
    "of each cached step",
    applies=lambda context: (True, "TransformerBridge calls the model with its own arguments"),
    patches=_patches,
    test_module="tests/test_bridge_model_call.py",
    changes=("forward", "cache"),
    when_imported=(targets.BRIDGE_MODULE,),
)
