"""Your own decoding loop over TransformerLens's KV cache: bf16 under autocast, sized once.

``HookedTransformer.generate`` sizes its cache by itself. In a loop of your own, tell safelens-tl
the final length with ``kv.storage.reserve`` and each layer's cache is allocated once, with no
spare; without it the cache grows by 25% at a time. Runs offline on a tiny random model.
TransformerLens 2.x/3.x (HookedTransformer); on 4.x it says so and exits.
"""

import sys

import torch

try:
    from transformer_lens import HookedTransformer  # noqa: F401  (TransformerLens 2.x/3.x)
except ImportError:
    print(
        "examples/own_decode_loop.py is for TransformerLens 2.x/3.x (HookedTransformer); on 4.x, "
        "TransformerBridge generates through Hugging Face's caches: examples/transformer_bridge.py."
    )
    sys.exit(0)

import safelens_tl.patch  # noqa: F401  (activates; not needed once auto-activation is installed)
from safelens_tl.kv import storage as kv_storage
from safelens_tl.verify.models import build_model

try:  # TransformerLens 3.x
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache as Cache
except ImportError:  # TransformerLens 2.x
    from transformer_lens.past_key_value_caching import (  # type: ignore[no-redef]
        HookedTransformerKeyValueCache as Cache,
    )

model = build_model("gpt2-like", torch.float32)
tokens = model.to_tokens(["the cat runs to the river"])
new_tokens = 16
final_length = tokens.size(1) + new_tokens - 1  # the last token is never fed back

with (
    torch.inference_mode(),
    torch.autocast("cpu", dtype=torch.bfloat16),
    kv_storage.reserve(final_length),
):
    cache = Cache.init_cache(model.cfg, model.cfg.device, tokens.size(0))
    logits = model(tokens, past_kv_cache=cache)
    for _ in range(new_tokens - 1):
        next_token = logits[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, next_token], dim=1)
        logits = model(next_token, past_kv_cache=cache)

keys = cache.entries[0].past_keys
print(f"cache: {keys.dtype}, {keys.size(1)} positions of {final_length} reserved")
print(model.to_string(tokens[0]))
