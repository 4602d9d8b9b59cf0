"""The KV cache as safelens-tl stores it: :mod:`~safelens_tl.kv.entry`, the replacement methods of
TransformerLens's cache entry, and :mod:`~safelens_tl.kv.storage`, the buffers they append to.

Knows nothing of fixes or plugins: the ``kv_cache`` and ``generate_reserve`` fixes
(:mod:`safelens_tl.fixes.hooked`) install these, and ``safelens-tl verify`` checks them.
"""
