"""The replacement ``init_cache_entry`` and ``append`` of TransformerLens's KV-cache entry.

Policy, per append: the stored past and the returned tensors take the dtype and device of the keys
just computed (values follow keys); input is validated before anything changes; the write itself is
delegated to :mod:`safelens_tl.kv_storage` (in place, amortized O(1)) except where autograd or
``frozen`` need a fresh tensor, where ``torch.cat`` is used exactly as stock does.
"""

from __future__ import annotations

from typing import Any

import torch

from safelens_tl import kv_storage

_STORAGE = "_safelens_storage"
_LIMIT = "_safelens_n_ctx"
_LAYER = "_safelens_layer"


def resolve_dtype(value: object) -> torch.dtype:
    """Turn ``cfg.dtype`` (a ``torch.dtype`` or a name like ``"float16"``) into a floating dtype.

    ``None`` means float32, TransformerLens's own default; the global default dtype is never used,
    because it is what broke TransformerLens 3.0.0.
    """
    if value is None:
        return torch.float32
    candidate = value
    if isinstance(value, str):
        candidate = getattr(torch, value.strip().removeprefix("torch."), None)
    if isinstance(candidate, torch.dtype) and candidate.is_floating_point:
        return candidate
    raise ValueError(
        f"cfg.dtype must be a floating torch.dtype or its name, such as 'float16' or "
        f"'torch.bfloat16'; "
        f"received {value!r}. Set cfg.dtype to the dtype the model runs in."
    )


def key_value_heads(cfg: Any) -> int:
    """Heads the cache stores: ``cfg.n_key_value_heads`` (grouped-query) or else ``cfg.n_heads``."""
    heads = getattr(cfg, "n_key_value_heads", None)
    return int(heads if heads is not None else cfg.n_heads)


def _require_cfg_fields(cfg: Any) -> None:
    missing = [name for name in ("n_heads", "d_head") if getattr(cfg, name, None) is None]
    if missing:
        raise ValueError(
            f"init_cache_entry needs a config with n_heads and d_head; {type(cfg).__name__} "
            f"lacks {', '.join(missing)}. Pass the model's cfg (model.cfg)."
        )


def init_cache_entry(cls: type, cfg: Any, device: Any, batch_size: int = 1) -> Any:
    """Return an empty entry ``[batch, 0, kv_heads, d_head]`` in ``cfg.dtype`` on ``device``."""
    _require_cfg_fields(cfg)
    shape = (batch_size, 0, key_value_heads(cfg), int(cfg.d_head))
    dtype = resolve_dtype(getattr(cfg, "dtype", None))
    entry = cls(
        past_keys=torch.empty(shape, dtype=dtype, device=device),
        past_values=torch.empty(shape, dtype=dtype, device=device),
    )
    n_ctx = getattr(cfg, "n_ctx", None)
    if isinstance(n_ctx, int):
        setattr(entry, _LIMIT, n_ctx)
    return entry


def _where(entry: Any) -> str:
    layer = entry.__dict__.get(_LAYER)
    return f"KV cache entry of layer {layer}" if layer is not None else "KV cache entry"


def _shape(tensor: torch.Tensor) -> str:
    return str(tuple(tensor.shape))


def _validate(
    entry: Any,
    past_keys: Any,
    past_values: Any,
    new_keys: Any,
    new_values: Any,
) -> None:
    """Raise a clear error for input the cache cannot take; changes nothing."""
    where = _where(entry)
    if not isinstance(new_keys, torch.Tensor) or not isinstance(new_values, torch.Tensor):
        raise TypeError(
            f"{where}: append expects torch.Tensor keys and values of shape "
            f"[batch, pos, heads, d_head]; received {type(new_keys).__name__} and "
            f"{type(new_values).__name__}"
        )
    if not isinstance(past_keys, torch.Tensor) or not isinstance(past_values, torch.Tensor):
        raise TypeError(
            f"{where}: past_keys and past_values must be torch.Tensor; they were set to "
            f"{type(past_keys).__name__} and {type(past_values).__name__}. Assign tensors of "
            f"shape [batch, pos, heads, d_head] or start a new cache."
        )
    for label, tensor in (("new keys", new_keys), ("new values", new_values)):
        if tensor.dim() != 4:
            raise ValueError(
                f"{where}: {label} must be 4-dim [batch, pos, heads, d_head]; received shape "
                f"{_shape(tensor)}"
            )
        if not tensor.is_floating_point():
            raise ValueError(
                f"{where}: {label} must be floating point; received dtype {tensor.dtype}"
            )
    if new_keys.shape[:2] != new_values.shape[:2]:
        raise ValueError(
            f"{where}: keys and values must agree on batch and pos; received keys "
            f"{_shape(new_keys)} and values {_shape(new_values)}"
        )
    for label, past, new in (("keys", past_keys, new_keys), ("values", past_values, new_values)):
        if past.dim() != 4:
            raise ValueError(
                f"{where}: the cached {label} must be 4-dim [batch, pos, heads, d_head]; they "
                f"were set to shape {_shape(past)}"
            )
        expected = (past.shape[0], past.shape[2], past.shape[3])
        received = (new.shape[0], new.shape[2], new.shape[3])
        if expected != received:
            raise ValueError(
                f"{where}: new {label} have [batch, heads, d_head] = {list(received)} (shape "
                f"{_shape(new)}) but the cache holds {list(expected)} (shape {_shape(past)}). "
                f"Check the batch size given to init_cache and cfg.n_heads / n_key_value_heads "
                f"/ d_head."
            )
        if past.size(1) and past.device.type == "meta" and new.device.type != "meta":
            raise ValueError(
                f"{where}: the cached {label} hold {past.size(1)} positions on the meta device, "
                f"which has no data to move to {new.device}; start a new cache on a real device."
            )
        if past.size(1) and past.device.type != "meta" and new.device.type == "meta":
            raise ValueError(
                f"{where}: new {label} are on the meta device (no data) but the cache holds "
                f"{past.size(1)} real positions on {past.device}, which moving to meta would "
                f"lose; compute the keys and values on {past.device}, or start a new cache."
            )
    if past_keys.size(1) != past_values.size(1):
        raise ValueError(
            f"{where}: past_keys holds {past_keys.size(1)} positions but past_values holds "
            f"{past_values.size(1)}; reassign both to the same length"
        )


