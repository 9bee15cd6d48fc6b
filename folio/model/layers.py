"""Shared layers of decoder-only transformers. A model family is a choice among these."""
from __future__ import annotations

from dataclasses import dataclass

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from folio.model.attention import AttentionBackend, AttentionMetadata
from folio.model.attention.fp8 import CALCULATED_K_RANGE, CALCULATED_V_RANGE, is_fp8
from folio.model.kernel_config import DEFAULT_KERNEL_CONFIG, KernelConfig
from folio.model.rope_scaling import rope_frequencies

if TYPE_CHECKING:
    from folio.model.kernels.rotary import PagedKVWrite


# Every layer below takes the KernelConfig the model is built with (load_model resolves it once
# from the defaults and the FOLIO_* overrides) and keeps it: the forward code consults only that,
# never the environment. Built standalone (tests, tools), a layer gets the defaults.


def fused_kernels_on(x: torch.Tensor, kernels: KernelConfig) -> bool:
    """Triton's fused norm/rotary kernels on CUDA (one launch instead of a chain of eager ops);
    `kernels.kernels` "torch" (FOLIO_KERNELS=torch) keeps the eager reference."""
    if not x.is_cuda or not kernels.fused_kernels:
        return False
    from folio.model.kernels._common import HAS_TRITON
    return HAS_TRITON


