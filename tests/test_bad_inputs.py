"""The bad-input catalogue: every row raises the documented error, names expected and received,
and leaves the entry exactly as it was (same tensor objects, same values, same storage).

docs/bad-inputs.md holds the same catalogue as a table; ``test_docs_table_matches_catalogue``
keeps the two in step. Regenerate the table with ``python -m tests.test_bad_inputs``.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import safelens_tl
from safelens_tl.kv import storage as kv_storage
from tests.conftest import LAYOUT, make_cfg

BATCH, CACHED, HEADS, D_HEAD = 2, 3, 4, 8
DOCS = Path(__file__).resolve().parent.parent / "docs" / "bad-inputs.md"


def kv(
    batch: int = BATCH,
    positions: int = 1,
    heads: int = HEADS,
    d_head: int = D_HEAD,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """A tensor of ones ``[batch, positions, heads, d_head]`` (or cast to an integer dtype)."""
    return torch.ones((batch, positions, heads, d_head)).to(dtype)


@dataclass(frozen=True)
class BadInput:
    """One row of the catalogue."""

    id: str
    given: str  # what the user did, for the docs table
    error: type[Exception]
    expected: str  # a part of the message naming what was expected
    received: str  # a part of the message naming what was received
    act: Callable[[Any], object]  # the bad call, given a filled entry
    prepare: Callable[[Any], None] | None = None  # a user's reassignment before the call


def _set_past(keys: object, values: object) -> Callable[[Any], None]:
    def prepare(entry: Any) -> None:
        entry.past_keys = keys
        entry.past_values = values

    return prepare


def _append(keys: object, values: object) -> Callable[[Any], object]:
    return lambda entry: entry.append(keys, values)


def _init(cfg: object) -> Callable[[Any], object]:
    return lambda entry: type(entry).init_cache_entry(cfg, "cpu", BATCH)


def _cfg_with_dtype(dtype: object) -> Any:
    cfg = make_cfg(n_heads=HEADS, d_head=D_HEAD)
    cfg.dtype = dtype  # a user's edit after construction, as with model.cfg.dtype = ...
    return cfg


EXPECTED_KV = f"[{BATCH}, {HEADS}, {D_HEAD}]"

CATALOGUE: tuple[BadInput, ...] = (
    BadInput(
        "rank",
        "keys and values of rank 3 `[2, 1, 32]`",
        ValueError,
        "4-dim [batch, pos, heads, d_head]",
        "(2, 1, 32)",
        _append(torch.ones(2, 1, 32), torch.ones(2, 1, 32)),
    ),
    BadInput(
        "heads",
        "3 heads where the cache holds 4",
        ValueError,
        EXPECTED_KV,
        "[2, 3, 8]",
        _append(kv(heads=3), kv(heads=3)),
    ),
    BadInput(
        "d_head",
        "d_head 7 where the cache holds 8",
        ValueError,
        EXPECTED_KV,
        "[2, 4, 7]",
        _append(kv(d_head=7), kv(d_head=7)),
    ),
    BadInput(
        "batch",
        "batch 3 where the cache holds 2",
        ValueError,
        EXPECTED_KV,
        "[3, 4, 8]",
        _append(kv(batch=3), kv(batch=3)),
    ),
    BadInput(
        "kv-positions",
        "keys of 1 position, values of 2",
        ValueError,
        "agree on batch and pos",
        "values (2, 2, 4, 8)",
        _append(kv(), kv(positions=2)),
    ),
    BadInput(
        "kv-heads",
        "values with 2 heads, keys with 4",
        ValueError,
        EXPECTED_KV,
        "[2, 2, 8]",
        _append(kv(), kv(heads=2)),
    ),
    BadInput(
        "keys-list",
        "keys given as a Python list",
        TypeError,
        "torch.Tensor",
        "list",
        _append([[1.0]], kv()),
    ),
    BadInput(
        "values-numpy",
        "values given as a NumPy array",
        TypeError,
        "torch.Tensor",
        "ndarray",
        _append(kv(), np.ones((2, 1, 4, 8))),
    ),
    BadInput(
        "keys-none",
        "keys given as None",
        TypeError,
        "torch.Tensor",
        "NoneType",
        _append(None, kv()),
    ),
    BadInput(
        "keys-int",
        "integer keys (int64)",
        ValueError,
        "floating point",
        "torch.int64",
        _append(kv(dtype=torch.int64), kv()),
    ),
    BadInput(
        "values-int",
        "float keys with integer values (int32)",
        ValueError,
        "floating point",
        "torch.int32",
        _append(kv(), kv(dtype=torch.int32)),
    ),
    BadInput(
        "keys-bool",
        "boolean keys and values",
        ValueError,
        "floating point",
        "torch.bool",
        _append(kv(dtype=torch.bool), kv(dtype=torch.bool)),
    ),
    BadInput(
        "keys-complex",
        "complex keys and values",
        ValueError,
        "floating point",
        "torch.complex64",
        _append(kv(dtype=torch.complex64), kv(dtype=torch.complex64)),
    ),
    BadInput(
        "past-non-tensor",
        "`past_keys` reassigned to a list",
        TypeError,
        "must be torch.Tensor",
        "list and Tensor",
        _append(kv(), kv()),
        prepare=_set_past([0.0], kv(positions=CACHED)),
    ),
    BadInput(
        "past-rank",
        "`past_keys`/`past_values` reassigned to rank 3",
        ValueError,
        "must be 4-dim",
        "(2, 3, 32)",
        _append(kv(), kv()),
        prepare=_set_past(torch.ones(2, 3, 32), torch.ones(2, 3, 32)),
    ),
    BadInput(
        "past-lengths",
        "`past_keys` truncated to 1 position, `past_values` left at 3",
        ValueError,
        "reassign both to the same length",
        "holds 1 positions",
        _append(kv(), kv()),
        prepare=_set_past(kv(positions=1), kv(positions=CACHED)),
    ),
    BadInput(
        "past-meta",
        "a non-empty past on the `meta` device",
        ValueError,
        "start a new cache on a real device",
        "3 positions on the meta device",
        _append(kv(), kv()),
        prepare=_set_past(kv(positions=CACHED).to("meta"), kv(positions=CACHED).to("meta")),
    ),
    BadInput(
        "keys-meta",
        "new keys and values on the `meta` device, 3 real positions cached",
        ValueError,
        "compute the keys and values on cpu",
        "new keys are on the meta device",
        _append(kv().to("meta"), kv().to("meta")),
    ),
    BadInput(
        "cfg-missing-d-head",
        "`init_cache_entry` with a cfg that lacks `d_head`",
        ValueError,
        "needs a config with n_heads and d_head",
        "lacks d_head",
        _init(types.SimpleNamespace(n_heads=HEADS)),
    ),
    BadInput(
        "cfg-missing-both",
        "`init_cache_entry` with a cfg that lacks `n_heads` and `d_head`",
        ValueError,
        "needs a config with n_heads and d_head",
        "lacks n_heads, d_head",
        _init(types.SimpleNamespace(d_model=32)),
    ),
    BadInput(
        "cfg-dtype-name",
        '`cfg.dtype = "float17"`',
        ValueError,
        "floating torch.dtype or its name",
        "'float17'",
        _init(_cfg_with_dtype("float17")),
    ),
    BadInput(
        "cfg-dtype-int",
        "`cfg.dtype = torch.int64`",
        ValueError,
        "floating torch.dtype",
        "received torch.int64",
        _init(_cfg_with_dtype(torch.int64)),
    ),
    BadInput(
        "cfg-dtype-number",
        "`cfg.dtype = 16`",
        ValueError,
        "floating torch.dtype",
        "received 16",
        _init(_cfg_with_dtype(16)),
    ),
)


def _filled_entry() -> Any:
    """An entry of the installed release holding CACHED positions in its in-place storage."""
    entry = LAYOUT.entry_class.init_cache_entry(
        make_cfg(n_heads=HEADS, d_head=D_HEAD), "cpu", BATCH
    )
    with torch.no_grad():
        entry.append(
            torch.randn(BATCH, CACHED, HEADS, D_HEAD), torch.randn(BATCH, CACHED, HEADS, D_HEAD)
        )
    return entry


def _snapshot(entry: Any) -> dict[str, tuple[object, object]]:
    """Every attribute by identity, and a copy of each tensor's content (of a record's fields:
    each field by identity, since a small cache's record is updated in place)."""
    return {name: (value, _content(value)) for name, value in vars(entry).items()}


