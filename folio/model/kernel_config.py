"""Which kernels the model layers run, decided once when the model is built.

The forward code used to read FOLIO_KERNELS / FOLIO_ATTENTION / FOLIO_GEMV from the environment
on every call. That made the choice depend on when a variable happened to be set (a test that
set one after building a model changed a live model half-way), cost a dictionary lookup per
projection per step, and left a typo in a value silently meaning "torch". Now `load_model`
resolves the variables here, once, into a frozen `KernelConfig` that every layer is
built with; the variables remain as overrides of the defaults below, and nothing else in
folio.model reads them.

The choices are preferences, not promises: a Triton choice still falls back to the torch
reference wherever the kernel cannot run (CPU tensors, no triton installed, an unsupported
dtype or shape); those capability checks stay next to the kernels.

Deliberately torch-free, so anything may import it cheaply.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Mapping

KERNELS_CHOICES = ("triton", "torch")
ATTENTION_CHOICES = ("triton", "torch")
# The skinny GEMV (kernels/gemv.py) for decode-sized products: "1" = single-row products only
# (batch-1 decode, where it pays most and autotunes for one row bucket, a few seconds at
# start-up); "narrow" = also 2-8 rows where the output is narrow; "all" = wherever supported;
# "0" = never (cuBLAS throughout).
GEMV_MODES = ("0", "1", "narrow", "all")
# Programmatic dependent launch of the Triton kernels (kernels/_common.py), on GPUs that have
# it (Hopper and newer): "1" = where the GPU has it, "0" = never.
PDL_CHOICES = ("1", "0")
# Multi-LoRA on CUDA (folio/model/lora/projection.py): "weight" = adapters' A rows appended to
# plain 16-bit base weights, one GEMM for the base product and the shrink; "kernels" = the
# separate shrink and expand kernels everywhere (the A/B comparison's other side).
LORA_CHOICES = ("weight", "kernels")
# Long fresh prefills' attention on CUDA through torch's fused kernel (cuDNN / FlashAttention;
# folio/model/attention/dense_prefill.py): "1" = where it fits, "0" = the paged kernel always.
DENSE_PREFILL_CHOICES = ("1", "0")
# A Llama-form decoder layer on the CPU as one C++ call (folio/model/cpu_layer.py): "1" =
# where the layer qualifies, "0" = the Python layer always (the A/B comparison's other side).
CPU_LAYER_CHOICES = ("1", "0")
# The paged KV cache write on CUDA: "rotary" = in the rotary kernel's launch
# (kernels/rotary.PagedKVWrite), "separate" = its own kernel (the A/B comparison's other side).
KV_WRITE_CHOICES = ("rotary", "separate")
# The residual add + RMSNorm after a projection served by the skinny GEMV (kernels/gemv.py
# skinny_matmul_add_norm: o_proj with the post-attention norm, down_proj with the next layer's
# input norm): "1" = in the GEMV's launch, "0" = the norm kernel apart. Off by default: on the
# H100 (session 27) the grid's last program normalizing the rows alone cost more than the norm
# launches it saves under PDL (bf16 batch 1 5.793 against 5.690 ms/token; a verify step's 8
# rows 1.356x a plain step against 1.138x).
GEMV_NORM_CHOICES = ("1", "0")

# Environment variable -> (field, allowed values).
_ENV_OVERRIDES = {
    "FOLIO_KERNELS": ("kernels", KERNELS_CHOICES),
    "FOLIO_ATTENTION": ("attention", ATTENTION_CHOICES),
    "FOLIO_GEMV": ("gemv", GEMV_MODES),
    "FOLIO_PDL": ("pdl", PDL_CHOICES),
    "FOLIO_LORA": ("lora", LORA_CHOICES),
    "FOLIO_DENSE_PREFILL": ("dense_prefill", DENSE_PREFILL_CHOICES),
    "FOLIO_CPU_LAYER": ("cpu_layer", CPU_LAYER_CHOICES),
    "FOLIO_KV_WRITE": ("kv_write", KV_WRITE_CHOICES),
    "FOLIO_GEMV_NORM": ("gemv_norm", GEMV_NORM_CHOICES),
}


@dataclass(frozen=True)
class KernelConfig:
    """`kernels`: the fused Triton RMSNorm / rotary / SiLU-and-mul kernels, or the eager torch
    code ("torch" also turns the skinny GEMV off, as FOLIO_KERNELS=torch always did).
    `attention`: the device's own paged-attention kernel ("triton": the Triton backend on
    CUDA, folio's C++ kernel on the CPU) or the torch reference. `gemv`: one of GEMV_MODES. `pdl`: one of
    PDL_CHOICES. `lora`: one of LORA_CHOICES. `dense_prefill`: one of DENSE_PREFILL_CHOICES.
    `cpu_layer`: one of CPU_LAYER_CHOICES. `kv_write`: one of KV_WRITE_CHOICES.
    `gemv_norm`: one of GEMV_NORM_CHOICES."""

    kernels: str = "triton"
    attention: str = "triton"
    gemv: str = "1"
    pdl: str = "1"
    lora: str = "weight"
    dense_prefill: str = "1"
    cpu_layer: str = "1"
    kv_write: str = "rotary"
    gemv_norm: str = "0"

    def __post_init__(self) -> None:
        # Also guards configs built by hand, not only those read from the environment.
        for field_name, allowed in _ENV_OVERRIDES.values():
            value = getattr(self, field_name)
            if value not in allowed:
                raise ValueError(f"KernelConfig.{field_name} must be one of {list(allowed)}, "
                                 f"got {value!r}")

    @property
    def fused_kernels(self) -> bool:
        """Whether the fused Triton norm/rotary/activation kernels are wanted."""
        return self.kernels == "triton"

    @property
    def triton_attention(self) -> bool:
        return self.attention == "triton"

    @property
    def pdl_on(self) -> bool:
        """Whether the decode path's Triton kernels may use programmatic dependent launch."""
        return self.kernels == "triton" and self.pdl == "1"

    @property
    def gemv_on(self) -> bool:
        """Whether the skinny GEMV may replace cuBLAS at all (the mode then says where)."""
        return self.kernels == "triton" and self.gemv != "0"

    @property
    def dense_prefill_on(self) -> bool:
        """Whether the Triton attention backend may hand long fresh prefills to torch's fused
        attention (DENSE_PREFILL_CHOICES)."""
        return self.dense_prefill == "1"

    @property
    def cpu_layer_on(self) -> bool:
        """Whether a qualifying decoder layer may run as one C++ call on the CPU (it also
        needs the fused kernels: FOLIO_KERNELS=torch keeps the eager code everywhere)."""
        return self.fused_kernels and self.cpu_layer == "1"

    @property
    def kv_write_in_rotary(self) -> bool:
        """Whether the rotary kernel may write the paged KV cache (KV_WRITE_CHOICES); it also
        needs the fused kernels (FOLIO_KERNELS=torch keeps the eager rotary)."""
        return self.fused_kernels and self.kv_write == "rotary"

    @property
    def gemv_norm_on(self) -> bool:
        """Whether a skinny GEMV may end with the residual add + RMSNorm after it
        (GEMV_NORM_CHOICES); it also needs the GEMV itself (gemv_on)."""
        return self.gemv_on and self.gemv_norm == "1"

    @property
    def lora_on_weight(self) -> bool:
        """Whether adapters' A rows may ride plain 16-bit base weights (LORA_CHOICES)."""
        return self.lora == "weight"


