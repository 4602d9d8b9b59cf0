"""Checks on the installed release's KV-cache classes themselves, without a model.

These run on every release, and are all that can be checked of the cache on TransformerLens 4.x,
which has no ``HookedTransformer`` to generate with. The real classes are used: a real config of
the release, ``init_cache`` and ``append`` as attention calls them.
"""

from __future__ import annotations

from typing import Any

import torch

from safelens_tl.kv import storage as kv_storage

#: A grouped-query shape: 4 query heads share 2 key/value heads.
N_HEADS, N_KEY_VALUE_HEADS, D_HEAD, N_LAYERS, BATCH = 4, 2, 16, 2, 2
#: Positions appended per call: a prompt of 5, then one token at a time, as ``generate`` does, up
#: to 72 positions.
STEPS = (5, *(1,) * 67)
#: Positions kept in a small cache (``torch.cat``) before the entry moves to a buffer written in
#: place, which then grows by a quarter whenever it is full: every storage path of safelens-tl's
#: cache, and the moves between them, in one run (left to the default limit of 64 KiB, a cache
#: this small would never leave the first).
SMALL_POSITIONS = 8


def _config(dtype: torch.dtype) -> Any:
    from safelens_tl import targets

    config_class = targets.locate().config_class()
    return config_class(
        d_model=N_HEADS * D_HEAD,
        d_head=D_HEAD,
        n_heads=N_HEADS,
        n_layers=N_LAYERS,
        n_ctx=64,
        act_fn="relu",
        n_key_value_heads=N_KEY_VALUE_HEADS,
        dtype=dtype,
    )


def same_device(actual: torch.device, requested: str | torch.device) -> bool:
    """Whether ``actual`` is the ``requested`` device (``"cuda"`` matches any ``cuda:N``)."""
    wanted = torch.device(requested)
    return actual.type == wanted.type and wanted.index in (None, actual.index)


@torch.inference_mode()
def cache_class_problems(dtype: torch.dtype, device: str) -> list[str]:
    """Build a real cache for a GQA config in ``dtype`` on ``device``, append, and list problems.

    Checked: the empty entry's dtype and head count, the dtype and device of what ``append``
    returns and stores, and that after every append the keys and values equal ``torch.cat`` of
    the pieces exactly (the cache moves data, it must not change it), over :data:`STEPS`.
    """
    from safelens_tl import targets

    cache_class: Any = targets.locate().cache_class
    cache = cache_class.init_cache(_config(dtype), device, BATCH)
    problems: list[str] = []
    entry = cache.entries[0]
    if entry.past_keys.dtype != dtype:
        problems.append(f"empty entry is {entry.past_keys.dtype}, config says {dtype}")
    if entry.past_keys.shape[2] != N_KEY_VALUE_HEADS:
        problems.append(
            f"empty entry has {entry.past_keys.shape[2]} heads, n_key_value_heads is "
            f"{N_KEY_VALUE_HEADS}"
        )
    generator = torch.Generator().manual_seed(0)
    keys_seen: list[torch.Tensor] = []
    values_seen: list[torch.Tensor] = []
    returned: tuple[torch.dtype, torch.dtype, torch.device] | None = None
    position_bytes = BATCH * N_KEY_VALUE_HEADS * D_HEAD * torch.finfo(dtype).bits // 8
    differs: list[int] = []
    with kv_storage.small_cache_limit(SMALL_POSITIONS * position_bytes):
        for step, length in enumerate(STEPS):
            shape = (BATCH, length, N_KEY_VALUE_HEADS, D_HEAD)
            new_keys = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
            new_values = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
            keys_seen.append(new_keys)
            values_seen.append(new_values)
            keys, values = entry.append(new_keys, new_values)
            # Every step, not only the last: a bug from any step on shows where it starts.
            expected_keys = torch.cat(keys_seen, dim=1)
            expected_values = torch.cat(values_seen, dim=1)
            if not (_equal(keys, expected_keys, dtype) and _equal(values, expected_values, dtype)):
                differs.append(step)
            returned = (keys.dtype, values.dtype, keys.device)
            # Held past the next append, they would make it copy the buffer (copy-on-write)
            # rather than write in place: the path to check.
            del keys, values
    if differs:
        problems.append(
            f"appended keys or values differ from torch.cat of the pieces from append "
            f"{differs[0] + 1} of {len(STEPS)} on ({len(differs)} appends)"
        )
    if returned is not None:
        keys_dtype, values_dtype, keys_device = returned
        if keys_dtype != dtype or values_dtype != dtype:
            problems.append(f"append returned {keys_dtype}/{values_dtype} for {dtype} keys/values")
        if not same_device(keys_device, device):
            problems.append(f"append returned keys on {keys_device}, computed on {device}")
    if entry.past_keys.shape[1] != sum(STEPS):
        problems.append(f"entry holds {entry.past_keys.shape[1]} positions, {sum(STEPS)} appended")
    return problems


def _equal(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    return got.shape == expected.shape and torch.equal(got.to(dtype), expected)
