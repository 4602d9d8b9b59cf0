"""Cached fp16/bf16 generation with TransformerLens, made safe by safelens-tl.

Runs offline: it builds a tiny GPT-2-like model with random weights (swap in
``HookedTransformer.from_pretrained("gpt2")`` for a real one). On TransformerLens 3.0.0 the same
code without safelens-tl fails with "expected scalar type Float but found Half".
"""

import torch

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