def cpu_kernel_ops(x: torch.Tensor, kernels: KernelConfig) -> Any | None:
    """folio's C++ ops (folio.model.cpu_kernels) for a float32 CPU tensor, one call where the
    eager code below is a chain of small ops; None keeps the eager code (other dtypes, CUDA,
    `kernels.kernels` "torch", or no compiler here)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not kernels.fused_kernels:
        return None
    from folio.model.cpu_kernels import loaded
    return loaded()


@dataclass
class QuantizedRows:
    """A norm's output handed to a W8A8 projection already quantized per token (the codes and
    scales the projection would make of the 16-bit rows): `RMSNorm.forward_quantized` makes
    them, `Linear.forward` takes them where `Linear.quantized_input_dtype` said it would."""
    codes: torch.Tensor       # [T, K], float8_e4m3fn or int8
    scale: torch.Tensor       # [T, 1] float32
    dtype: torch.dtype        # the 16-bit dtype the rows stand for (the product's output)

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6,
                 kernels: KernelConfig = DEFAULT_KERNEL_CONFIG) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = kernels

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32 whatever the activations' dtype, scale in the input dtype: the
        # order Hugging Face uses, so bf16 results round the same way.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, adds it first and also returns the sum (the next residual)."""
        if fused_kernels_on(x, self.kernels):
            from folio.model.kernels.rmsnorm import rms_norm
            return rms_norm(x, self.weight, self.eps, residual, pdl=self.kernels.pdl_on)
        ops = cpu_kernel_ops(x, self.kernels) if x.dim() == 2 else None
        if ops is not None and self.weight.dtype == torch.float32:
            out = ops.rms_norm(x, self.weight, self.eps, residual)
            return out[0] if residual is None else (out[0], out[1])
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def forward_quantized(self, x: torch.Tensor, residual: torch.Tensor | None,
                          dtype: torch.dtype) -> tuple[QuantizedRows, torch.Tensor | None]:
        """forward's output quantized per token to `dtype` in the same launch (CUDA, weight
        in x's dtype: `quantized_output_ok`), and the residual sum as forward returns it."""
        from folio.model.kernels.rmsnorm import rms_norm_quantized
        codes, scale, res = rms_norm_quantized(x, self.weight, self.eps, dtype, residual,
                                               pdl=self.kernels.pdl_on)
        return QuantizedRows(codes, scale, x.dtype), res

    def quantized_output_ok(self, x: torch.Tensor) -> bool:
        return (fused_kernels_on(x, self.kernels) and x.dim() == 2
                and self.weight.dtype == x.dtype)

    def gemv_epilogue_ok(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether a skinny GEMV of input `x` may end with this norm over its output plus
        `residual` (kernels/gemv.skinny_matmul_add_norm: this class's arithmetic, in the norm
        kernel's code): the fused kernels, the stream and the weight in x's dtype, rows of
        the stream contiguous and no wider than the epilogue serves."""
        from folio.model.kernels.gemv import NORM_MAX_N
        return (type(self) is RMSNorm and fused_kernels_on(residual, self.kernels)
                and residual.dim() == 2 and residual.stride(-1) == 1
                and residual.shape[-1] <= NORM_MAX_N
                and x.dtype == residual.dtype == self.weight.dtype)


def _rope_parameters(hf_config: Any) -> dict:
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        # Per-layer-type dicts (e.g. {"full_attention": {...}}) are not used by this family.
        if "rope_type" not in params and "rope_theta" not in params and len(params) == 1:
            params = next(iter(params.values()))
        return dict(params)
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    scaling.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    return scaling


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, neox layout (halves rotated), with a cos/sin table built once."""

    def __init__(self, head_dim: int, max_positions: int, hf_config: Any,
                 kernels: KernelConfig = DEFAULT_KERNEL_CONFIG,
                 params: dict | None = None) -> None:
        """`params`: this table's rope parameters when they differ by layer (Gemma 3's
        local and global bases); None = the config's."""
        super().__init__()
        self.kernels = kernels
        params = dict(params) if params is not None else _rope_parameters(hf_config)
        rotary_dim = int(head_dim * params.get("partial_rotary_factor",
                                               getattr(hf_config, "partial_rotary_factor", 1.0)))
        # Phi-3 keeps original_max_position_embeddings beside the rope parameters, and it
        # takes precedence there (transformers' standardize_rope_params)
        original = getattr(hf_config, "original_max_position_embeddings", None)
        if original:
            params["original_max_position_embeddings"] = original
        max_position_embeddings = int(getattr(hf_config, "max_position_embeddings", None)
                                      or max_positions)
        # rope_scaling.py: every scaling type, and where one table departs from transformers
        found = rope_frequencies(params, rotary_dim, max_position_embeddings)
        self.rotary_dim = rotary_dim
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, found.inv_freq.float())
        if found.long_inv_freq is not None and found.long_from < max_positions:
            # LongRoPE: the long factors from the original context on
            tail = positions[found.long_from:]
            freqs[found.long_from:] = torch.outer(tail, found.long_inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * found.attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * found.attention_scaling, persistent=False)
        # M-RoPE (Qwen2-VL): positions come in three rows (time, height, width), and each
        # section of the frequencies turns by its own row; the column -> row map
        section = params.get("mrope_section")
        self.register_buffer("mrope_rows", None, persistent=False)
        if section:
            rows = [i % 3 for i, width in enumerate(section) for _ in range(int(width))]
            if len(rows) != rotary_dim // 2:
                raise ValueError(f"mrope_section {section} does not cover the "
                                 f"{rotary_dim // 2} rotary frequencies")
            self.register_buffer("mrope_rows", torch.tensor(rows + rows), persistent=False)

    def _forward_mrope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       q_norm: "RMSNorm | None", k_norm: "RMSNorm | None"):
        if self.mrope_rows is None:
            raise ValueError("positions in three rows need an M-RoPE model (mrope_section)")
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        rows = self.mrope_rows.view(1, 1, -1).expand(1, positions.shape[1], -1)
        cos = self.cos[positions].gather(0, rows)[0].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].gather(0, rows)[0].unsqueeze(1).to(q.dtype)
        r = self.rotary_dim
        q_rot = q[..., :r] * cos + self._rotate_half(q[..., :r]) * sin
        k_rot = k[..., :r] * cos + self._rotate_half(k[..., :r]) * sin
        if r == q.shape[-1]:
            return q_rot, k_rot
        return torch.cat((q_rot, q[..., r:]), -1), torch.cat((k_rot, k[..., r:]), -1)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                q_norm: "RMSNorm | None" = None, k_norm: "RMSNorm | None" = None,
                kv_write: "PagedKVWrite | None" = None):
        """q [T, H, D], k [T, KVH, D]. With q_norm/k_norm (Qwen3), each head is normalized
        before rotation (one fused launch on CUDA). `positions`: [T], or [3, T] for M-RoPE
        (a step with images' tokens; each frequency section reads its row). `kv_write`
        (an attention backend's `fused_kv_write`): the rotated keys and the values go into
        the paged cache too, in the same launch on CUDA."""
        if fused_kernels_on(q, self.kernels) and positions.dim() == 1:
            from folio.model.kernels.rotary import apply_rotary
            pdl = self.kernels.pdl_on
            if q_norm is not None and q_norm.weight.dtype == q.dtype:
                return apply_rotary(positions, q, k, self.cos, self.sin, q_norm.weight,
                                    k_norm.weight, q_norm.eps, pdl=pdl, kv_write=kv_write)
            if q_norm is not None:
                q, k = q_norm(q), k_norm(k)
            return apply_rotary(positions, q, k, self.cos, self.sin, pdl=pdl, kv_write=kv_write)
        q, k = self._forward_eager(positions, q, k, q_norm, k_norm)
        if kv_write is not None:
            kv_write.separately(k)
        return q, k

    def _forward_eager(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       q_norm: "RMSNorm | None", k_norm: "RMSNorm | None"):
        if positions.dim() == 2:
            return self._forward_mrope(positions, q, k, q_norm, k_norm)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        ops = cpu_kernel_ops(q, self.kernels)
        if ops is not None and positions.dtype == torch.int64 and k.dtype == torch.float32:
            q, k = ops.rotary_neox(positions, q, k, self.cos, self.sin, self.rotary_dim)
            return q, k
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        r = self.rotary_dim
        if r == q.shape[-1]:
            return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin
        q_rot = q[..., :r] * cos + self._rotate_half(q[..., :r]) * sin
        k_rot = k[..., :r] * cos + self._rotate_half(k[..., :r]) * sin
        return torch.cat((q_rot, q[..., r:]), -1), torch.cat((k_rot, k[..., r:]), -1)


