"""The fixes of ``TransformerBridge`` (TransformerLens 3.x/4.x, ``transformer_lens.model_bridge``),
one module per symptom; ``_positions`` and ``_mrope_positions`` are helpers of ``model_call``.

Listed, in the order they are applied, in :data:`safelens_tl.fixes.BRIDGE_FIXES`.
"""