DEFAULT_KERNEL_CONFIG = KernelConfig()


# With speculative decoding a batch-1 verify step is k + 1 <= 8 rows (the 8-token mixed
# graph), where the skinny GEMV's masked tl.dot path beat cuBLAS end to end: the Llama-3-8B
# verify step 5.030 against 5.203 ms on the H200, 6.711 against 6.823 on the H100
# (tools/gpu_verify_cost.py, docs/benchmarks.md sessions 24-25).
SPECULATIVE_GEMV = "all"


def resolve_kernel_config(env: Mapping[str, str] | None = None, *,
                          speculative: bool = False) -> KernelConfig:
    """The defaults with FOLIO_KERNELS / FOLIO_ATTENTION / FOLIO_GEMV / FOLIO_PDL / FOLIO_LORA /
    FOLIO_DENSE_PREFILL / FOLIO_CPU_LAYER / FOLIO_KV_WRITE / FOLIO_GEMV_NORM from `env` (os.environ when None) applied over them.
    An unknown value is an error naming the variable: it used to fall back silently
    (FOLIO_KERNELS=eager meant torch), which hid typos. `speculative`: the engine verifies
    drafts, so the GEMV default is SPECULATIVE_GEMV (FOLIO_GEMV still overrides it)."""
    env = os.environ if env is None else env
    overrides = {}
    for var, (field_name, allowed) in _ENV_OVERRIDES.items():
        value = env.get(var)
        if value is None:
            continue
        if value not in allowed:
            raise ValueError(f"{var} must be one of {list(allowed)}, got {value!r}")
        overrides[field_name] = value
    defaults = replace(DEFAULT_KERNEL_CONFIG, gemv=SPECULATIVE_GEMV) if speculative \
        else DEFAULT_KERNEL_CONFIG
    return replace(defaults, **overrides)
