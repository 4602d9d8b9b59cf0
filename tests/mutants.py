"""Cache bugs injected around the real code, for ``tests/test_verify_mutants.py``.

Each mutant wraps a real function of TransformerLens, transformers or safelens-tl (whatever is
installed there at the time, patched or stock) with ``monkeypatch``, so that cached generation is
wrong the way a real bug would make it: in one dtype only, for a padded batch only, from a late
step on, in one storage path of safelens-tl's cache only, or inside transformers' own cache layer,
which Hugging Face's ``generate`` shares. ``safelens-tl verify`` must fail every one of them, in
the dtype where the bug lives, and name the row.

``api``: ``"bridge"`` mutants act on TransformerBridge (TransformerLens 4.x; its cache is Hugging
Face's), ``"hooked"`` ones on HookedTransformer (2.x/3.x; its cache entries are safelens-tl's).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

HALF = ("float16", "bfloat16")

#: The score of the run, for the summary at the end (tests/conftest.py): api -> mutant -> caught.
RESULTS: dict[str, dict[str, bool]] = {}


@dataclass(frozen=True)
class Mutant:
    """A cache bug: what it is, where it is injected, and which rows must fail."""

    id: str
    api: str
    bug: str
    inject: Callable[[pytest.MonkeyPatch], None]
    #: Dtypes in which at least one row of the ``api`` must fail; in the others every row must
    #: pass (the bug does not live there).
    fails_in: tuple[str, ...] = HALF
    #: Models whose rows the bug reaches (``None``: any); at least one of them must fail.
    models: tuple[str, ...] | None = None


def _wrap(
    monkeypatch: pytest.MonkeyPatch,
    owner: Any,
    name: str,
    make: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> None:
    """Replace ``owner.name`` (the one installed now) with ``make(original)``."""
    original = getattr(owner, name)
    monkeypatch.setattr(owner, name, make(original))


def _in(dtypes: tuple[torch.dtype, ...]) -> Callable[[torch.Tensor], bool]:
    return lambda tensor: tensor.dtype in dtypes


_ANY = _in((torch.float32, torch.float16, torch.bfloat16))
_FP16 = _in((torch.float16,))
_BF16 = _in((torch.bfloat16,))
_HALF = _in((torch.float16, torch.bfloat16))


# --- TransformerBridge: Hugging Face's cache layer and the bridge's attention ------------------
# Bridge tensors are [batch, heads, positions, d_head]; the past is all but the last ``new``.


def _dynamic_layer() -> Any:
    return importlib.import_module("transformers.cache_utils").DynamicLayer


def _attention_bridge() -> Any:
    from safelens_tl import targets

    return targets.locate_bridge().attention_class


def _edit_past(
    where: Callable[[], Any],
    method: str,
    when: Callable[[torch.Tensor], bool],
    edit: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]],
) -> Callable[[pytest.MonkeyPatch], None]:
    """A mutant that edits the keys and values ``method`` hands to attention (``edit(keys,
    values, new)``), where ``when(keys)`` holds and some past is there."""

    def inject(monkeypatch: pytest.MonkeyPatch) -> None:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def mutated(self: Any, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
                keys, values = original(self, k, v, *args, **kwargs)
                new = k.shape[-2]
                if keys.shape[-2] > new and when(keys):
                    keys, values = edit(keys, values, new)
                return keys, values

            return mutated

        _wrap(monkeypatch, where(), method, make)

    return inject


def _past(
    tensor: torch.Tensor, new: int, change: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``tensor`` with ``change`` applied to its past positions (dim -2), the new ones kept."""
    return torch.cat([change(tensor[..., :-new, :]), tensor[..., -new:, :]], dim=-2)


def _reverse_heads(
    keys: torch.Tensor, values: torch.Tensor, new: int
) -> tuple[torch.Tensor, torch.Tensor]:
    flip = lambda past: past.flip(1)  # noqa: E731
    return _past(keys, new, flip), _past(values, new, flip)


