"""The replacement ``init_cache_entry`` and ``append`` of TransformerLens's KV-cache entry.

Policy, per append: the stored past and the returned tensors take the dtype and device of the keys
just computed (values follow keys); input is validated before anything changes. How the step is
stored depends on size: a small cache (:class:`~safelens_tl.kv.storage.SmallCache`, up to
:data:`~safelens_tl.kv.storage.SMALL_CACHE_BYTES` per tensor) is appended with ``torch.cat`` as
stock does, since at that size one ``cat`` is cheaper than an in-place write; a larger one lives
in a :class:`~safelens_tl.kv.storage.KVStorage` buffer, written in place (amortized O(1)). Where
autograd or ``frozen`` need a fresh tensor, ``torch.cat`` is used at any size.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from safelens_tl.kv import storage as kv_storage

# safelens-tl's own attributes of an entry (left out of its pickle; see getstate):
# _safelens_small (SmallCache or None), _safelens_storage (KVStorage or None), _safelens_n_ctx
# (the model's n_ctx, caps growth) and _safelens_layer (for error messages). They are read and set
# as attributes, never through the entry's __dict__: on Python 3.11 reading ``__dict__`` turns the
# instance's inline attribute values into a dict, after which every attribute access on that
# entry (TransformerLens's own too) costs about twenty times more: 300 instructions, not 15.
_PREFIX = "_safelens_"


#: ``cfg.dtype`` values already resolved: ``init_cache_entry`` runs once per layer per
#: ``generate``, where resolving anew costs a visible share of a short generation.
_RESOLVED_DTYPES: dict[object, torch.dtype] = {}


def resolve_dtype(value: object) -> torch.dtype:
    """Turn ``cfg.dtype`` (a ``torch.dtype`` or a name like ``"float16"``) into a floating dtype.

    ``None`` means float32, TransformerLens's own default; the global default dtype is never used,
    because it is what broke TransformerLens 3.0.0.
    """
    try:
        resolved = _RESOLVED_DTYPES.get(value)
    except TypeError:  # unhashable: never a valid dtype, and the message below says so
        resolved = None
    if resolved is not None:
        return resolved
    if value is None:
        return torch.float32
    candidate = value
    if isinstance(value, str):
        candidate = getattr(torch, value.strip().removeprefix("torch."), None)
    if isinstance(candidate, torch.dtype) and candidate.is_floating_point:
        if len(_RESOLVED_DTYPES) < 64:  # names are few; bound it anyway
            _RESOLVED_DTYPES[value] = candidate
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


def _missing_cfg_fields(cfg: Any) -> ValueError:
    missing = [name for name in ("n_heads", "d_head") if getattr(cfg, name, None) is None]
    return ValueError(
        f"init_cache_entry needs a config with n_heads and d_head; {type(cfg).__name__} "
        f"lacks {', '.join(missing)}. Pass the model's cfg (model.cfg)."
    )


def init_cache_entry(cls: type, cfg: Any, device: Any, batch_size: int = 1) -> Any:
    """Return an empty entry ``[batch, 0, kv_heads, d_head]`` in ``cfg.dtype`` on ``device``."""
    d_head = getattr(cfg, "d_head", None)
    if d_head is None or getattr(cfg, "n_heads", None) is None:
        raise _missing_cfg_fields(cfg)
    shape = (batch_size, 0, key_value_heads(cfg), int(d_head))
    dtype = resolve_dtype(getattr(cfg, "dtype", None))
    past_keys = torch.empty(shape, dtype=dtype, device=device)
    past_values = torch.empty(shape, dtype=dtype, device=device)
    entry = cls(past_keys=past_keys, past_values=past_values)
    n_ctx = getattr(cfg, "n_ctx", None)
    entry._safelens_n_ctx = n_ctx if isinstance(n_ctx, int) else None
    # An empty small cache: the first write (the prompt) then takes the per-token path, and
    # _first_write decides where it is kept.
    entry._safelens_small = kv_storage.SmallCache(past_keys, past_values, 0, 0, None, dtype)
    entry._safelens_storage = None
    return entry


def _where(entry: Any) -> str:
    layer = getattr(entry, "_safelens_layer", None)
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


def _plainly_valid(past_keys: Any, past_values: Any, new_keys: Any, new_values: Any) -> bool:
    """Whether :func:`_validate` would accept this input, answered quickly for the common case.

    ``True`` only for input ``_validate`` accepts (exact tensors, 4-dim, floating, agreeing
    shapes, no meta mismatch on a non-empty past); ``False`` means "ask ``_validate``", which
    either accepts or raises the error that says what is wrong. Run once per layer per
    ``generate`` (the prompt's write), where the full checks cost as much as the write itself.
    """
    tensor = torch.Tensor
    if not (
        type(new_keys) is tensor
        and type(new_values) is tensor
        and type(past_keys) is tensor
        and type(past_values) is tensor
    ):
        return False
    key_shape, value_shape = new_keys.shape, new_values.shape
    past_key_shape, past_value_shape = past_keys.shape, past_values.shape
    if not (
        len(key_shape) == len(value_shape) == len(past_key_shape) == len(past_value_shape) == 4
    ):
        return False
    batch, positions, _, _ = key_shape
    cached = past_key_shape[1]
    return (
        new_keys.dtype.is_floating_point
        and new_values.dtype.is_floating_point
        and value_shape[0] == batch
        and value_shape[1] == positions
        and past_key_shape[0] == batch
        and past_key_shape[2] == key_shape[2]
        and past_key_shape[3] == key_shape[3]
        and past_value_shape[0] == batch
        and past_value_shape[2] == value_shape[2]
        and past_value_shape[3] == value_shape[3]
        and past_value_shape[1] == cached
        and (
            cached == 0
            or (past_keys.is_meta == new_keys.is_meta and past_values.is_meta == new_values.is_meta)
        )
    )


def _concat(past: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    if past.shape[1] == 0:
        # An empty past adds nothing but may sit on meta or in another dtype; clone() copies
        # like cat would (contiguous), with the same (identity) gradient.
        return new.clone(memory_format=torch.contiguous_format)
    return torch.cat((past.to(device=new.device, dtype=new.dtype), new), 1)


def append(
    self: Any, new_keys: torch.Tensor, new_values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Append one step's keys and values; return the full keys and values to attend over."""
    try:
        small: kv_storage.SmallCache | None = self._safelens_small
    except AttributeError:  # not made by init_cache_entry, nor appended to since activation
        return _append_checked(self, None, new_keys, new_values)
    if small is not None:
        # A small cache (every step of a short generation): stock's torch.cat, checked as cheaply
        # as torch allows (each check here costs a visible share of a step on a small model).
        keys, values, dtype = small.keys, small.values, small.dtype
        first_write = False
        try:
            if (
                self.past_keys is keys
                and self.past_values is values
                and new_keys.dtype is dtype
                and new_values.dtype is dtype
            ):
                keys = torch.cat((keys, new_keys), 1)
                values = torch.cat((values, new_values), 1)
                # Sizes after the fact: more positions than before, within the limit, as many
                # for values as for keys. Otherwise these results are dropped unseen.
                nbytes = keys.nbytes
                if values.nbytes == nbytes:
                    if small.nbytes < nbytes <= small.max_bytes:
                        if not self.frozen:
                            small.keys, small.values, small.nbytes = keys, values, nbytes
                            self.past_keys, self.past_values = keys, values
                        return keys, values
                    # Nothing cached yet: the prompt's write to an entry from init_cache_entry.
                    first_write = not small.nbytes and nbytes > 0
        except (AttributeError, RuntimeError):
            # Not tensors, or batch, heads, d_head or device disagree (torch.cat refuses tensors
            # on different devices, meta included): the checked path moves or says what is wrong.
            pass
        if first_write:
            return _first_write(self, small, keys, values, nbytes, new_keys, new_values)
        return _append_checked(self, None, new_keys, new_values)
    storage: kv_storage.KVStorage | None = getattr(self, "_safelens_storage", None)
    # Per-token fast path (every step of generate): try_append accepts only a plain step that the
    # full path below would also write in place, and changes nothing when it refuses.
    if (
        storage is not None
        and not torch.is_grad_enabled()
        and not self.frozen
        and storage.try_append(self, new_keys, new_values)
    ):
        keys, values = storage.keys_view, storage.values_view
        self.past_keys, self.past_values = keys, values
        return keys, values
    return _append_checked(self, storage, new_keys, new_values)


def _first_write(
    self: Any,
    small: kv_storage.SmallCache,
    keys: torch.Tensor,
    values: torch.Tensor,
    nbytes: int,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first write (the prompt) to an entry from ``init_cache_entry``, already appended.

    ``keys``/``values`` are the empty past ``torch.cat`` with the new step, which the per-token
    checks accepted; ``nbytes`` is the size of each. Kept as a small cache when the limit in force
    now allows it, unfrozen and outside grad mode; anything else is left to
    :func:`_append_checked`, which decides as for any first write. Spares the prompt's write the
    full checks, which cost more than the write.
    """
    limit = kv_storage.small_cache_bytes()
    if nbytes <= limit and not self.frozen and not torch.is_grad_enabled():
        small.keys, small.values, small.nbytes, small.max_bytes = keys, values, nbytes, limit
        small.planned = kv_storage.plan_for_first_write(keys.shape[1])
        self.past_keys, self.past_values = keys, values
        return keys, values
    return _append_checked(self, None, new_keys, new_values)


def _append_checked(
    self: Any,
    storage: kv_storage.KVStorage | None,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The full append: validation, copy-on-write, dtype and device policy, growth."""
    # Before this function holds any reference to the views: is an earlier view still held
    # elsewhere? Then this step is written to a new buffer (copy-on-write; see kv_storage).
    private = storage is not None and not storage.shared_outside(self)
    past_keys, past_values = self.past_keys, self.past_values
    if not _plainly_valid(past_keys, past_values, new_keys, new_values):
        _validate(self, past_keys, past_values, new_keys, new_values)
    if new_values.dtype != new_keys.dtype or new_values.device != new_keys.device:
        new_values = new_values.to(device=new_keys.device, dtype=new_keys.dtype)

    # In grad mode an in-place write would bump the version counter of views autograd may have
    # saved; frozen entries must not touch storage. Both take stock's path: a fresh torch.cat.
    if self.frozen or torch.is_grad_enabled():
        keys, values = _concat(past_keys, new_keys), _concat(past_values, new_values)
        if not self.frozen:
            self._safelens_storage = self._safelens_small = None
            self.past_keys, self.past_values = keys, values
        return keys, values

    ours = storage is not None and storage.backs(past_keys, past_values)
    if storage is not None and ours and private and storage.can_write(new_keys, new_values):
        storage.write(new_keys, new_values)
        self.past_keys, self.past_values = storage.keys_view, storage.values_view
        return storage.keys_view, storage.values_view

    # A plan (reserve_ahead) is kept only while the past is still ours: a reassigned past
    # (truncation, beam search) grows by the usual 25% instead.
    small: kv_storage.SmallCache | None = getattr(self, "_safelens_small", None)
    planned = None
    if storage is not None and ours:
        planned = storage.planned
    elif small is not None and past_keys is small.keys and past_values is small.values:
        planned = small.planned
    cached = past_keys.shape[1]
    length = cached + new_keys.shape[1]
    limit = kv_storage.small_cache_bytes()
    if length <= kv_storage.small_cache_positions(new_keys, limit):
        keys, values = _concat(past_keys, new_keys), _concat(past_values, new_values)
        if planned is None and cached == 0:  # the first write (the prompt) starts the plan
            planned = kv_storage.plan_for_first_write(length)
        self._safelens_storage = None
        self._safelens_small = kv_storage.SmallCache(
            keys, values, keys.nbytes, limit, planned, keys.dtype
        )
        self.past_keys, self.past_values = keys, values
        return keys, values
    n_ctx = getattr(self, "_safelens_n_ctx", None)
    storage = kv_storage.allocate(past_keys, past_values, new_keys, new_values, n_ctx, planned)
    self._safelens_small, self._safelens_storage = None, storage
    self.past_keys, self.past_values = storage.keys_view, storage.values_view
    return storage.keys_view, storage.values_view


def getstate(self: Any) -> dict[str, Any]:
    """What ``pickle`` and ``copy.deepcopy`` store of an entry: exactly what stock would.

    ``past_keys``/``past_values`` become plain contiguous tensors of exactly the cached length
    (not views of a larger buffer, whose whole storage pickle would write), and safelens-tl's own
    attributes are left out, so the pickle loads where safelens-tl is not installed.
    """
    state = {k: v for k, v in vars(self).items() if not k.startswith(_PREFIX)}
    storage: kv_storage.KVStorage | None = getattr(self, "_safelens_storage", None)
    if storage is not None and storage.backs(state.get("past_keys"), state.get("past_values")):
        state["past_keys"] = storage.keys_view.clone(memory_format=torch.contiguous_format)
        state["past_values"] = storage.values_view.clone(memory_format=torch.contiguous_format)
    return state


def label_layers(cache: Any) -> None:
    """Record each entry's layer index so that errors can name the layer."""
    for index, entry in enumerate(getattr(cache, "entries", ())):
        entry._safelens_layer = index


def append_attention_mask(self: Any, attention_mask: torch.Tensor) -> torch.Tensor:
    """Extend the cached attention mask, on the device of the mask just computed.

    Stock moves the new mask to the cache's device, which fails later when the cache was created
    on a stale device; here the past mask follows the computation instead.
    """
    previous = self.previous_attention_mask
    try:
        # torch.cat refuses masks on different devices (meta included); only then is the past
        # moved. Trying first spares every step two device lookups.
        updated = torch.cat((previous, attention_mask), -1)
    except RuntimeError:
        if previous.device == attention_mask.device:
            raise  # not a device mismatch: torch's own error says what is wrong
        if previous.numel() == 0:
            # Empty tensors on meta cannot be copied anywhere: allocate a new one.
            previous = torch.empty(
                previous.shape, dtype=previous.dtype, device=attention_mask.device
            )
        else:
            previous = previous.to(attention_mask.device)
        updated = torch.cat((previous, attention_mask), -1)
    if not self.frozen:
        self.previous_attention_mask = updated
    return updated


def labelling_init_cache(original: classmethod[Any, Any, Any]) -> classmethod[Any, Any, Any]:
    """Wrap the cache's ``init_cache`` so each entry knows its layer (for error messages)."""
    function = original.__func__

    @functools.wraps(function)
    def init_cache(cls: type, *args: Any, **kwargs: Any) -> Any:
        cache = function(cls, *args, **kwargs)
        label_layers(cache)
        return cache

    return classmethod(init_cache)
