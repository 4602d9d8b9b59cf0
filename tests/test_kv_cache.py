"""Every rule of the patched entry, on the real entry and cache classes of the installed release."""

from __future__ import annotations

import copy
import gc
import pickle
from typing import Any

import pytest
import torch

from safelens_tl.kv import entry as kv_cache
from tests.conftest import LAYOUT, make_cfg

# Every rule holds for small caches (torch.cat) and for buffers alike.
pytestmark = pytest.mark.both_cache_modes

BATCH, HEADS, D_HEAD = 2, 4, 8


def kv(
    positions: int,
    dtype: torch.dtype = torch.float32,
    heads: int = HEADS,
    batch: int = BATCH,
    device: str = "cpu",
    requires_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random keys and values [batch, positions, heads, d_head]."""
    shape = (batch, positions, heads, D_HEAD)
    keys = torch.randn(shape, device=device).to(dtype).requires_grad_(requires_grad)
    values = torch.randn(shape, device=device).to(dtype).requires_grad_(requires_grad)
    return keys, values


def new_entry(
    entry_class: type, dtype: Any = torch.float32, heads: int | None = None, device: str = "cpu"
) -> Any:
    cfg = make_cfg(n_heads=HEADS, d_head=D_HEAD, n_key_value_heads=heads, dtype=dtype)
    return entry_class.init_cache_entry(cfg, device, BATCH)


# init_cache_entry -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        ("float16", torch.float16),
        ("torch.bfloat16", torch.bfloat16),
        (torch.float32, torch.float32),
    ],
)
def test_init_uses_cfg_dtype(
    patched: Any, entry_class: type, given: Any, expected: torch.dtype
) -> None:
    entry = new_entry(entry_class, dtype=torch.float32)
    cfg = make_cfg(n_heads=HEADS, d_head=D_HEAD)
    cfg.dtype = given  # a name is accepted as well as a dtype
    entry = entry_class.init_cache_entry(cfg, "cpu", BATCH)
    assert entry.past_keys.dtype == expected
    assert entry.past_values.dtype == expected
    assert tuple(entry.past_keys.shape) == (BATCH, 0, HEADS, D_HEAD)


def test_init_ignores_global_default_dtype(patched: Any, entry_class: type) -> None:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        entry = new_entry(entry_class, dtype=torch.float32)
    finally:
        torch.set_default_dtype(previous)
    assert entry.past_keys.dtype == torch.float32


def test_init_sizes_heads_for_grouped_query(patched: Any, entry_class: type) -> None:
    entry = new_entry(entry_class, heads=2)
    assert tuple(entry.past_keys.shape) == (BATCH, 0, 2, D_HEAD)
    assert tuple(entry.past_values.shape) == (BATCH, 0, 2, D_HEAD)


def test_init_places_on_given_device(patched: Any, entry_class: type) -> None:
    assert new_entry(entry_class, device="meta").past_keys.device.type == "meta"


def test_init_rejects_unknown_dtype_name(patched: Any, entry_class: type) -> None:
    cfg = make_cfg()
    cfg.dtype = "float17"
    with pytest.raises(ValueError, match=r"cfg\.dtype.*'float17'"):
        entry_class.init_cache_entry(cfg, "cpu", BATCH)


# append: dtype and device follow the computation ------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_append_follows_keys_dtype(patched: Any, entry_class: type, dtype: torch.dtype) -> None:
    entry = new_entry(entry_class, dtype=torch.float32)  # a stale fp32 cache, as TL 3.0.0 makes
    keys, values = kv(3, dtype)
    out_keys, out_values = entry.append(keys, values)
    assert out_keys.dtype == dtype and out_values.dtype == dtype
    assert entry.past_keys.dtype == dtype and entry.past_values.dtype == dtype
    torch.testing.assert_close(out_keys, keys, rtol=0, atol=0)


def test_non_empty_past_in_other_dtype_is_converted(patched: Any, entry_class: type) -> None:
    entry = new_entry(entry_class)
    first = kv(3, torch.float32)
    entry.append(*first)
    second = kv(2, torch.bfloat16)
    out_keys, out_values = entry.append(*second)
    expected_keys = torch.cat([first[0].to(torch.bfloat16), second[0]], dim=1)
    expected_values = torch.cat([first[1].to(torch.bfloat16), second[1]], dim=1)
    assert out_keys.dtype == torch.bfloat16
    torch.testing.assert_close(out_keys, expected_keys, rtol=0, atol=0)
    torch.testing.assert_close(out_values, expected_values, rtol=0, atol=0)


def test_values_follow_keys(patched: Any, entry_class: type) -> None:
    entry = new_entry(entry_class)
    keys, _ = kv(2, torch.float16)
    _, values = kv(2, torch.float32)
    _, out_values = entry.append(keys, values)
    assert out_values.dtype == torch.float16
    assert entry.past_values.dtype == torch.float16


def test_empty_past_on_meta_is_allocated_anew(patched: Any, entry_class: type) -> None:
    entry = new_entry(entry_class, device="meta")
    keys, values = kv(2)
    out_keys, _ = entry.append(keys, values)
    assert out_keys.device.type == "cpu"
    assert entry.past_keys.device.type == "cpu"
    torch.testing.assert_close(out_keys, keys, rtol=0, atol=0)


def test_non_empty_meta_past_is_refused_clearly(patched: Any, entry_class: type) -> None:
    entry = new_entry(entry_class, device="meta")
    entry.past_keys = torch.empty((BATCH, 3, HEADS, D_HEAD), device="meta")
    entry.past_values = torch.empty((BATCH, 3, HEADS, D_HEAD), device="meta")
    before = (entry.past_keys, entry.past_values)
    with pytest.raises(ValueError, match="meta device"):
        entry.append(*kv(1))
    assert (entry.past_keys, entry.past_values) == before


# append: validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys_shape", "values_shape", "fragment"),
    [
        ((BATCH, 1, HEADS), (BATCH, 1, HEADS), "4-dim"),
        ((BATCH, 1, HEADS + 1, D_HEAD), (BATCH, 1, HEADS + 1, D_HEAD), "heads"),
        ((BATCH, 1, HEADS, D_HEAD * 2), (BATCH, 1, HEADS, D_HEAD * 2), "d_head"),
        ((BATCH + 1, 1, HEADS, D_HEAD), (BATCH + 1, 1, HEADS, D_HEAD), "batch"),
        ((BATCH, 2, HEADS, D_HEAD), (BATCH, 1, HEADS, D_HEAD), "agree"),
    ],
)
def test_bad_shapes_raise_and_leave_entry_intact(
    patched: Any,
    cache_class: type,
    keys_shape: tuple[int, ...],
    values_shape: tuple[int, ...],
    fragment: str,
) -> None:
    cache = cache_class.init_cache(make_cfg(n_heads=HEADS, d_head=D_HEAD), "cpu", BATCH)
    entry = cache[1]
    entry.append(*kv(3))
    before_keys, before_values = entry.past_keys, entry.past_values
    snapshot = before_keys.clone()
    with pytest.raises(ValueError, match=fragment) as raised:
        entry.append(torch.randn(keys_shape), torch.randn(values_shape))
    message = str(raised.value)
    assert "layer 1" in message  # the layer is named
    assert str(tuple(keys_shape)) in message  # the received shape is named
    assert entry.past_keys is before_keys and entry.past_values is before_values
    torch.testing.assert_close(entry.past_keys, snapshot, rtol=0, atol=0)
    # and the entry still works afterwards
    out_keys, _ = entry.append(*kv(1))
    assert out_keys.shape[1] == 4


def test_non_tensor_input_is_a_type_error(patched: Any, entry_class: type) -> None:
    entry = new_entry(entry_class)
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        entry.append([1, 2, 3], torch.zeros(1))


# append: frozen, reassignment, immutability, autograd, copying ----------------------------------


def test_frozen_returns_extended_and_stores_nothing(patched: Any, entry_class: type) -> None:
    entry = new_entry(entry_class)
    first = kv(3)
    entry.append(*first)
    stored_keys = entry.past_keys
    entry.frozen = True
    second = kv(1)
    out_keys, _ = entry.append(*second)
    assert out_keys.shape[1] == 4
    torch.testing.assert_close(out_keys, torch.cat([first[0], second[0]], dim=1), rtol=0, atol=0)
    assert entry.past_keys is stored_keys and entry.past_keys.shape[1] == 3


@torch.inference_mode()
def test_reassigned_past_is_honoured(patched: Any, entry_class: type) -> None:
    entry = new_entry(entry_class)
    first = kv(5)
    returned_keys, _ = entry.append(*first)
    kept = returned_keys.clone()
    entry.past_keys = entry.past_keys[:, :2]  # truncation, as a user or beam search would do
    entry.past_values = entry.past_values[:, :2]
    second = kv(1)
    out_keys, out_values = entry.append(*second)
    torch.testing.assert_close(
        out_keys, torch.cat([first[0][:, :2], second[0]], dim=1), rtol=0, atol=0
    )
    torch.testing.assert_close(
        out_values, torch.cat([first[1][:, :2], second[1]], dim=1), rtol=0, atol=0
    )
    # writing position 2 again must not have touched the tensor returned earlier
    torch.testing.assert_close(returned_keys, kept, rtol=0, atol=0)


@torch.inference_mode()
def test_returned_tensors_never_change(patched: Any, entry_class: type) -> None:
    entry = new_entry(entry_class)
    history: list[tuple[torch.Tensor, torch.Tensor]] = []
    for step in range(40):  # long enough to grow the storage several times
        out = entry.append(*kv(1 if step else 7))
        history.append((out[0], out[0].clone()))
    for returned, snapshot in history:
        torch.testing.assert_close(returned, snapshot, rtol=0, atol=0)
    assert entry.past_keys.shape[1] == 7 + 39


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradients_equal_those_of_cat(patched: Any, entry_class: type, dtype: torch.dtype) -> None:
    steps = [kv(n, dtype, requires_grad=True) for n in (3, 1, 2)]
    weight = torch.randn((BATCH, 6, HEADS, D_HEAD), dtype=dtype)

    def loss_through(append: Any) -> list[torch.Tensor]:
        outputs = [append(keys, values) for keys, values in steps]
        total = sum(((k * weight[:, : k.shape[1]]).sum() + v.pow(2).sum()) for k, v in outputs)
        grads = torch.autograd.grad(total, [t for pair in steps for t in pair])
        return list(grads)

    entry = new_entry(entry_class, dtype=dtype)
    patched_grads = loss_through(entry.append)
    reference: dict[str, torch.Tensor] = {}

    def cat_append(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        reference["k"] = torch.cat([reference["k"], keys], 1) if "k" in reference else keys
        reference["v"] = torch.cat([reference["v"], values], 1) if "v" in reference else values
        return reference["k"], reference["v"]

    for ours, theirs in zip(patched_grads, loss_through(cat_append), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("duplicate", [copy.deepcopy, lambda e: pickle.loads(pickle.dumps(e))])
@torch.inference_mode()
def test_entry_survives_deepcopy_and_pickle(
    patched: Any, entry_class: type, duplicate: Any
) -> None:
    entry = new_entry(entry_class)
    entry.append(*kv(4))
    original_keys = entry.past_keys.clone()
    twin = duplicate(entry)
    torch.testing.assert_close(twin.past_keys, original_keys, rtol=0, atol=0)
    extra = kv(2)
    twin_keys, _ = twin.append(*extra)
    torch.testing.assert_close(twin_keys, torch.cat([original_keys, extra[0]], 1), rtol=0, atol=0)
    # the original is untouched by the twin's append, and still appends correctly itself
    torch.testing.assert_close(entry.past_keys, original_keys, rtol=0, atol=0)
    own = kv(1)
    keys, _ = entry.append(*own)
    torch.testing.assert_close(keys, torch.cat([original_keys, own[0]], 1), rtol=0, atol=0)


# the cache: stale device and attention mask -----------------------------------------------------


def test_cache_created_on_stale_device_follows_computation(patched: Any, cache_class: type) -> None:
    cfg = make_cfg(n_heads=HEADS, d_head=D_HEAD)
    cache = cache_class.init_cache(cfg, "meta", BATCH)
    assert cache[0].past_keys.device.type == "meta"
    keys, _ = cache[0].append(*kv(3))
    mask = cache.append_attention_mask(torch.ones((BATCH, 3), dtype=torch.long))
    assert keys.device.type == "cpu" and cache[0].past_keys.device.type == "cpu"
    assert mask.device.type == "cpu" and cache.previous_attention_mask.device.type == "cpu"
    assert mask.shape == (BATCH, 3)


def test_stock_fails_on_stale_device(cache_class: type) -> None:
    """Without the patch, the same cache fails: the test above is not vacuous."""
    cfg = make_cfg(n_heads=HEADS, d_head=D_HEAD)
    cache = cache_class.init_cache(cfg, "meta", BATCH)
    with pytest.raises((RuntimeError, NotImplementedError)):
        keys, _ = cache[0].append(*kv(3))
        cache.append_attention_mask(torch.ones((BATCH, 3), dtype=torch.long))
        keys.sum().item()


def test_resolve_dtype_names() -> None:
    assert kv_cache.resolve_dtype(None) == torch.float32
    assert kv_cache.resolve_dtype(" torch.float16 ") == torch.float16
    with pytest.raises(ValueError, match="received 'int'"):
        kv_cache.resolve_dtype("int")


def test_each_layer_keeps_the_device_of_its_own_computation(
    patched: Any, cache_class: type
) -> None:
    """A model split over devices computes each layer on its own device; each entry follows it.

    There is no second accelerator here, so the second "device" is ``meta`` (a real torch device
    that computes shapes only), not a mock.
    """
    cache = cache_class.init_cache(make_cfg(n_heads=HEADS, d_head=D_HEAD), "cpu", BATCH)
    for _ in range(3):
        cache[0].append(*kv(1, device="cpu"))
        cache[1].append(*kv(1, device="meta"))
    assert cache[0].past_keys.device.type == "cpu" and cache[0].past_values.device.type == "cpu"
    assert cache[1].past_keys.device.type == "meta" and cache[1].past_values.device.type == "meta"
    assert cache[0].past_keys.shape[1] == cache[1].past_keys.shape[1] == 3


def _instance_dict_made(entry: Any) -> bool:
    """Whether ``entry`` holds a real ``__dict__`` (the garbage collector then reports it)."""
    return any(type(referent) is dict for referent in gc.get_referents(entry))


def test_appends_never_turn_an_entry_s_attributes_into_a_dict(patched: Any) -> None:
    """On interpreters that keep attributes inline (CPython 3.11+), reading ``__dict__`` builds a
    real dict, after which each attribute access on the entry, TransformerLens's own included,
    costs about twenty times more. The cache must never do that, on any path."""
    probe = LAYOUT.entry_class(torch.empty(0), torch.empty(0))
    if _instance_dict_made(probe):
        pytest.skip("this interpreter keeps instance attributes in a dict anyway")
    cfg = make_cfg(n_heads=HEADS, d_head=D_HEAD, n_layers=2)
    cache = LAYOUT.cache_class.init_cache(cfg, "cpu", BATCH)
    entries = list(cache.entries)
    user_made = LAYOUT.entry_class(
        torch.empty(BATCH, 0, HEADS, D_HEAD), torch.empty(BATCH, 0, HEADS, D_HEAD)
    )
    with torch.no_grad():
        for entry in [*entries, user_made]:
            for positions in (3, 1, 1, 40):  # prompt, two steps, a chunk (past small limits)
                shape = (BATCH, positions, HEADS, D_HEAD)
                entry.append(torch.randn(shape), torch.randn(shape))
            assert not _instance_dict_made(entry)
    with pytest.raises(ValueError):  # an error names the layer; reading it builds no dict
        entries[1].append(torch.randn(BATCH, 1, HEADS + 1, D_HEAD), torch.randn(1))
    assert not _instance_dict_made(entries[1])