def _scale(
    part: str, factor: float
) -> Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]:
    def edit(
        keys: torch.Tensor, values: torch.Tensor, new: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        grow = lambda past: past * factor  # noqa: E731
        if part == "keys":
            return _past(keys, new, grow), values
        return keys, _past(values, new, grow)

    return edit


def _swap_first_heads_from(
    cached: int,
) -> Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]:
    def edit(
        keys: torch.Tensor, values: torch.Tensor, new: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if keys.shape[-2] - new < cached:
            return keys, values
        order = [1, 0, *range(2, keys.shape[1])]
        swap = lambda past: past[:, order]  # noqa: E731
        return _past(keys, new, swap), _past(values, new, swap)

    return edit


def _duplicate_newest_past(
    keys: torch.Tensor, values: torch.Tensor, new: int
) -> tuple[torch.Tensor, torch.Tensor]:
    def duplicate(past: torch.Tensor) -> torch.Tensor:
        if past.shape[-2] < 2:
            return past
        return torch.cat([past[..., :-2, :], past[..., -1:, :], past[..., -1:, :]], dim=-2)

    return _past(keys, new, duplicate), _past(values, new, duplicate)


def _shift_second_row(
    keys: torch.Tensor, values: torch.Tensor, new: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if keys.shape[0] < 2:
        return keys, values

    def shift(past: torch.Tensor) -> torch.Tensor:
        rolled = past.clone()
        rolled[1] = past[1].roll(1, dims=-2)
        return rolled

    return keys, _past(values, new, shift)


def _late_values(
    cached: int, factor: float
) -> Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]:
    def edit(
        keys: torch.Tensor, values: torch.Tensor, new: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if keys.shape[-2] - new < cached:
            return keys, values
        return keys, _past(values, new, lambda past: past * factor)

    return edit


def _round_through(
    dtype: torch.dtype,
) -> Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]:
    def edit(
        keys: torch.Tensor, values: torch.Tensor, new: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rounded = lambda past: past.to(dtype).to(past.dtype)  # noqa: E731
        return _past(keys, new, rounded), _past(values, new, rounded)

    return edit


def _stored_in(dtype: torch.dtype) -> Callable[[pytest.MonkeyPatch], None]:
    """Hugging Face's cache layer stores keys and values in ``dtype`` and hands them back in the
    model's dtype: rounding in the cache alone."""

    def inject(monkeypatch: pytest.MonkeyPatch) -> None:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def update(self: Any, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
                keys, values = original(self, k, v, *args, **kwargs)
                self.keys, self.values = keys.to(dtype), values.to(dtype)
                return self.keys.to(k.dtype), self.values.to(v.dtype)

            return update

        _wrap(monkeypatch, _dynamic_layer(), "update", make)

    return inject


def _stops_storing_after(cached: int) -> Callable[[pytest.MonkeyPatch], None]:
    """Hugging Face's cache layer stops keeping new positions once it holds ``cached``: every
    later step attends to the first ``cached`` and itself (a lost append)."""

    def inject(monkeypatch: pytest.MonkeyPatch) -> None:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def update(self: Any, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
                held = self.keys.shape[-2] if getattr(self, "is_initialized", False) else 0
                if held < cached:
                    return original(self, k, v, *args, **kwargs)
                return torch.cat([self.keys, k], dim=-2), torch.cat([self.values, v], dim=-2)

            return update

        _wrap(monkeypatch, _dynamic_layer(), "update", make)

    return inject


def _rotary_off_by_one_on_cached_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama's rotary embedding gives a decoding step (one position) the next position's angles."""
    llama = importlib.import_module("transformers.models.llama.modeling_llama")

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(
            self: Any, x: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any
        ):  # type: ignore[no-untyped-def]
            if position_ids.shape[-1] == 1:
                position_ids = position_ids + 1
            return original(self, x, position_ids, *args, **kwargs)

        return forward

    _wrap(monkeypatch, llama.LlamaRotaryEmbedding, "forward", make)


def _unmask_last_pad(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` (any layout: 0/1, bool, or additive) with the last masked key of each row that
    has one made visible: a padded row's mask off by one."""
    if mask.dtype == torch.bool:
        hidden = ~mask
    elif mask.is_floating_point():
        hidden = mask < -1
    else:
        hidden = mask == 0
    last = hidden.shape[-1] - 1 - hidden.flip(-1).int().argmax(dim=-1)
    rows = hidden.any(dim=-1)
    changed = mask.clone()
    index = last.unsqueeze(-1)
    visible = torch.ones_like(index, dtype=mask.dtype) if mask.dtype == torch.bool else None
    if mask.dtype == torch.bool:
        values = torch.where(rows.unsqueeze(-1), visible, mask.gather(-1, index))  # type: ignore[arg-type]
    elif mask.is_floating_point():
        values = torch.where(
            rows.unsqueeze(-1), torch.zeros_like(index, dtype=mask.dtype), mask.gather(-1, index)
        )
    else:
        values = torch.where(
            rows.unsqueeze(-1), torch.ones_like(index, dtype=mask.dtype), mask.gather(-1, index)
        )
    changed.scatter_(-1, index, values)
    return changed


def _bridge_padded_mask_off_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a decoding step (one query), the attention mask lets a padded row see its last pad."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def apply(
            self: Any,
            attn_scores: torch.Tensor,
            attention_mask: Any,
            seq_len: int,
            q_seq_len: int | None = None,
        ):  # type: ignore[no-untyped-def]
            if attention_mask is not None and (q_seq_len or seq_len) == 1 and seq_len > 1:
                attention_mask = _unmask_last_pad(attention_mask)
            return original(self, attn_scores, attention_mask, seq_len, q_seq_len)

        return apply

    _wrap(monkeypatch, _attention_bridge(), "_apply_reconstruct_attention_mask", make)


BRIDGE_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "hf-layer-heads-reversed-in-half",
        "bridge",
        "transformers' DynamicLayer.update hands back the past heads in reverse order, in float16 "
        "and bfloat16 only (Hugging Face's own generate shares it)",
        _edit_past(_dynamic_layer, "update", _HALF, _reverse_heads),
    ),
    Mutant(
        "hf-layer-values-1pct-in-half",
        "bridge",
        "transformers' DynamicLayer.update hands back past values 1% too large, in half precision",
        _edit_past(_dynamic_layer, "update", _HALF, _scale("values", 1.01)),
    ),
    Mutant(
        "values-1pct-in-bf16",
        "bridge",
        "AttentionBridge._update_kv_cache: past values 1% too large, in bfloat16 only",
        _edit_past(_attention_bridge, "_update_kv_cache", _BF16, _scale("values", 1.01)),
        fails_in=("bfloat16",),
    ),
    Mutant(
        "keys-1pct-in-fp16",
        "bridge",
        "AttentionBridge._update_kv_cache: past keys 1% too large, in float16 only",
        _edit_past(_attention_bridge, "_update_kv_cache", _FP16, _scale("keys", 1.01)),
        fails_in=("float16",),
    ),
    Mutant(
        "heads-swapped-from-48-cached",
        "bridge",
        "AttentionBridge._update_kv_cache: the first two past heads swapped once 48 positions are "
        "cached (about the 40th generated token on)",
        _edit_past(_attention_bridge, "_update_kv_cache", _ANY, _swap_first_heads_from(48)),
    ),
    Mutant(
        "values-5pct-from-64-cached",
        "bridge",
        "AttentionBridge._update_kv_cache: past values 5% too large once 64 positions are cached "
        "(the last steps of the run only)",
        _edit_past(_attention_bridge, "_update_kv_cache", _ANY, _late_values(64, 1.05)),
    ),
    Mutant(
        "newest-past-duplicated",
        "bridge",
        "transformers' DynamicLayer.update: the newest past position written over the one before "
        "it (a duplicated position, one lost)",
        _edit_past(_dynamic_layer, "update", _ANY, _duplicate_newest_past),
    ),
    Mutant(
        "append-lost-after-48",
        "bridge",
        "transformers' DynamicLayer.update stops keeping new positions once it holds 48 (dropped "
        "positions from then on)",
        _stops_storing_after(48),
    ),
    Mutant(
        "stored-in-bf16",
        "bridge",
        "transformers' DynamicLayer.update stores keys and values in bfloat16 and hands them back "
        "in the model's dtype (the storage dtype wrong, rounding in the cache only)",
        _stored_in(torch.bfloat16),
        fails_in=("float16",),
    ),
    Mutant(
        "stored-in-fp8",
        "bridge",
        "AttentionBridge._update_kv_cache: past keys and values rounded to float8 (e5m2), in every "
        "dtype",
        _edit_past(_attention_bridge, "_update_kv_cache", _ANY, _round_through(torch.float8_e5m2)),
    ),
    Mutant(
        "second-row-shifted",
        "bridge",
        "AttentionBridge._update_kv_cache: in a batch of two, the second row's past values "
        "shifted by one position against its keys (batch > 1 only)",
        _edit_past(_attention_bridge, "_update_kv_cache", _ANY, _shift_second_row),
    ),
    Mutant(
        "rotary-off-by-one-on-cached-steps",
        "bridge",
        "Llama's rotary embedding: a decoding step gets the next position's angles",
        _rotary_off_by_one_on_cached_steps,
        models=("llama-like-gqa [bridge]",),
    ),
    Mutant(
        "padded-mask-off-by-one",
        "bridge",
        "AttentionBridge._apply_reconstruct_attention_mask: on a decoding step, a padded row sees "
        "its last pad",
        _bridge_padded_mask_off_by_one,
    ),
)


# --- HookedTransformer: safelens-tl's cache entry and storage, TransformerLens's attention ------
# Entry tensors are [batch, positions, heads, d_head]; the past is all but the last ``new``.


def _entry_class() -> Any:
    from safelens_tl import targets

    return targets.locate().entry_class


def _cache_class() -> Any:
    from safelens_tl import targets

    return targets.locate().cache_class


def _positions_last(
    edit: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]],
) -> Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]:
    """``edit`` written for [batch, heads, positions, d_head], applied to the entry's
    [batch, positions, heads, d_head]."""

    def transposed(
        keys: torch.Tensor, values: torch.Tensor, new: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = edit(keys.transpose(1, 2), values.transpose(1, 2), new)
        return keys.transpose(1, 2), values.transpose(1, 2)

    return transposed


def _edit_entry(
    when: Callable[[torch.Tensor], bool],
    edit: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]],
    only: Callable[[Any], bool] = lambda entry: True,
) -> Callable[[pytest.MonkeyPatch], None]:
    """A mutant of the cache entry's ``append`` (what attention calls): ``edit`` the keys and
    values it returns, where ``when(keys)`` and ``only(entry)`` hold and some past is there."""

    def inject(monkeypatch: pytest.MonkeyPatch) -> None:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def append(self: Any, new_keys: torch.Tensor, new_values: torch.Tensor):  # type: ignore[no-untyped-def]
                small = getattr(self, "_safelens_small", None) is not None
                keys, values = original(self, new_keys, new_values)
                new = new_keys.shape[1]
                if keys.shape[1] > new and when(keys) and only((self, small)):
                    keys, values = _positions_last(edit)(keys, values, new)
                return keys, values

            return append

        _wrap(monkeypatch, _entry_class(), "append", make)

    return inject