def _concat(past: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    if past.size(1) == 0:
        # An empty past adds nothing but may sit on meta or in another dtype; clone() copies
        # like cat would, with the same (identity) gradient.
        return new.clone()
    return torch.cat([past.to(device=new.device, dtype=new.dtype), new], dim=1)


def append(
    self: Any, new_keys: torch.Tensor, new_values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Append one step's keys and values; return the full keys and values to attend over."""
    state = self.__dict__
    storage: kv_storage.KVStorage | None = state.get(_STORAGE)
    # Per-token fast path (every step of generate): try_append accepts only a plain step that the
    # full path below would also write in place, and changes nothing when it refuses.
    if (
        storage is not None
        and not torch.is_grad_enabled()
        and not self.frozen
        and storage.try_append(state, new_keys, new_values)
    ):
        keys, values = storage.keys_view, storage.values_view
        self.past_keys, self.past_values = keys, values
        return keys, values
    return _append_checked(self, storage, new_keys, new_values)


def _append_checked(
    self: Any,
    storage: kv_storage.KVStorage | None,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The full append: validation, copy-on-write, dtype and device policy, growth."""
    # Before this function holds any reference to the views: is an earlier view still held
    # elsewhere? Then this step is written to a new buffer (copy-on-write; see kv_storage).
    private = storage is not None and not storage.shared_outside(self.__dict__)
    past_keys, past_values = self.past_keys, self.past_values
    _validate(self, past_keys, past_values, new_keys, new_values)
    if new_values.dtype != new_keys.dtype or new_values.device != new_keys.device:
        new_values = new_values.to(device=new_keys.device, dtype=new_keys.dtype)

    # In grad mode an in-place write would bump the version counter of views autograd may have
    # saved; frozen entries must not touch storage. Both take stock's path: a fresh torch.cat.
    if self.frozen or torch.is_grad_enabled():
        keys, values = _concat(past_keys, new_keys), _concat(past_values, new_values)
        if not self.frozen:
            self.__dict__.pop(_STORAGE, None)
            self.past_keys, self.past_values = keys, values
        return keys, values

    ours = storage is not None and storage.backs(past_keys, past_values)
    if storage is not None and ours and private and storage.can_write(new_keys, new_values):
        storage.write(new_keys, new_values)
    else:
        # A plan (reserve_ahead) is kept only while the past is still ours: a reassigned past
        # (truncation, beam search) grows by the usual 25% instead.
        planned = storage.planned if storage is not None and ours else None
        storage = kv_storage.allocate(
            past_keys, past_values, new_keys, new_values, self.__dict__.get(_LIMIT), planned
        )
        self.__dict__[_STORAGE] = storage
    self.past_keys, self.past_values = storage.keys_view, storage.values_view
    return storage.keys_view, storage.values_view


def getstate(self: Any) -> dict[str, Any]:
    """What ``pickle`` and ``copy.deepcopy`` store of an entry: exactly what stock would.

    ``past_keys``/``past_values`` become plain contiguous tensors of exactly the cached length
    (not views of a larger buffer, whose whole storage pickle would write), and safelens-tl's own
    attributes are left out, so the pickle loads where safelens-tl is not installed.
    """
    state = {k: v for k, v in self.__dict__.items() if not k.startswith("_safelens_")}
    storage: kv_storage.KVStorage | None = self.__dict__.get(_STORAGE)
    if storage is not None and storage.backs(state.get("past_keys"), state.get("past_values")):
        state["past_keys"] = storage.keys_view.clone(memory_format=torch.contiguous_format)
        state["past_values"] = storage.values_view.clone(memory_format=torch.contiguous_format)
    return state


def label_layers(cache: Any) -> None:
    """Record each entry's layer index so that errors can name the layer."""
    for index, entry in enumerate(getattr(cache, "entries", ())):
        entry.__dict__[_LAYER] = index


def append_attention_mask(self: Any, attention_mask: torch.Tensor) -> torch.Tensor:
    """Extend the cached attention mask, on the device of the mask just computed.

    Stock moves the new mask to the cache's device, which fails later when the cache was created
    on a stale device; here the past mask follows the computation instead.
    """
    previous = self.previous_attention_mask
    if previous.device != attention_mask.device:
        if previous.numel() == 0:
            # Empty tensors on meta cannot be copied anywhere: allocate a new one.
            previous = torch.empty(
                previous.shape, dtype=previous.dtype, device=attention_mask.device
            )
        else:
            previous = previous.to(attention_mask.device)
    updated = torch.cat([previous, attention_mask], dim=-1)
    if not self.frozen:
        self.previous_attention_mask = updated
    return updated
