"""TransformerBridge reads the KV cache under whichever name the installed transformers passes.

transformers 5.24 renamed the cache argument of its attention modules (and models) from
``past_key_values`` to ``cache``, keeping the old name through a deprecation shim that
transformers says goes away in 5.40. TransformerLens's attention bridges (3.x up to 4.3) read only
``past_key_values`` / ``layer_past``: with 5.24 they find no cache, store nothing, and every cached
decode step attends to itself alone. Cached generation is then silently wrong in every dtype.

What is patched here, each a no-op unless the renamed argument actually arrives:

- ``AttentionBridge._update_kv_cache`` (inherited by almost every attention bridge) and the
  ``forward`` of the bridges that read the argument themselves: a cache passed as ``cache`` is
  read as ``past_key_values``.
- The call into the model (:mod:`safelens_tl.fixes.bridge.model_call`): the bridge hands the model
its
  cache as ``past_key_values``; when the model's ``forward`` names it ``cache``, it gets it under
  that name (:func:`pass_cache_by_the_models_name`). This works without the deprecation shim
  (5.40) and without its ``FutureWarning`` at every step.
- ``ModelOutput.past_key_values`` only where transformers no longer has it: the bridge's generate
  loop reads the cache back under that name.
- The ``forward`` of bridges that take their generation path only when ``cache_params`` arrives
  (``GatedDeltaNetBridge``, the linear attention of Qwen3-Next and Qwen3.5): transformers 5.24
  passes that state cache as ``cache`` too, so without this every decoding step of those layers
  started from an empty state. A cache passed as ``cache`` takes the same path, and reaches the
  Hugging Face module under the name it was passed.
- The ``forward`` of the Mamba and Mamba-2 mixer bridges, whose opt-in eager scan
  (``eager_scan=True``) runs whenever no ``cache_params`` arrives: a cache passed as ``cache``
  keeps it off, as ``cache_params`` did (:func:`eager_scan_would_miss_the_cache`, applied in
  :mod:`safelens_tl.fixes.bridge.state_mask`).

Which name the installed transformers uses is read from its code (:func:`attention_cache_argument`),
never from its version number.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any

from safelens_tl import targets
from safelens_tl.patching import Patch
from safelens_tl.plugins import Failure
from safelens_tl.registry import Context, Fix, Wrap, frozen

#: The names TransformerLens's bridges read the KV cache from.
OLD_NAMES = ("past_key_values", "layer_past")
#: The name transformers 5.24+ passes it under.
NEW_NAME = "cache"
#: The deprecation shim that maps the old name onto the new one (transformers 5.24-5.39).
SHIM_OLD_NAME = "past_key_values"
#: What linear-attention (state-space) modules called their cache before transformers 5.24.
OLD_STATE_NAME = "cache_params"


def parameter_names(function: Any) -> set[str]:
    """The parameter names of ``function``'s signature; empty where it has none to read."""
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()


def _forward_parameters(dotted_class: str) -> set[str]:
    """Parameter names of ``<class>.forward``, read without importing the module if need be.

    Importing ``modeling_llama`` costs 0.4-0.7 s, which every import of TransformerBridge would
    pay; reading its source costs milliseconds. An already imported module is asked directly.
    """
    import ast
    import sys
    from importlib import util

    module_name, _, class_name = dotted_class.rpartition(".")
    module = sys.modules.get(module_name)
    if module is not None:
        return parameter_names(getattr(getattr(module, class_name, None), "forward", None))
    try:
        spec = util.find_spec(module_name)
    except (ImportError, ValueError):
        return set()
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return set()
    try:
        stamp = os.stat(spec.origin).st_mtime_ns
    except OSError:
        return set()
    # Parsing modeling_llama takes 5-10 ms and every activate() asks: the answer is kept for as
    # long as the file is unchanged.
    key = (dotted_class, spec.origin, stamp)
    if key not in _parsed_parameters:
        with open(spec.origin, encoding="utf-8") as source:
            tree = ast.parse(source.read())
        _parsed_parameters[key] = frozenset(_class_forward_arguments(tree, class_name))
    return set(_parsed_parameters[key])


#: ``forward``'s parameter names read from a module's source, by (class, file, modification time).
_parsed_parameters: dict[tuple[str, str, int], frozenset[str]] = {}


def _class_forward_arguments(tree: Any, class_name: str) -> set[str]:
    """The parameter names of ``class_name.forward`` in a parsed module; empty if it has none."""
    import ast

    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "forward":
                    arguments = item.args
                    return {a.arg for a in [*arguments.args, *arguments.kwonlyargs]}
    return set()


def attention_cache_argument() -> str | None:
    """The name under which the installed transformers passes the KV cache to attention modules.

    ``"past_key_values"`` (transformers up to 5.23), ``"cache"`` (5.24 on), or ``None`` when the
    reference attention module is missing or names neither.
    """
    parameters = _forward_parameters(targets.REFERENCE_ATTENTION)
    if SHIM_OLD_NAME in parameters:
        return SHIM_OLD_NAME
    if NEW_NAME in parameters:
        return NEW_NAME
    return None