def _small_cache_only(state: Any) -> bool:
    _, small = state
    return bool(small)


def _growth_duplicates_newest(monkeypatch: pytest.MonkeyPatch) -> None:
    """safelens-tl's storage, whenever it moves a cache into a new buffer (from the small cache,
    or growing one): the newest past position is copied over the one before it."""
    from safelens_tl.kv import storage

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def buffer_with(past: torch.Tensor, new: torch.Tensor, capacity: int) -> torch.Tensor:
            if past.shape[1] >= 2:
                past = torch.cat([past[:, :-2], past[:, -1:], past[:, -1:]], dim=1)
            buffer: torch.Tensor = original(past, new, capacity)
            return buffer

        return buffer_with

    _wrap(monkeypatch, storage, "_buffer_with", make)


def _buffer_writes_through(dtype: torch.dtype) -> Callable[[pytest.MonkeyPatch], None]:
    """safelens-tl's in-place buffer rounds each position it writes through ``dtype``."""

    def inject(monkeypatch: pytest.MonkeyPatch) -> None:
        from safelens_tl.kv import storage

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def write(
                self: Any,
                new_keys: torch.Tensor,
                new_values: torch.Tensor,
                positions: int,
                stop: int,
            ) -> None:
                rounded_keys = new_keys.to(dtype).to(new_keys.dtype)
                rounded_values = new_values.to(dtype).to(new_values.dtype)
                original(self, rounded_keys, rounded_values, positions, stop)

            return write

        _wrap(monkeypatch, storage.KVStorage, "_write_unchecked", make)

    return inject


