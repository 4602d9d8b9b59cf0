"""TransformerBridge conversions (``to``, ``half``, ``bfloat16``, ...) that keep it coherent.

Stock TransformerBridge has two traps here:

- Only ``bridge.to(dtype)`` / ``bridge.to(device)`` update ``cfg``; ``half()``, ``bfloat16()``,
  ``float()``, ``double()`` and ``type()`` cast the weights but leave ``cfg.dtype`` as it was, and
  ``to(torch.device("cuda", 1))`` records only ``"cuda"``. TransformerLens reads ``cfg.dtype`` and
  ``cfg.device`` to build masks, positions and caches during ``generate``.
- A dtype conversion casts the rotary ``inv_freq`` buffers too, while
  ``boot_transformers(..., dtype=torch.float16)`` keeps them in float32. Rounded to float16 or
  bfloat16, the frequencies are off by up to 2^-11 / 2^-8 relative, and the rotation angle
  ``position * inv_freq`` drifts with position: at a few thousand tokens it is off by radians.

Every conversion goes through ``to`` or ``nn.Module._apply``; both are wrapped here. After the
outermost one returns, rotary frequency buffers that were float32 and came out in a narrower dtype
are put back in float32 (on their new device), and ``cfg.dtype`` / ``cfg.device`` are set to what
the weights hold, where all weights agree. Nothing else changes.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from safelens_tl import targets
from safelens_tl.patching import Patch
from safelens_tl.registry import Context, Fix, frozen

#: Buffer names of rotary position-embedding frequencies (Hugging Face rotary modules).
ROTARY_BUFFERS = ("inv_freq", "original_inv_freq")

# ids of the bridges whose conversion is under way in this context: nested calls (``to`` calls
# ``_apply``) leave the work to the outermost one.
_converting: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "safelens_tl_bridge_converting", default=frozenset()
)


@dataclass(frozen=True)
class _SavedBuffer:
    module: torch.nn.Module
    name: str
    tensor: torch.Tensor


def _rotary_buffers(bridge: torch.nn.Module) -> Iterator[_SavedBuffer]:
    for module in bridge.modules():
        for name in ROTARY_BUFFERS:
            tensor = module._buffers.get(name)
            if tensor is not None and tensor.dtype == torch.float32:
                yield _SavedBuffer(module, name, tensor)


def _narrower_than_float32(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and torch.finfo(dtype).bits < 32


def _restore_rotary(saved: list[_SavedBuffer]) -> None:
    for entry in saved:
        current = entry.module._buffers.get(entry.name)
        if current is not None and _narrower_than_float32(current.dtype):
            # The untouched float32 original, moved to wherever the conversion put the buffer.
            entry.module._buffers[entry.name] = entry.tensor.to(device=current.device)


def _same_device(recorded: Any, actual: torch.device) -> bool:
    try:
        wanted = torch.device(recorded)
    except (TypeError, RuntimeError):
        return False
    if wanted.type != actual.type:
        return False
    if wanted.index is None:
        # "cuda" means the current CUDA device; "cpu" has no index.
        return actual.index is None or (
            actual.type == "cuda" and actual.index == torch.cuda.current_device()
        )
    return wanted.index == actual.index


def sync_config(bridge: torch.nn.Module) -> None:
    """Set ``cfg.dtype`` / ``cfg.device`` to the weights' dtype and device where all agree."""
    cfg = getattr(bridge, "cfg", None)
    if cfg is None:
        return
    parameters = list(bridge.parameters())
    dtypes = {p.dtype for p in parameters if p.is_floating_point()}
    if len(dtypes) == 1 and hasattr(cfg, "dtype"):
        (dtype,) = dtypes
        if cfg.dtype != dtype:
            cfg.dtype = dtype
    devices = {p.device for p in parameters}
    split = int(getattr(cfg, "n_devices", 1) or 1) > 1
    if len(devices) == 1 and not split and hasattr(cfg, "device"):
        (device,) = devices
        if not _same_device(cfg.device, device):
            cfg.device = str(device)


def converting(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a conversion method (``to`` or ``_apply``) of TransformerBridge; see the module."""

    @functools.wraps(original)
    def convert(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = _converting.get()
        if id(self) in outer:
            return original(self, *args, **kwargs)
        saved = list(_rotary_buffers(self))
        token = _converting.set(outer | {id(self)})
        try:
            result = original(self, *args, **kwargs)
        finally:
            _converting.reset(token)
        _restore_rotary(saved)
        sync_config(self)
        return result

    return convert


def _patches(context: Context) -> list[Patch]:
    bridge = context.bridge.bridge_class
    return [Patch(bridge, name, converting(getattr(bridge, name))) for name in ("to", "_apply")]


FIX = Fix(
    id="bridge_conversion",
    symptom="bridge.half() / .bfloat16() leave cfg.dtype at float32, .to(device) records no "
    "index, and a dtype conversion rounds the rotary frequencies",
    affects=frozen({"transformer-lens": ">=3.0,<5"}),
    remedy="every conversion updates cfg.dtype and cfg.device and keeps inv_freq in float32",
    applies=lambda context: (True, "TransformerBridge converts through to and _apply"),
    patches=_patches,
    test_module="tests/test_bridge_conversion.py",
    changes=("conversion",),
    when_imported=(targets.BRIDGE_MODULE,),
)
