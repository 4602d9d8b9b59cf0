"""The fixes of ``HookedTransformer`` (``import transformer_lens``), one module per symptom.

Listed, in the order they are applied, in :data:`safelens_tl.fixes.HOOKED_FIXES`.
"""
