"""Cached fp16/bf16 generation with TransformerLens, made safe by safelens-tl.

TransformerLens 2.x/3.x (``HookedTransformer``); on 4.x it says so and exits. Runs offline: it
builds a tiny Llama-like model with random weights (swap in
``HookedTransformer.from_pretrained("gpt2")`` for a real one). On TransformerLens 3.0.0 the same
code without safelens-tl fails with "expected scalar type Float but found Half".
"""

import sys

import torch

try:
    from transformer_lens import HookedTransformer  # noqa: F401  (TransformerLens 2.x/3.x)
except ImportError:
    print(
        "examples/fp16_generate.py is for TransformerLens 2.x/3.x (HookedTransformer); on 4.x, "
        "fp16 and bf16 generation through TransformerBridge: examples/transformer_bridge.py."
    )
    sys.exit(0)

import safelens_tl.patch  # noqa: F401  (activates; not needed once auto-activation is installed)
from safelens_tl.verify.models import build_model

for dtype in (torch.float16, torch.bfloat16):
    # model.to(dtype) keeps cfg.dtype in step with the weights; model.half() does not.
    model = build_model("llama-like-gqa", dtype)
    text = model.generate(
        ["the cat runs", "a big old dog sleeps in the house"],
        max_new_tokens=8,
        use_past_kv_cache=True,
        do_sample=False,
        padding_side="left",
        verbose=False,
    )
    print(dtype, text)