def _skinny_input(x: torch.Tensor, linear: "Linear", fused: bool = False,
                  weight: torch.Tensor | None = None) -> torch.Tensor | None:
    """x as [rows, in_features] when the skinny Triton matmul should serve `linear` (CUDA,
    fp16/bf16, 1..8 rows: decode; for a plain projection, only shapes where it beats cuBLAS
    (`skinny_preferred`, by default one row only; the fused gate_up+SiLU at any row count the
    mode allows), else None. The layer's KernelConfig with gemv "0" or kernels "torch"
    (FOLIO_GEMV=0, FOLIO_KERNELS=torch) keeps cuBLAS. `weight`: the matrix to multiply, when
    not linear.weight (a riding LoRA's [W; A_all])."""
    kernels = linear.kernels
    weight = linear.weight if weight is None else weight
    if not x.is_cuda or not kernels.gemv_on or x.dim() == 0 or x.shape[-1] != linear.in_features:
        return None
    from folio.model.kernels import gemv
    # Cheap refusals first: this runs for every projection of every eager (prefill) step.
    if x.numel() > gemv.MAX_M * x.shape[-1]:
        return None
    if linear.bias is not None and linear.bias.dtype != x.dtype:
        return None
    x2 = x.reshape(-1, x.shape[-1])
    if not gemv.skinny_supported(x2, weight):
        return None
    preferred = gemv.skinny_preferred(x2.shape[0], *weight.shape, fused=fused,
                                      mode=kernels.gemv)
    return x2 if preferred else None


