"""Fused elementwise Triton kernels (RMSNorm + residual, rotary embedding).

Not wired into the model layers: they match `folio.model.layers.RMSNorm` / `RotaryEmbedding`
and are meant to replace them on GPU once checked there.
"""
