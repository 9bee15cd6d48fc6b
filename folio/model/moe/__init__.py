"""Mixture-of-experts: routing (routing.py), token permutation (dispatch.py), the expert
layer and its sparse block (layer.py); the grouped-GEMM Triton kernel is
folio/model/kernels/fused_moe.py."""