def _buffers_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """safelens-tl's storage allocates its buffers in float32 whatever the model's dtype (the
    original bug of TransformerLens 3.0.0, in the buffer path)."""
    from safelens_tl.kv import storage

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def buffer_with(past: torch.Tensor, new: torch.Tensor, capacity: int) -> torch.Tensor:
            buffer: torch.Tensor = original(past.float(), new.float(), capacity)
            return buffer

        return buffer_with

    _wrap(monkeypatch, storage, "_buffer_with", make)


def _hooked_rotary_off_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """TransformerLens's rotary: a cached step's queries get the next position's angles."""
    from transformer_lens.components.abstract_attention import AbstractAttention

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def apply_rotary(
            self: Any, x: torch.Tensor, past_kv_pos_offset: int = 0, attention_mask: Any = None
        ) -> torch.Tensor:
            if past_kv_pos_offset > 0:
                if attention_mask is not None:
                    attention_mask = torch.cat([attention_mask, attention_mask[:, -1:]], dim=1)
                result: torch.Tensor = original(self, x, past_kv_pos_offset + 1, attention_mask)
                return result
            result = original(self, x, past_kv_pos_offset, attention_mask)
            return result

        return apply_rotary

    _wrap(monkeypatch, AbstractAttention, "apply_rotary", make)


