"""TransformerBridge's call into the Hugging Face model, with arguments the model's forward reads.

TransformerLens 4.x calls the model from ``TransformersDriver.forward``; 3.x from
``TransformerBridge.forward``, which hands the model its keyword arguments as they are. Each
adaptation is a no-op unless its mismatch arrives:

- the KV cache under the name the model's ``forward`` gives it
  (:func:`safelens_tl.bridge_cache.pass_cache_by_the_models_name`);
- ``position_ids`` for a step given only as ``cache_position``, which transformers 5 models no
  longer read (:mod:`safelens_tl.bridge_positions`);
- positions of a cached step of a multimodal-rotary model (Qwen-VL) cut to the step's tokens
  (:mod:`safelens_tl.bridge_mrope_positions`);
- the image (or sound) of an uncached ``generate`` at every step, not only the prompt's
  (:mod:`safelens_tl.bridge_uncached_media`);
- on 3.0-3.7, the mask and positions of a padded batch of prompts that a patched ``generate``
  runs (:mod:`safelens_tl.bridge_generate_batch`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from safelens_tl import (
    bridge_cache,
    bridge_generate_batch,
    bridge_mrope_positions,
    bridge_positions,
    bridge_uncached_media,
)


def adapting_model_call(
    original: Callable[..., Any], model_attribute: str, keep_accepted_old_name: bool
) -> Callable[..., Any]:
    """Wrap the method that calls the model found at ``self.<model_attribute>``.

    ``keep_accepted_old_name``: see
    :func:`~safelens_tl.bridge_cache.pass_cache_by_the_models_name`.
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
            bridge_generate_batch.mask_the_step(self, args, kwargs)
        return original(self, *args, **kwargs)

    return forward
