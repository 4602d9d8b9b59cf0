"""What users can observe of a patched cache entry behaves as stock's (real TL entry classes).

Snapshots of ``past_keys`` stay independent of the live cache, gradients survive a later no-grad
append, pickles and deep copies hold plain tensors of exactly the cached length, and a plan made
by ``generate`` never holds much more than stock holds at the same moment.
"""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl.kv import storage as kv_storage
from tests.conftest import LAYOUT, make_cfg

HEADS, D_HEAD = 2, 4


def step(positions: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random keys and values ``[1, positions, HEADS, D_HEAD]``."""
    return torch.randn(1, positions, HEADS, D_HEAD), torch.randn(1, positions, HEADS, D_HEAD)


def filled(patched: bool, positions: tuple[int, ...] = (3, 1)) -> Any:
    """An entry of the installed release after appends of ``positions`` (no grad)."""
    if patched:
        safelens_tl.activate()
    else:
        safelens_tl.deactivate()
    entry = LAYOUT.entry_class.init_cache_entry(make_cfg(n_heads=HEADS, d_head=D_HEAD), "cpu", 1)
    torch.manual_seed(0)
    with torch.no_grad():
        for count in positions:
            entry.append(*step(count))
    return entry


@pytest.mark.both_cache_modes
@pytest.mark.parametrize("patched", [False, True], ids=["stock", "patched"])
def test_a_snapshot_does_not_change_when_the_live_cache_is_edited(patched: bool) -> None:
    entry = filled(patched)
    clean = entry.past_keys
    before = clean.clone()
    with torch.no_grad():
        entry.append(*step())
    entry.past_keys[:, 2] = 0  # activation patching on the live cache
    assert torch.equal(clean, before)
    assert torch.count_nonzero(entry.past_keys[:, 2]) == 0


@pytest.mark.both_cache_modes
@pytest.mark.parametrize("patched", [False, True], ids=["stock", "patched"])
def test_editing_an_old_tensor_does_not_change_the_live_cache(patched: bool) -> None:
    entry = filled(patched)
    with torch.no_grad():
        old_keys, _ = entry.append(*step())
        entry.append(*step())
    live = entry.past_keys.clone()
    old_keys[:, 0] = 0
    assert torch.equal(entry.past_keys, live)


def test_a_slice_of_a_snapshot_is_kept_apart_too(patched: Any) -> None:
    entry = filled(True)
    prefix = entry.past_values[:, :2]  # a view of the cache's buffer, not the view itself
    before = prefix.clone()
    with torch.no_grad():
        entry.append(*step())
    entry.past_values.mul_(0)
    assert torch.equal(prefix, before)


#: What a user may keep of the live cache; each shares its memory.
SNAPSHOTS = {
    "itself": lambda tensor: tensor,
    "slice": lambda tensor: tensor[:, :2],
    "detach": lambda tensor: tensor.detach(),
    "permuted": lambda tensor: tensor.permute(0, 2, 1, 3),
}


@pytest.fixture(params=[True, False], ids=["storage-count", "no-storage-count"])
def storage_count(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether torch can count the tensors on a storage (``torch._C._storage_Use_Count``).

    Taken away to stand for the CPU-only and macOS builds of torch before 2.8, which lack it;
    they cannot be installed here (PyPI's Linux wheels are CUDA builds, which have it).
    """
    if not request.param:
        monkeypatch.setattr(kv_storage, "_storage_use_count", None)
    return bool(request.param)


@pytest.mark.parametrize(
    "mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference"]
)
@pytest.mark.parametrize("snapshot", sorted(SNAPSHOTS))
@pytest.mark.parametrize("name", ["past_keys", "past_values"])
@pytest.mark.parametrize("patched", [False, True], ids=["stock", "patched"])
def test_a_snapshot_in_any_form_is_kept_apart(
    patched: bool, storage_count: bool, name: str, snapshot: str, mode: Any
) -> None:
    """Held as a slice, a ``detach()`` or a permuted view, in or out of inference mode, a snapshot
    does not change when the live cache is edited after the next append: stock's behaviour.

    The buffer has room for that append (``reserve``), so an in-place write is what would break
    this. Without torch's storage count no buffer is used at all."""
    if patched:
        safelens_tl.activate()
    entry = LAYOUT.entry_class.init_cache_entry(make_cfg(n_heads=HEADS, d_head=D_HEAD), "cpu", 1)
    torch.manual_seed(0)
    with kv_storage.reserve(16), mode():
        entry.append(*step(3))
        kept = SNAPSHOTS[snapshot](getattr(entry, name))
        before = kept.clone()
        entry.append(*step())
        getattr(entry, name).fill_(7)  # activation patching on the live cache
    assert torch.equal(kept, before)
    assert torch.count_nonzero(getattr(entry, name) - 7) == 0
    if patched:
        buffered = entry.__dict__.get("_safelens_storage") is not None
        assert buffered == storage_count


