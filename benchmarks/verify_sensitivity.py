"""The smallest bias of cached keys or values that ``verify`` fails, per model and dtype.

Each model is first checked as the verifier checks it (its allowance measured on uncached
forwards); then its past keys, or values, are scaled by 1 + x in the cache the model reads (from
the first cached step on), for x in 0.1%, 0.2%, 0.5%, 1%, 2%, 5%, 10%, and the cached runs of the
row are held to that allowance and to the least greedy agreement (:mod:`safelens_tl.verify.oracle`)
until one fails. TransformerBridge rows scale what ``AttentionBridge._update_kv_cache`` hands
attention; HookedTransformer rows what the cache entry's ``append`` returns.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/verify_sensitivity.py \\
        [--api bridge|hooked] [--model llama-like-gqa|gpt2-like|deep|FOLDER] [--dtype float16,...]
        [--layers 24]

``deep`` is a grouped-query Llama of ``--layers`` layers (24; ``tests/test_verify_rounding.py``
checks it at 12). One JSON line per model and dtype.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import safelens_tl
from safelens_tl import targets
from safelens_tl.verify import bridge, checks, models, oracle, runner

SCALES = (1.001, 1.002, 1.005, 1.01, 1.02, 1.05, 1.1)


def _scaled(
    keys: torch.Tensor, values: torch.Tensor, new: int, part: str, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale the past (all but the last ``new`` positions of dim -2) of ``part``."""
    if part == "keys":
        keys = torch.cat([keys[..., :-new, :] * scale, keys[..., -new:, :]], dim=-2)
    else:
        values = torch.cat([values[..., :-new, :] * scale, values[..., -new:, :]], dim=-2)
    return keys, values


@contextmanager
def biased(api: str, part: str, scale: float) -> Iterator[None]:
    """Within this block, the cache hands attention past ``part`` scaled by ``scale``."""
    if api == "hooked":
        owner: Any = targets.locate().entry_class
        name = "append"
        original = owner.append

        def append(self: Any, new_keys: torch.Tensor, new_values: torch.Tensor) -> Any:
            keys, values = original(self, new_keys, new_values)
            new = new_keys.shape[1]
            if keys.shape[1] > new:
                moved = _scaled(keys.transpose(1, 2), values.transpose(1, 2), new, part, scale)
                keys, values = moved[0].transpose(1, 2), moved[1].transpose(1, 2)
            return keys, values

        replacement: Callable[..., Any] = append
    else:
        owner = targets.locate_bridge().attention_class
        name = "_update_kv_cache"
        original = owner._update_kv_cache

        def update(self: Any, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
            keys, values = original(self, k, v, **kwargs)
            new = k.shape[-2]
            if keys.shape[-2] > new:
                keys, values = _scaled(keys, values, new, part, scale)
            return keys, values

        replacement = update
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


#: The ``deep`` model's depth unless ``--layers`` says otherwise.
DEEP_LAYERS = 24


def deep_llama(layers: int = DEEP_LAYERS) -> str:
    """A deep Llama with grouped-query attention (6 query, 2 key-value heads; weights of std 0.1,
    wide enough to round as a trained model), saved to a scratch folder.
    ``tests/test_verify_rounding.py`` checks it at 12 layers."""
    from transformers import LlamaConfig

    tokenizer = models.load_tokenizer()
    config = LlamaConfig(
        vocab_size=models.vocab_size(),
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return str(bridge.save_checkpoint(config, "deep-llama", tokenizer))


def measure(api: str, model: str, dtype: torch.dtype, layers: int = DEEP_LAYERS) -> dict[str, Any]:
    """The row's verdict, allowance and the smallest failing bias of keys and of values
    (``layers``: the depth of the ``deep`` model)."""
    start = time.perf_counter()
    cached_runs: Callable[[], list[tuple[float, float]]]
    if api == "hooked":
        hooked = models.build_model(model, dtype)
        row = runner.check_hooked(hooked, model)

        def cached_runs() -> list[tuple[float, float]]:
            runs = checks.teacher_forced_batches(hooked)
            return [(run.max_rel_err, run.top1_agreement) for run in runs]

    else:
        folder = deep_llama(layers) if model == "deep" else model
        if model in bridge.BRIDGE_MODELS:
            folder = str(bridge.model_folder(model))
        row = runner._bridge_check(model, dtype, "cpu", folder=folder)
        booted = bridge.boot_folder(folder, dtype)
        reference = bridge.reference_from(folder, dtype)

        def cached_runs() -> list[tuple[float, float]]:
            runs = bridge.run_batches(
                booted,
                reference,
                runner.DEFAULT_DEPTH.bridge_tokens,
                uncached_generate=False,
                hf_generate_batches=(),
            )
            return [(run.max_rel_err, run.top1_agreement) for run in runs]

    allowance = row.tolerance or 0.0
    result: dict[str, Any] = {
        "api": api,
        "model": model,
        "dtype": str(dtype).removeprefix("torch."),
        "passed": row.passed,
        "max_rel_err": row.max_rel_err,
        "order_rel_err": row.order_rel_err,
        "allowance": allowance,
        "greedy_agreement": row.greedy_agreement,
        "cached_positions": row.cached_positions,
    }
    for part in ("keys", "values"):
        result[part] = None
        for scale in SCALES:
            with biased(api, part, scale):
                runs = cached_runs()
            error = oracle.worst_error(error for error, _ in runs)
            agreement = min(agreement for _, agreement in runs)
            if not (error <= allowance and agreement >= oracle.MIN_AGREEMENT):
                result[part] = round(scale - 1, 4)
                break
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    has_hooked = targets.locate().known.has_hooked_transformer
    parser.add_argument(
        "--api", choices=("bridge", "hooked"), default="hooked" if has_hooked else "bridge"
    )
    parser.add_argument("--model", action="append", help="default: both built-in models")
    parser.add_argument("--dtype", default="float16,bfloat16")
    parser.add_argument("--layers", type=int, default=DEEP_LAYERS, help="the deep model's depth")
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error(f"--layers: expected at least 1; received {args.layers}")
    safelens_tl.activate()
    for model in args.model or sorted(models.BUILTIN_MODELS):
        for name in args.dtype.split(","):
            with runner.quietly():
                line = measure(args.api, model, getattr(torch, name.strip()), args.layers)
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