class Linear(nn.Linear):
    """nn.Linear whose decode-sized calls run `folio.model.kernels.gemv.skinny_matmul`, which
    streams the weight faster than cuBLAS's GEMV at a few rows; F.linear otherwise."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, *, kernels: KernelConfig = DEFAULT_KERNEL_CONFIG) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.kernels = kernels
        # The weight kept quantized (folio.model.quant: 4-bit planes or int8 rows, CPU); its
        # float `weight` is then empty.
        self.packed: nn.Module | None = None
        # LoRA adapters' deltas, added after the product (folio/model/lora/projection.py;
        # None without --enable-lora).
        self.lora: nn.Module | None = None
        # Tensor parallelism (folio/model/tensor_parallel.py): a row-parallel projection's
        # group, whose ranks' partial outputs are summed after the product; None otherwise.
        self.tp_reduce = None

    def quantized_input_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """The dtype this projection would quantize x to per token before its product (a W8A8
        weight at these rows), so that the norm before it may hand over QuantizedRows; None
        where it would not, or where x itself is still needed (LoRA, tensor parallelism)."""
        packed = self.packed
        if packed is None or self.lora is not None or self.tp_reduce is not None \
                or not hasattr(packed, "quantized_input_dtype"):
            return None
        return packed.quantized_input_dtype(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(x) is QuantizedRows:   # only where quantized_input_dtype said so
            return self.packed.forward_quantized(x.codes, x.scale, self.bias, x.dtype)
        lora = self.lora
        if lora is not None and lora.weight_cat is not None and lora.engaged:
            # adapters ride the weight: one product gives the base output and every shrink
            return lora.forward_on_weight(x, self._product(x, lora.weight_cat, None))
        if self.packed is not None:
            # .forward, not __call__: the packed module has no hooks, and nn.Module's call
            # machinery costs a few microseconds on every projection of every step.
            out = self.packed.forward(x, self.bias)
        else:
            out = self._product(x, self.weight, self.bias)
        if lora is not None:
            out = lora.forward(x, out)
        if self.tp_reduce is not None:
            out = self.tp_reduce.all_reduce(out)
        return out

    def forward_add_norm(self, x: torch.Tensor, residual: torch.Tensor,
                         norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`norm(self(x), residual)` -- (the normed sum, the sum) -- in the skinny GEMV's
        launch where it serves this product (kernels/gemv.skinny_matmul_add_norm, bit for bit
        the two apart); None where it does not, and the caller runs the two."""
        if (not x.is_cuda or not self.kernels.gemv_norm_on or self.lora is not None
                or self.tp_reduce is not None or not norm.gemv_epilogue_ok(x, residual)
                or residual.shape[-1] != self.out_features):
            return None
        if self.packed is not None:
            add_norm = getattr(self.packed, "forward_add_norm", None)
            return None if add_norm is None else add_norm(x, self.bias, residual, norm.weight,
                                                          norm.eps)
        x2 = _skinny_input(x, self)
        if x2 is None:
            return None
        from folio.model.kernels.gemv import skinny_matmul_add_norm
        return skinny_matmul_add_norm(x2, self.weight, residual, norm.weight, norm.eps,
                                      self.bias, pdl=self.kernels.pdl_on)

    def _product(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight^T (+ bias): the skinny GEMV at decode sizes where it wins, else cuBLAS."""
        x2 = _skinny_input(x, self, weight=weight)
        if x2 is not None:
            from folio.model.kernels.gemv import skinny_matmul
            return skinny_matmul(x2, weight, bias,
                                 pdl=self.kernels.pdl_on).view(*x.shape[:-1], -1)
        return F.linear(x, weight, bias)


class MergedLinear(Linear):
    """One matmul for several projections that read the same input (q/k/v, gate/up). Loads
    each checkpoint shard into its slice of the output rows."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool,
                 kernels: KernelConfig = DEFAULT_KERNEL_CONFIG) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias, kernels=kernels)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def checkpoint_shards(self) -> dict[str, list[str]]:
        """Per parameter, the shards a checkpoint with separate projections fills."""
        shards = list(self.shard_offsets)
        return {"weight": shards, **({"bias": shards} if self.bias is not None else {})}

    def load_shard(self, shard: str, param_name: str, tensor: torch.Tensor) -> None:
        offset, size = self.shard_offsets[shard]
        target = getattr(self, param_name)
        if tensor.shape[0] != size:
            raise ValueError(f"shard {shard}.{param_name} has {tensor.shape[0]} rows, expected {size}")
        with torch.no_grad():
            target[offset:offset + size].copy_(tensor)


