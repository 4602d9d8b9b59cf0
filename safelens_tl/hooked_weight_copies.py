"""HookedTransformer forwards that read the weights where they lie, instead of copying them.

TransformerLens 3.0-3.9 copy weight matrices at every forward, in every layer:

* ``GatedMLP.forward`` and ``Unembed.forward`` call ``F.linear(x, self.W.T.contiguous())``: a
  transposed copy of ``W_gate``, ``W_in``, ``W_out`` and ``W_U``;
* attention's output projection makes ``einops.rearrange(self.W_O, ...).contiguous()``;
* ``utilities.attention.simple_attn_linear`` (queries, keys and values) rearranges
  ``[head, d_model, d_head]`` into ``[(head d_head), d_model]``, which cannot be a view (also in
  TransformerLens 2.x);
* with ``cfg.ungroup_grouped_query_attention``, grouped-query attention projects keys and values
  with ``W_K``/``W_V``, properties that ``repeat_interleave`` the key/value weights at each call.

On a 135M-parameter Llama most of a cached generation's time went into those copies. The fix
reads each weight in its own layout:

* ``F.linear(x, W.T)``: ``W.T`` is a transposed view, and the matrix product takes it as it is;
* ``W_O.reshape(head * d_head, d_model)`` is a view of ``[head, d_head, d_model]``;
* queries, keys and values are one matrix product per head (``torch.baddbmm`` with the heads as
  the batch, the bias fused as ``F.linear`` fuses it); the input is broadcast over the heads
  (no copy) and the ``[head, pos, d_head]`` result is laid out as ``[batch, pos, head, d_head]``
  (a copy of the activation, the same layout the release returns);
* ungrouped keys and values are projected with the key/value heads' own weights and the
  *projections* repeated over the query heads: the same numbers, hook ``hook_k``/``hook_v``
  still sees every query head.

Nothing is cached: no transposed or repeated weight stays in memory, and gradients reach the
parameters as before. The hooks see the same names and shapes. Logits: bitwise equal where the
matrix product takes the same kernel for either layout (float32 with 16 or more rows per
product; bfloat16 on CPU for every row count measured); with one or two rows in float32 (a
cached decoding step of batch 1) the kernel differs and so do the last bits
(docs/performance.md gives the measured difference).

What is patched is found by behaviour or by source: ``simple_attn_linear`` only where a call on
tiny tensors copies its weight (:func:`copies_weight`); the forwards only where their source
holds the copying expression, which is then replaced by its view in a recompiled copy of the
release's own function (:func:`rewritten`), so that each release keeps its own logic.
"""

from __future__ import annotations

import functools
import inspect
import linecache
import re
import textwrap
from collections.abc import Callable, Iterable
from types import FunctionType, ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from safelens_tl import targets
from safelens_tl.patching import Patch

#: ATen operations that write a new tensor from another one's elements: a copy when that other
#: tensor is a weight. ``contiguous()``, ``reshape`` of a non-viewable layout and ``einops``'
#: rearrangements reach ATen as ``clone``; ``repeat_interleave`` as ``index_select``.
COPYING_OPERATIONS = frozenset(
    {
        "clone",
        "copy_",
        "_to_copy",
        "contiguous",
        "index_select",
        "repeat",
        "repeat_interleave",
        "cat",
        "stack",
        "expand_copy",
        "permute_copy",
        "transpose_copy",
        "t_copy",
        "view_copy",
        "_reshape_copy",
    }
)


#: Operations that return a view where the layout allows and a copy where it does not. Autograd
#: decomposes them before the dispatch mode sees them, but under ``torch.inference_mode`` (TL 2.x's
#: ``generate``) they arrive whole: a copy is told by a result in other storage.
VIEW_OR_COPY_OPERATIONS = frozenset({"reshape", "flatten", "unflatten", "contiguous", "view_as"})


def _storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().nbytes()}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


class WeightCopyCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Record every copying ATen operation (:data:`COPYING_OPERATIONS`) that reads a tensor
    sharing storage with one of ``weights`` (a module's parameters, say), below autograd: what a
    forward really runs, whatever Python spelling produced it.

    ``copies`` lists ``(operation, shape of the weight-backed input)`` in the order they ran.
    """

    def __init__(self, weights: Iterable[torch.Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.storages = _storages(weights)
        self.copies: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in VIEW_OR_COPY_OPERATIONS:
            result = func(*args, **kwargs)
            source = args[0] if args and isinstance(args[0], torch.Tensor) else None
            pointer = None if source is None else source.untyped_storage().data_ptr()
            if (
                pointer in self.storages
                and isinstance(result, torch.Tensor)
                and result.untyped_storage().data_ptr() != pointer
            ):
                self.copies.append((name, tuple(source.shape)))  # type: ignore[union-attr]
            return result
        if name in COPYING_OPERATIONS:
            # copy_(destination, source): only the source is read.
            inputs = _tensors(args[1:2] if name == "copy_" else args) + _tensors(
                list(kwargs.values())
            )
            for tensor in inputs:
                if tensor.untyped_storage().data_ptr() in self.storages:
                    self.copies.append((name, tuple(tensor.shape)))
                    break
        return func(*args, **kwargs)


def copies_weight(attn_linear: Callable[..., torch.Tensor]) -> bool:
    """Whether ``simple_attn_linear(input, w, b)`` copies ``w`` or ``b`` (tried on tiny tensors)."""
    weight, bias = torch.zeros(2, 3, 4), torch.zeros(2, 4)
    with torch.no_grad(), WeightCopyCounter([weight, bias]) as counter:
        attn_linear(torch.zeros(1, 1, 3), weight, bias)
    return bool(counter.copies)


def simple_attn_linear(input: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[batch, pos, d_model] x [head, d_model, d_head] + [head, d_head]`` ->
    ``[batch, pos, head, d_head]``, the weight read in its own layout (one product per head)."""
    if input.device != w.device:
        w = w.to(input.device)
    if input.device != b.device:
        b = b.to(input.device)
    heads, d_model, d_head = w.shape
    rows = input.reshape(-1, d_model)
    # The heads are the batch: each head's [d_model, d_head] block is a contiguous matrix, and
    # the input is broadcast (stride 0), not repeated. The bias is added inside the product, as
    # F.linear adds it.
    projected = torch.baddbmm(b.unsqueeze(1), rows.expand(heads, *rows.shape), w)
    # [head, rows, d_head] -> [rows, head, d_head], contiguous as the release's result is.
    laid_out = projected.transpose(0, 1).contiguous()
    return laid_out.view(input.shape[0], input.shape[1], heads, d_head)


def _repeated_heads(projection: torch.Tensor, repeats: int) -> torch.Tensor:
    """Keys or values of the key/value heads, repeated over the query heads of each group."""
    return torch.repeat_interleave(projection, repeats, dim=2)


#: Copying expressions of the forwards and their views. Each forward is rewritten only where every
#: listed pattern of it is found at least once.
_TRANSPOSED_COPY = (r"\.T\.contiguous\(\)", ".T")
_OUTPUT_WEIGHT_COPY = (
    r"einops\.rearrange\(\s*self\.W_O,\s*"
    r"\"head_index d_head d_model -> d_model \(head_index d_head\)\"\s*,?\s*\)\.contiguous\(\)",
    # A view: [head, d_head, d_model] -> [(head d_head), d_model], transposed.
    "self.W_O.reshape(-1, self.W_O.shape[-1]).T",
)
_UNGROUPED_KEYS = (
    r"attn_fn\(key_input, self\.W_K, self\.b_K\)",
    "(_repeated_heads(attn_fn(key_input, self._W_K, self._b_K), self.repeat_kv_heads) "
    "if attn_fn is simple_attn_linear else attn_fn(key_input, self.W_K, self.b_K))",
)
_UNGROUPED_VALUES = (
    r"attn_fn\(value_input, self\.W_V, self\.b_V\)",
    "(_repeated_heads(attn_fn(value_input, self._W_V, self._b_V), self.repeat_kv_heads) "
    "if attn_fn is simple_attn_linear else attn_fn(value_input, self.W_V, self.b_V))",
)

#: (class, method, patterns) rewritten where the installed release has them.
_REWRITES: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    (targets.HOOKED_GATED_MLP_CLASS, "forward", (_TRANSPOSED_COPY,)),
    (targets.HOOKED_UNEMBED_CLASS, "forward", (_TRANSPOSED_COPY,)),
    (targets.HOOKED_ATTENTION_CLASS, "forward", (_OUTPUT_WEIGHT_COPY,)),
    (targets.HOOKED_GQA_CLASS, "calculate_qkv_matrices", (_UNGROUPED_KEYS, _UNGROUPED_VALUES)),
)