def test_nothing_held_means_writing_in_place(patched: Any) -> None:
    """The copy-on-write is only for held views: generate's appends stay in the same buffer."""
    entry = filled(True, positions=(3,))
    storage = entry.__dict__["_safelens_storage"]
    with torch.no_grad():
        for _ in range(storage.capacity - 3):
            entry.append(*step())
    assert entry.__dict__["_safelens_storage"] is storage


def test_values_in_another_dtype_are_converted_and_written_in_place(patched: Any) -> None:
    """Values follow the keys' dtype; converted, the step still goes into the buffer's room."""
    entry = filled(True, positions=(3,))
    storage = entry.__dict__["_safelens_storage"]
    past_keys, past_values = entry.past_keys.clone(), entry.past_values.clone()
    new_keys, new_values = step()
    with torch.no_grad():
        keys, values = entry.append(new_keys, new_values.to(torch.float16))
    assert entry.__dict__["_safelens_storage"] is storage
    assert torch.equal(keys, torch.cat([past_keys, new_keys], 1))
    expected_values = torch.cat([past_values, new_values.to(torch.float16).float()], 1)
    assert values.dtype == torch.float32 and torch.equal(values, expected_values)


@pytest.mark.both_cache_modes
@pytest.mark.parametrize("patched", [False, True], ids=["stock", "patched"])
def test_backward_works_after_a_no_grad_append(patched: bool) -> None:
    entry = filled(patched)
    weight = torch.randn(entry.past_keys.shape, requires_grad=True)
    loss = (entry.past_keys * weight).sum()
    with torch.no_grad():
        entry.append(*step())
    loss.backward()  # stock: fine; an in-place write would bump the saved view's version
    assert weight.grad is not None
    assert torch.equal(weight.grad, entry.past_keys[:, : weight.shape[1]])


def _pickled(patched: bool) -> bytes:
    return pickle.dumps(filled(patched, positions=(5, 1, 1)))


def test_a_pickle_is_what_stock_would_write() -> None:
    stock, patched = _pickled(False), _pickled(True)
    assert len(patched) == len(stock)
    assert b"safelens" not in patched
    loaded = pickle.loads(patched)
    assert loaded.past_keys.shape == (1, 7, HEADS, D_HEAD) and loaded.past_keys.is_contiguous()
    assert torch.equal(loaded.past_keys, pickle.loads(stock).past_keys)


@pytest.mark.both_cache_modes
@pytest.mark.parametrize("duplicate", [copy.deepcopy, copy.copy])
def test_copies_are_independent_and_exact(patched: Any, duplicate: Any) -> None:
    entry = filled(True, positions=(5, 1))
    twin = duplicate(entry)
    assert torch.equal(twin.past_keys, entry.past_keys)
    with torch.no_grad():
        twin.append(*step())
        entry.append(*step())
    assert twin.past_keys.shape[1] == entry.past_keys.shape[1] == 7
    assert not torch.equal(twin.past_keys[:, 6], entry.past_keys[:, 6])


def test_a_pickle_loads_where_safelens_tl_is_absent(tmp_path: Path) -> None:
    path = tmp_path / "entry.pkl"
    path.write_bytes(_pickled(True))
    code = textwrap.dedent(
        f"""
        import pickle, sys
        sys.modules["safelens_tl"] = None  # as if not installed: importing it fails
        entry = pickle.loads(open({str(path)!r}, "rb").read())
        print(tuple(entry.past_keys.shape), type(entry).__name__)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"SAFELENS_TL_AUTOPATCH": "0", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[:4] == ["(1,", "7,", f"{HEADS},", f"{D_HEAD})"]


@pytest.mark.parametrize("small_positions", [0, 100], ids=["buffer", "small-then-buffer"])
@pytest.mark.parametrize("ahead", [30_000, 100])
def test_a_plan_never_holds_much_more_than_stock(
    patched: Any, ahead: int, small_positions: int
) -> None:
    """``generate(max_new_tokens=30000)`` stopping after a few tokens (EOS): at each step the
    cache holds at most max(1.25 x, + PLAN_STEP positions) of what stock holds then. A small cache
    holds exactly what stock holds, and carries the plan into its buffer when it outgrows the
    small-cache limit."""
    entry = LAYOUT.entry_class.init_cache_entry(
        make_cfg(n_heads=HEADS, d_head=D_HEAD, n_ctx=100_000), "cpu", 1
    )
    capacities = []
    limit = small_positions * HEADS * D_HEAD * 4  # float32
    with torch.no_grad(), kv_storage.reserve_ahead(ahead), kv_storage.small_cache_limit(limit):
        entry.append(*step(40))  # the prompt
        for _ in range(min(ahead, 300)):
            entry.append(*step())
            length = entry.past_keys.shape[1]
            storage = entry.__dict__.get("_safelens_storage")
            assert (storage is None) == (length <= small_positions), length
            capacity = length if storage is None else storage.capacity
            assert capacity <= max(length * 5 // 4, length + kv_storage.PLAN_STEP), length
            capacities.append(capacity)
    if ahead == 100:  # a plan within reach ends exactly at the planned length
        assert capacities[-1] == 40 + 100