class Attention(nn.Module):
    def __init__(self, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool, rms_norm_eps: float,
                 rotary: RotaryEmbedding, backend: AttentionBackend,
                 sliding_window: int | None,
                 kernels: KernelConfig = DEFAULT_KERNEL_CONFIG,
                 scale: float | None = None, logits_soft_cap: float | None = None,
                 sinks: bool = False) -> None:
        """`logits_soft_cap`: Gemma 2's attn_logit_softcapping (None = none). `sinks`: a
        learned per-head sink logit (GPT-OSS), loaded from the checkpoint's
        `self_attn.sinks`."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.logits_soft_cap = logits_soft_cap or None
        # float32 [H] as the backends take it; a weight, so the loader fills it (and casts
        # it to the model's dtype: forward hands the backends a float32 copy then).
        self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32),
                                  requires_grad=False) if sinks else None
        self.qkv_proj = MergedLinear(hidden_size, {"q": num_heads * head_dim,
                                                   "k": num_kv_heads * head_dim,
                                                   "v": num_kv_heads * head_dim}, bias=qkv_bias,
                                     kernels=kernels)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=o_bias, kernels=kernels)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps, kernels) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, rms_norm_eps, kernels) if qk_norm else None
        self.rotary = rotary
        self.backend = backend
        self.sliding_window = sliding_window
        # The KV cache group whose block tables this layer reads (AttentionMetadata.groups;
        # set by the worker from its KVCacheLayout when the model has several).
        self.kv_group = 0
        self.scale = head_dim ** -0.5 if scale is None else scale
        # The FP8 KV cache's scales (vLLM's k_scale / v_scale; the cache holds K / k_scale,
        # V / v_scale: folio/model/attention/fp8.py): float32, one per KV head (a per-tensor
        # scale repeated), 1.0 unless the checkpoint has them (load_kv_scale) or
        # --calculate-kv-scales sets them on the first step. Buffers, changed only in place
        # after loading, so captured CUDA graphs read the values they hold. Other cache dtypes
        # ignore them.
        self.register_buffer("k_scale", torch.ones(num_kv_heads, dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones(num_kv_heads, dtype=torch.float32))

    def reset_kv_scales(self, device: torch.device) -> None:
        """The scales as built: 1.0, float32, on `device`. The loader builds the model on the
        meta device and casts it to the model's dtype, which leaves buffers empty and in that
        dtype; DecoderLM.load_weights calls this before reading the checkpoint."""
        self.k_scale = torch.ones(self.num_kv_heads, dtype=torch.float32, device=device)
        self.v_scale = torch.ones(self.num_kv_heads, dtype=torch.float32, device=device)

    @torch.no_grad()
    def load_kv_scale(self, which: str, tensor: torch.Tensor, name: str) -> None:
        """Checkpoint tensor `name` into k_scale or v_scale (`which`; "kv_scale", a deprecated
        single scale, into both, as vLLM reads it): one element (per tensor) or one per KV head
        in any shape (compressed-tensors' attn_head strategy stores [kv_heads, 1, 1])."""
        if tensor.numel() not in (1, self.num_kv_heads):
            raise ValueError(f"KV cache scale {name} has shape {tuple(tensor.shape)}: expected "
                             f"one element, or one per KV head ({self.num_kv_heads})")
        values = tensor.detach().reshape(-1).to(torch.float32)
        if not bool(torch.isfinite(values).all()) or not bool((values > 0).all()):
            raise ValueError(f"KV cache scale {name} must be positive and finite, got "
                             f"{values.tolist()}")
        for target in ((self.k_scale, self.v_scale) if which == "kv_scale"
                       else (getattr(self, which),)):
            target.copy_(values.expand(self.num_kv_heads))

    @torch.no_grad()
    def calculate_kv_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """vLLM's --calculate-kv-scales: k_scale / v_scale = this step's amax of K / V, per
        tensor, over CALCULATED_K_RANGE / CALCULATED_V_RANGE (200 / 100, vLLM's: headroom
        under e4m3's 448 for later steps' larger values). In place, on the device (no host
        sync)."""
        for target, x, fp8_range in ((self.k_scale, k, CALCULATED_K_RANGE),
                                     (self.v_scale, v, CALCULATED_V_RANGE)):
            # An all-zero K would give scale 0 and 0 / 0 on write; any positive floor keeps
            # such values exact, since x <= amax <= floor * range.
            target.copy_((x.abs().amax().to(torch.float32) / fp8_range).clamp(min=1e-12))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attend(positions, x, kv_cache, metadata))

    def attend(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        """The heads' outputs side by side [T, H * D]: forward before o_proj (a decoder layer
        may run o_proj with the norm after it, Linear.forward_add_norm)."""
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        scales_now = metadata.calculate_kv_scales and is_fp8(kv_cache.dtype)
        group = metadata if metadata.groups is None else metadata.groups[self.kv_group]
        # The cache write in the rotary's launch where the backend offers it; not while the
        # FP8 scales are still to be taken from this step's rotated keys.
        write = None if scales_now or positions.dim() != 1 else self.backend.fused_kv_write(
            v, kv_cache, group, self.k_scale, self.v_scale)
        q, k = self.rotary(positions, q, k, self.q_norm, self.k_norm, kv_write=write)
        if scales_now:
            self.calculate_kv_scales(k, v)
        sinks = self.sinks
        if sinks is not None and sinks.dtype != torch.float32:
            sinks = sinks.float()
        out = self.backend.forward(q, k, v, kv_cache, group, scale=self.scale,
                                   sliding_window=self.sliding_window,
                                   k_scale=self.k_scale, v_scale=self.v_scale,
                                   logits_soft_cap=self.logits_soft_cap, sinks=sinks,
                                   kv_written=write is not None)
        return out.reshape(t, q_size)


def is_silu(act: str) -> bool:
    """Whether config activation name `act` is SiLU (which has fused kernels)."""
    return act in ("silu", "swish")


def gate_activation(act: str):
    """The function a config's activation name means: what a gated MLP applies to its gate,
    and an encoder's MLP to its hidden layer."""
    if is_silu(act):
        return F.silu
    # gelu_new and gelu_fast (BERT-era names) are the same tanh approximation
    if act in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if act == "gelu":
        return F.gelu
    raise ValueError(f"activation {act!r} is not supported")


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, act: str,
                 kernels: KernelConfig = DEFAULT_KERNEL_CONFIG) -> None:
        super().__init__()
        self.kernels = kernels
        self.gate_up_proj = MergedLinear(hidden_size, {"gate": intermediate_size,
                                                       "up": intermediate_size}, bias=bias,
                                         kernels=kernels)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, kernels=kernels)
        self.fused_silu = is_silu(act)
        self.act_name = act
        self.act = gate_activation(act)

    def quantized_input_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """As Linear's, for the merged gate/up projection; None where forward would run the
        fused gate_up + SiLU GEMV on the 16-bit rows instead (decode sizes)."""
        proj = self.gate_up_proj
        packed = proj.packed
        if self.fused_silu and proj.lora is None and packed is not None \
                and hasattr(packed, "gate_up_silu_wanted") \
                and packed.gate_up_silu_wanted(x, proj.bias):
            return None
        return proj.quantized_input_dtype(x)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        if type(x) is QuantizedRows:   # a long prefill's rows, quantized by the norm before
            return self._act_down(self.gate_up_proj(x))
        act = self._fused_act(x)
        if act is not None:
            return self.down_proj(act)
        return self._act_down(self.gate_up_proj(x))

    def forward_add_norm(self, x: torch.Tensor, residual: torch.Tensor,
                         norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(norm(self(x) + residual), self(x) + residual), the norm ending the down
        projection's GEMV launch (Linear.forward_add_norm), where the fused gate_up + SiLU
        serves x; else (self(x), None), and the caller adds and normalizes."""
        act = None if type(x) is QuantizedRows else self._fused_act(x)
        if act is None:
            return self(x), None
        fused = self.down_proj.forward_add_norm(act, residual, norm)
        return fused if fused is not None else (self.down_proj(act), None)

    def _fused_act(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up from one pass over the merged weight, where a decode-sized x
        takes the fused GEMV; None elsewhere."""
        packed = self.gate_up_proj.packed
        # The fused gate_up+SiLU paths never see gate_up's output, where LoRA adds its delta.
        if not self.fused_silu or self.gate_up_proj.lora is not None:
            return None
        if packed is not None:
            # a quantized merged weight that fuses the activation itself (8-bit weights)
            return packed.gate_up_silu(x, self.gate_up_proj.bias) \
                if hasattr(packed, "gate_up_silu") else None
        x2 = _skinny_input(x, self.gate_up_proj, fused=True)
        if x2 is None:
            return None
        # decode: gate_up and SiLU-and-mul in one pass over the weight
        from folio.model.kernels.gemv import skinny_gate_up_silu
        act = skinny_gate_up_silu(x2, self.gate_up_proj.weight, self.gate_up_proj.bias,
                                  pdl=self.kernels.pdl_on)
        return act.view(*x.shape[:-1], -1)

    def _act_down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down(act(gate) * up) from the merged projection's output."""
        if self.fused_silu and gate_up.dim() == 2:
            ops = cpu_kernel_ops(gate_up, self.kernels)
            if ops is not None:
                return self.down_proj(ops.silu_and_mul(gate_up))
        if self.fused_silu and fused_kernels_on(gate_up, self.kernels):
            from folio.model.kernels.activation import silu_and_mul
            out = self._down_from_quantized_act(gate_up)
            return out if out is not None else self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def _down_from_quantized_act(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """down(silu(gate) * up) for a W8A8 down projection that would quantize its input
        per token: SiLU-and-mul writes the codes directly (kernels/activation.py), the same
        bytes, and the 16-bit activation is never written. None where that does not apply
        (another down projection, LoRA or tensor parallelism on it, a GEMV-sized batch)."""
        down = self.down_proj
        packed = down.packed
        if packed is None or down.lora is not None or down.tp_reduce is not None \
                or not hasattr(packed, "quantized_input_dtype"):
            return None
        inner = gate_up.shape[-1] // 2
        gu = gate_up.reshape(-1, 2 * inner)
        dtype = packed.quantized_input_dtype(gu[:, :inner])   # shaped as the activation
        if dtype is None or gu.stride(1) != 1:
            return None
        from folio.model.kernels.activation import silu_and_mul_quantized
        codes, scale = silu_and_mul_quantized(gu, dtype)
        out = packed.forward_quantized(codes, scale, down.bias, gate_up.dtype)
        return out.view(*gate_up.shape[:-1], -1)