def _content(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return None if value.is_meta else value.clone()
    if isinstance(value, kv_storage.SmallCache):
        return tuple(getattr(value, field.name) for field in dataclasses.fields(value))
    return None


@pytest.mark.both_cache_modes
@pytest.mark.parametrize("case", CATALOGUE, ids=[case.id for case in CATALOGUE])
@pytest.mark.parametrize("frozen", [False, True], ids=["live", "frozen"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_bad_input_is_refused_clearly_and_changes_nothing(
    case: BadInput, frozen: bool, grad: bool
) -> None:
    """The documented error type; the message names expected and received; the entry is intact."""
    assert safelens_tl.activate().active
    entry = _filled_entry()
    entry.frozen = frozen
    if case.prepare is not None:
        case.prepare(entry)
    before = _snapshot(entry)
    with torch.set_grad_enabled(grad), pytest.raises(case.error) as raised:
        case.act(entry)
    message = str(raised.value)
    assert case.expected in message, message
    assert case.received in message, message
    after = vars(entry)
    assert after.keys() == before.keys()
    for name, (value, content) in before.items():
        assert after[name] is value, f"{name} was replaced"
        if isinstance(content, torch.Tensor):
            assert torch.equal(after[name], content), f"{name} changed in place"
        elif content is not None:
            fields = dataclasses.fields(after[name])
            now = tuple(getattr(after[name], field.name) for field in fields)
            assert all(a is b for a, b in zip(now, content, strict=True)), f"{name} was updated"


def test_errors_name_the_layer(cache_class: type) -> None:
    """Through a real cache, the error also says which layer refused the input."""
    assert safelens_tl.activate().active
    cfg = make_cfg(n_heads=HEADS, d_head=D_HEAD, n_layers=3)
    cache = cache_class.init_cache(cfg, "cpu", BATCH)
    with pytest.raises(ValueError, match="layer 2") as raised:
        cache[2].append(kv(heads=3), kv(heads=3))
    assert EXPECTED_KV in str(raised.value)
    assert cache[2].past_keys.size(1) == 0


def catalogue_markdown() -> str:
    """The catalogue as the Markdown table kept in docs/bad-inputs.md."""
    lines = [
        "| id | input | error | the message names (expected) | the message names (received) |",
        "|---|---|---|---|---|",
    ]
    for case in CATALOGUE:
        lines.append(
            f"| `{case.id}` | {case.given} | `{case.error.__name__}` | `{case.expected}` | "
            f"`{case.received}` |"
        )
    return "\n".join(lines) + "\n"


def test_docs_table_matches_catalogue() -> None:
    """docs/bad-inputs.md shows exactly the rows tested here."""
    assert catalogue_markdown() in DOCS.read_text(encoding="utf-8")


if __name__ == "__main__":
    print(catalogue_markdown(), end="")