def _hooked_padded_mask_off_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache's attention mask, on a decoding step, lets a padded row see its last pad."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def append_attention_mask(self: Any, attention_mask: torch.Tensor) -> torch.Tensor:
            updated: torch.Tensor = original(self, attention_mask)
            if attention_mask.shape[-1] == 1 and updated.shape[-1] > 1:
                return _unmask_last_pad(updated)
            return updated

        return append_attention_mask

    _wrap(monkeypatch, _cache_class(), "append_attention_mask", make)


HOOKED_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "entry-heads-reversed-in-half",
        "hooked",
        "the cache entry's append hands back the past heads in reverse order, in float16 and "
        "bfloat16 only",
        _edit_entry(_HALF, _reverse_heads),
    ),
    Mutant(
        "entry-values-1pct-in-bf16",
        "hooked",
        "the cache entry's append: past values 1% too large, in bfloat16 only",
        _edit_entry(_BF16, _scale("values", 1.01)),
        fails_in=("bfloat16",),
    ),
    Mutant(
        "entry-keys-1pct-in-fp16",
        "hooked",
        "the cache entry's append: past keys 1% too large, in float16 only",
        _edit_entry(_FP16, _scale("keys", 1.01)),
        fails_in=("float16",),
    ),
    Mutant(
        "entry-values-5pct-from-64-cached",
        "hooked",
        "the cache entry's append: past values 5% too large once 64 positions are cached",
        _edit_entry(_ANY, _late_values(64, 1.05)),
    ),
    Mutant(
        "entry-heads-swapped-from-48-cached",
        "hooked",
        "the cache entry's append: the first two past heads swapped once 48 positions are cached",
        _edit_entry(_ANY, _swap_first_heads_from(48)),
    ),
    Mutant(
        "small-cache-newest-duplicated",
        "hooked",
        "safelens-tl's small cache (torch.cat) only: the newest past position written over the "
        "one before it",
        _edit_entry(_ANY, _duplicate_newest_past, _small_cache_only),
    ),
    Mutant(
        "buffer-move-duplicates-newest",
        "hooked",
        "safelens-tl's storage, when it moves a cache into a new buffer (from the small cache, or "
        "growing one): the newest past position copied over the one before it",
        _growth_duplicates_newest,
    ),
    Mutant(
        "buffer-writes-through-bf16",
        "hooked",
        "safelens-tl's in-place buffer rounds what it writes through bfloat16 (the buffer path "
        "only; rounding in the cache only)",
        _buffer_writes_through(torch.bfloat16),
        fails_in=("float16",),
    ),
    Mutant(
        "buffers-in-float32",
        "hooked",
        "safelens-tl's storage allocates its buffers in float32 whatever the model's dtype",
        _buffers_in_float32,
    ),
    Mutant(
        "entry-second-row-shifted",
        "hooked",
        "the cache entry's append: in a batch of two, the second row's past values shifted by one "
        "position against its keys (batch > 1 only)",
        _edit_entry(_ANY, _shift_second_row),
    ),
    Mutant(
        "rotary-off-by-one-on-cached-steps",
        "hooked",
        "TransformerLens's apply_rotary: a cached step's queries get the next position's angles",
        _hooked_rotary_off_by_one,
        models=("llama-like-gqa",),
    ),
    Mutant(
        "padded-mask-off-by-one",
        "hooked",
        "the cache's append_attention_mask: on a decoding step a padded row sees its last pad",
        _hooked_padded_mask_off_by_one,
    ),
    Mutant(
        "entry-stored-in-fp8",
        "hooked",
        "the cache entry's append: past keys and values rounded to float8 (e5m2), in every dtype",
        _edit_entry(_ANY, _round_through(torch.float8_e5m2)),
    ),
)

MUTANTS: tuple[Mutant, ...] = BRIDGE_MUTANTS + HOOKED_MUTANTS


def from_cached_positions(api: str, cached: int) -> Mutant:
    """The first two past heads swapped from the step whose cache holds ``cached`` positions on:
    in ``api``'s cache (the bridge's attention, or the cache entry's ``append``)."""
    if api == "bridge":
        inject = _edit_past(
            _attention_bridge, "_update_kv_cache", _ANY, _swap_first_heads_from(cached)
        )
    else:
        inject = _edit_entry(_ANY, _swap_first_heads_from(cached))
    return Mutant(f"heads-swapped-from-{cached}-cached", api, "a late bug", inject)