def _shim_old_names(function: Any) -> set[str]:
    """Old keyword names that ``deprecate_kwarg`` wrappers around ``function`` still accept."""
    names: set[str] = set()
    while function is not None:
        closure = getattr(function, "__closure__", None) or ()
        code = getattr(function, "__code__", None)
        free = getattr(code, "co_freevars", ())
        cells = dict(zip(free, closure, strict=False))
        old = cells.get("old_name")
        if old is not None:
            try:
                value = old.cell_contents
            except ValueError:  # an empty cell
                value = None
            if isinstance(value, str):
                names.add(value)
        function = getattr(function, "__wrapped__", None)
    return names


_takes_cache: dict[type, bool] = {}


def takes_cache_not_past_key_values(model_class: type) -> bool:
    """Whether ``model_class.forward`` names its cache ``cache`` and has no ``past_key_values``.

    Remembered per class: the driver asks at every step.
    """
    known = _takes_cache.get(model_class)
    if known is None:
        parameters = parameter_names(getattr(model_class, "forward", None))
        known = NEW_NAME in parameters and SHIM_OLD_NAME not in parameters
        _takes_cache[model_class] = known
    return known


#: Keyed by the ``forward`` function itself, so that a replaced method is looked at anew.
_cache_only: dict[Any, bool] = {}


def takes_cache_only(model_class: type) -> bool:
    """Whether ``model_class.forward`` takes ``cache`` and no longer accepts ``past_key_values``
    in any form (no parameter, no deprecation shim): a cache passed under the old name would land
    in ``**kwargs`` and be ignored. Remembered per method: asked at every step."""
    forward = getattr(model_class, "forward", None)
    known = _cache_only.get(forward)
    if known is None:
        known = NEW_NAME in parameter_names(forward) and not accepts_past_key_values(model_class)
        _cache_only[forward] = known
    return known


def accepts_past_key_values(model_class: type) -> bool:
    """Whether ``model_class.forward`` still takes the cache as ``past_key_values``.

    True for a parameter of that name (transformers up to 5.23) or a deprecation shim mapping it
    onto ``cache`` (5.24 to 5.39). False once the shim is gone: the argument would then land in
    ``**kwargs`` and be ignored, and a cache passed that way is silently not used.
    """
    forward = getattr(model_class, "forward", None)
    if SHIM_OLD_NAME in parameter_names(forward):
        return True
    return SHIM_OLD_NAME in _shim_old_names(forward)


def only_under_new_name(kwargs: dict[str, Any]) -> bool:
    """Whether a call passes the cache as ``cache`` only (none as ``past_key_values`` or
    ``layer_past``)."""
    return NEW_NAME in kwargs and all(kwargs.get(name) is None for name in OLD_NAMES)


#: What Hugging Face's older attention modules (Falcon, BLOOM, GPTBigCode, ...) still call the
#: cache they pass.
LAYER_PAST = "layer_past"


def reads_layer_past(update_kv_cache: Any) -> bool:
    """Whether an ``AttentionBridge._update_kv_cache`` also looks for the cache under
    ``layer_past`` (TransformerLens 3.9 and 4.x); 3.0's reads ``past_key_values`` only, so the
    bridges of Falcon, BLOOM and GPTBigCode never wrote their cache there."""
    code = getattr(update_kv_cache, "__code__", None)
    return code is not None and LAYER_PAST in code.co_consts


def reading_update_kv_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``AttentionBridge._update_kv_cache``: it also finds a cache passed as ``cache``, and,
    where the original ignores it (:func:`reads_layer_past`), one passed as ``layer_past``."""
    maps_layer_past = not reads_layer_past(original)

    @functools.wraps(original)
    def _update_kv_cache(self: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        # Assigning into this call's own dict: the caller's arguments are unchanged.
        if only_under_new_name(kwargs):
            kwargs["past_key_values"] = kwargs[NEW_NAME]
        elif maps_layer_past and kwargs.get("past_key_values") is None:
            kwargs["past_key_values"] = kwargs.get(LAYER_PAST)
        return original(self, k, v, **kwargs)

    return _update_kv_cache


def reading_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an attention bridge's ``forward`` that pops ``past_key_values`` from its kwargs.

    The cache moves from ``cache`` to ``past_key_values``, so the bridge sees exactly what it saw
    with transformers 5.23 (where no ``cache`` keyword existed).
    """

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if only_under_new_name(kwargs):
            kwargs["past_key_values"] = kwargs.pop(NEW_NAME)
        return original(self, *args, **kwargs)

    return forward


def reading_state_forward(original: Callable[..., Any], cached_path: str) -> Callable[..., Any]:
    """Wrap a bridge's ``forward`` that runs ``cached_path`` only when ``cache_params`` arrives.

    A cache passed as ``cache`` runs that path too, with the arguments as passed: the module
    below takes ``cache`` from transformers 5.24 on (and ``cache_params`` only through a
    deprecation shim that warns and goes away in 5.40).
    """

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get(OLD_STATE_NAME) is None and kwargs.get(NEW_NAME) is not None:
            return getattr(self, cached_path)(*args, **kwargs)
        return original(self, *args, **kwargs)

    return forward