#: Names the rewritten functions may use besides their module's globals (passed as closure
#: variables, so that the module's globals stay live: a patched ``simple_attn_linear`` is seen).
_HELPERS: dict[str, Any] = {"_repeated_heads": _repeated_heads}


def _literal(text: str, match: re.Match[str]) -> str:
    return text


def rewritten(
    function: Callable[..., Any], edits: Iterable[tuple[str, str]]
) -> Callable[..., Any] | None:
    """``function`` recompiled from its source with every ``(pattern, replacement)`` applied, in
    its module's globals; ``None`` when a pattern is not found (this release does not copy there,
    or words it otherwise) or the source cannot be recompiled as it stands (decorated, a closure,
    no source)."""
    if not isinstance(function, FunctionType) or function.__code__.co_freevars:
        return None
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return None
    if not source.startswith("def "):
        return None
    for pattern, replacement in edits:
        # re.escape-free replacement text: a function returns it as it is.
        source, found = re.subn(pattern, functools.partial(_literal, replacement), source)
        if not found:
            return None
    name = function.__name__
    helpers = ", ".join(_HELPERS)
    factory = (
        f"def _safelens_factory({helpers}):\n{textwrap.indent(source, '    ')}    return {name}\n"
    )
    filename = f"<safelens-tl: {function.__module__}.{function.__qualname__}>"
    # Tracebacks and inspect.getsource of the replacement show the code that runs.
    linecache.cache[filename] = (len(factory), None, factory.splitlines(True), filename)
    namespace: dict[str, Any] = {}
    exec(compile(factory, filename, "exec"), function.__globals__, namespace)
    replacement = namespace["_safelens_factory"](**_HELPERS)
    replacement.__qualname__ = function.__qualname__
    replacement.__module__ = function.__module__
    replacement.__doc__ = function.__doc__
    replacement.__defaults__ = function.__defaults__
    replacement.__kwdefaults__ = function.__kwdefaults__
    assert callable(replacement)
    return functools.update_wrapper(replacement, function, assigned=(), updated=())


def patches() -> list[Patch]:
    """The patches for the installed release: none where nothing copies."""
    found: list[Patch] = []
    attention = targets.optional_module(targets.HOOKED_ATTENTION_LINEAR_MODULE)
    original = None if attention is None else attention.__dict__.get("simple_attn_linear")
    if callable(original) and copies_weight(original):
        # The attention modules imported the function by name: each binding is replaced.
        for module_name in (
            targets.HOOKED_ATTENTION_LINEAR_MODULE,
            *targets.HOOKED_ATTENTION_LINEAR_USERS,
        ):
            module = targets.optional_module(module_name)
            if (
                isinstance(module, ModuleType)
                and module.__dict__.get("simple_attn_linear") is original
            ):
                found.append(Patch(module, "simple_attn_linear", simple_attn_linear))
    for dotted, method, edits in _REWRITES:
        owner = targets.optional_class(dotted)
        function = None if owner is None else owner.__dict__.get(method)
        if owner is None or function is None:
            continue
        replacement = rewritten(function, edits)
        if replacement is not None:
            found.append(Patch(owner, method, replacement))
    return found