def eager_scan_would_miss_the_cache(mixer: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a state-space mixer bridge would run its opt-in eager scan on a call that carries a
    cache.

    TransformerLens runs the scan (which starts from an empty state) whenever no ``cache_params``
    arrives, to keep it to calls without a cache; transformers 5.24 passes that cache as
    ``cache``. Such a call should run as with the scan off: the Hugging Face mixer, which reads
    and updates the cache (:func:`safelens_tl.fixes.bridge.state_mask.adapting_mixer_forward`).
    """
    return (
        bool(getattr(mixer, "eager_scan", False))
        and kwargs.get(OLD_STATE_NAME) is None
        and kwargs.get(NEW_NAME) is not None
    )


def pass_cache_by_the_models_name(
    kwargs: dict[str, Any], model_class: type, keep_accepted_old_name: bool
) -> None:
    """Move a cache that TransformerBridge passes as ``past_key_values`` to ``cache`` in the
    keyword arguments of a call into ``model_class`` (the call's own dict), when its ``forward``
    names it so.

    ``keep_accepted_old_name``: leave it where the model still accepts the old name through a
    deprecation shim (TransformerLens 3.x, whose own code around the call was written for it); only
    a model that would ignore it (Mamba and FalconMamba from transformers 5.24, whose shim maps only
    ``cache_params``; every model once the shims go in 5.40) gets it renamed. Otherwise every model
    that names it ``cache`` gets it so: no ``FutureWarning`` at every step, and no shim needed.
    """
    if SHIM_OLD_NAME not in kwargs or NEW_NAME in kwargs:
        return
    if keep_accepted_old_name:
        renamed = takes_cache_only(model_class)
    else:
        renamed = takes_cache_not_past_key_values(model_class)
    if renamed:
        kwargs[NEW_NAME] = kwargs.pop(SHIM_OLD_NAME)


def _cache_of(output: Any) -> Any:
    return getattr(output, NEW_NAME, None)


def output_alias() -> property:
    """``past_key_values`` as a read-only alias of ``cache`` on model outputs."""
    return property(_cache_of, doc="The model's KV cache (alias of ``cache``).")


def _renamed() -> bool:
    return attention_cache_argument() == NEW_NAME


def _applies(context: Context) -> tuple[bool, str]:
    if _renamed():
        return True, "transformers passes the KV cache as `cache`"
    if not reads_layer_past(context.bridge.attention_class.__dict__.get("_update_kv_cache")):
        return True, "the attention bridge does not read `layer_past`"
    return False, "transformers passes past_key_values, which TransformerLens reads"


def _patches(context: Context) -> Iterator[Patch | Wrap | Failure]:
    bridge = context.bridge
    yield Wrap(
        bridge.attention_class,
        "_update_kv_cache",
        reading_update_kv_cache,
        "transformers compatibility",
        "it cannot be taught the `cache` argument of this transformers, nor `layer_past`, "
        "so its cached generation may ignore the cache",
    )
    if not _renamed():
        return  # transformers passes past_key_values, which TransformerLens reads
    consequence = (
        "it cannot be taught the `cache` argument of this transformers, so its cached "
        "generation may ignore the cache"
    )
    for owner in bridge.forward_cache_readers:
        yield Wrap(owner, "forward", reading_forward, "transformers compatibility", consequence)
    for owner, cached_path in bridge.state_cache_readers:
        if callable(getattr(owner, cached_path, None)):
            reader = functools.partial(reading_state_forward, cached_path=cached_path)
            yield Wrap(owner, "forward", reader, "transformers compatibility", consequence)
        else:
            yield Failure(
                context.source,
                "transformers compatibility",
                f"{owner.__module__}.{owner.__qualname__} has no {cached_path}; it cannot be "
                f"taught the `cache` argument of this transformers, so its cached generation "
                f"may start every step from an empty state",
            )
    output = targets.optional_class(targets.MODEL_OUTPUT_CLASS)
    if output is not None and not hasattr(output, SHIM_OLD_NAME):
        yield Patch(output, SHIM_OLD_NAME, output_alias())


FIX = Fix(
    id="bridge_cache",
    symptom="cached TransformerBridge.generate and hf_generate silently wrong with transformers "
    ">= 5.24 (and for Falcon, BLOOM, GPTBigCode on TransformerLens 3.0): each step attends to "
    "itself alone",
    affects=frozen({"transformer-lens": ">=3.0,<5"}),
    remedy="the attention bridges read the cache under whichever name transformers passes",
    applies=_applies,
    patches=_patches,
    test_module="tests/test_bridge_cache.py",
    changes=("cache", "forward"),
    when_imported=(targets.BRIDGE_MODULE,),
)
