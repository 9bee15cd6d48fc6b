"""The mixture-of-experts MLP: a router picks k experts per token, the experts' gated MLPs run
as grouped GEMMs over the tokens sorted by expert, and their outputs are summed by routing
weight (plus, for Qwen2-MoE, a shared expert every token visits).

The experts' weights are stored stacked, as transformers 5 holds them: gate_up_proj
[E, 2I, H] (each expert's gate rows then its up rows) and down_proj [E, H, I]. Checkpoints
that store one tensor per expert (Mixtral's w1/w3/w2, Qwen's gate/up/down_proj) load into
their expert's slice (`load_shard`).

FP8 experts (`--quantization fp8`, on load): `quantize_fp8` turns both stacked weights into
e4m3 codes with one float32 scale per expert row (vLLM's per-channel FP8 MoE weights); the
Triton paths read the codes and scale each output column, halving the bytes a decode step
reads; the CPU path widens one expert at a time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from folio.model.families import ArchSpec, ExpertActivation, MoESpec
from folio.model.kernel_config import DEFAULT_KERNEL_CONFIG, KernelConfig
from folio.model.layers import (GatedMLP, cpu_kernel_ops, fused_kernels_on, gate_activation,
                                 is_silu)
from folio.model.moe.dispatch import sort_by_expert
from folio.model.moe.routing import RouterConfig, select_experts

# A per-expert checkpoint tensor's part of the stacked weights: (parameter, shard of it).
EXPERT_SHARDS = {
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    "down_proj": ("down_proj", "down"),
    # Mixtral's names
    "w1": ("gate_up_proj", "gate"), "w3": ("gate_up_proj", "up"), "w2": ("down_proj", "down"),
}


class FusedMoE(nn.Module):
    """The routed experts: x [T, H], routing (weights [T, k], ids [T, k]) -> [T, H]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str,
                 kernels: KernelConfig = DEFAULT_KERNEL_CONFIG, *, bias: bool = False,
                 activation: ExpertActivation = ExpertActivation.GATED,
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                 transposed_interleaved_checkpoint: bool = False) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        # Expert parallelism (folio/model/tensor_parallel.py): this rank's experts are the
        # checkpoint's [expert_offset, expert_offset + num_experts).
        self.expert_offset = 0
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size,
                                                     hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_proj_bias = (nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
                                  if bias else None)
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None
        self.activation = activation
        self.alpha, self.limit = swiglu_alpha, swiglu_limit
        self.silu = activation is ExpertActivation.GATED and is_silu(act)
        self.act = gate_activation(act) if activation is ExpertActivation.GATED else None
        self.transposed_interleaved = transposed_interleaved_checkpoint
        self.kernels = kernels
        # FP8 experts: per-row scales [E, 2I] / [E, H] (float32); None for float weights.
        # Buffers, so they follow the module between devices (sleep mode).
        self.register_buffer("gate_up_scale", None, persistent=False)
        self.register_buffer("down_scale", None, persistent=False)

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2I] (gate | up) -> [rows, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        if self.activation is ExpertActivation.SWIGLU_OAI:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return self.act(gate) * up

    # ---- checkpoint ------------------------------------------------------------------------

    def checkpoint_shards(self) -> dict[str, list[str]]:
        """Per parameter, the shards a per-expert checkpoint fills ("<expert>.<part>")."""
        experts = range(self.expert_offset, self.expert_offset + self.num_experts)
        return {"gate_up_proj": [f"{e}.{p}" for e in experts for p in ("gate", "up")],
                "down_proj": [f"{e}.down" for e in experts]}

    def convert_checkpoint_tensor(self, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A stacked checkpoint tensor in this module's layout. GPT-OSS stores gate_up_proj
        [E, H, 2I] with gate and up interleaved column by column (and its bias likewise) and
        down_proj [E, I, H]: transposed, and the gate columns gathered before the up ones."""
        if not self.transposed_interleaved:
            return tensor
        if param_name == "gate_up_proj":
            tensor = tensor.transpose(1, 2)
            return torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)
        if param_name == "gate_up_proj_bias":
            return torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)
        if param_name == "down_proj":
            return tensor.transpose(1, 2)
        return tensor

    @torch.no_grad()
    def load_shard(self, shard: str, param_name: str, tensor: torch.Tensor) -> None:
        expert_s, _, part = shard.partition(".")
        expert = int(expert_s) - self.expert_offset
        if self.expert_offset or getattr(self, "tp_param_parts", None):
            if not 0 <= expert < self.num_experts:
                return   # another rank's expert (expert parallelism)
        elif not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range (the model has {self.num_experts})")
        inter = self.intermediate_size
        target = getattr(self, param_name)[expert]
        if part == "gate":
            target = target[:inter]
        elif part == "up":
            target = target[inter:]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"expert {expert} {part} weight has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(target.shape)}")
        target.copy_(tensor)

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """Both stacked weights to FP8 e4m3, scale = max|row| / 448 per expert row, one expert
        at a time into the codes' tensor (the float32 copy of a whole stack would be 4 bytes a
        weight). The float weights were loaded first: loading needs the float model's memory,
        decode then reads half of it. Once only (the codes cannot be quantized again)."""
        from folio.model.quant.formats import FP8_DTYPE, quantize_fp8_per_channel
        if self.gate_up_scale is not None:
            raise ValueError("the experts are FP8 already")
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(self, name)
            codes = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
            scales = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
            for e, w in enumerate(weight):
                q = quantize_fp8_per_channel(w)
                codes[e], scales[e] = q.codes, q.scale
            setattr(self, name, nn.Parameter(codes, requires_grad=False))
            setattr(self, name.replace("_proj", "_scale"), scales)

    def _weight(self, name: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """One expert's weight in `dtype`: FP8 codes widened and scaled per row."""
        weight = getattr(self, name)[expert]
        scale = getattr(self, name.replace("_proj", "_scale"))
        if scale is None:
            return weight
        return (weight.to(torch.float32) * scale[expert][:, None]).to(dtype)

    # ---- forward ---------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if fused_kernels_on(x, self.kernels):
            from folio.model.kernels.fused_moe import fused_experts
            return fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids,
                                 None if self.silu else self.gated,
                                 self.gate_up_proj_bias, self.down_proj_bias,
                                 gate_up_scale=self.gate_up_scale, down_scale=self.down_scale)
        return self._grouped_torch(x, weights, ids)

    def _grouped_torch(self, x: torch.Tensor, weights: torch.Tensor,
                       ids: torch.Tensor) -> torch.Tensor:
        """The CPU path (and CUDA's without Triton): the (token, slot) pairs sorted by expert,
        one pair of matmuls per expert that has any over its run of rows, then unsorted and
        summed by routing weight. A Python loop over experts, never over tokens."""
        t, k = ids.shape
        order, counts = sort_by_expert(ids, self.num_experts)
        rows = x[order // k]
        out = torch.empty((t * k, x.shape[1]), dtype=torch.float32, device=x.device)
        start = 0
        for expert, n in enumerate(counts):
            if not n:
                continue
            seg = rows[start:start + n]
            b13 = self.gate_up_proj_bias[expert] if self.gate_up_proj_bias is not None else None
            b2 = self.down_proj_bias[expert] if self.down_proj_bias is not None else None
            gate_up = F.linear(seg, self._weight("gate_up_proj", expert, seg.dtype), b13)
            ops = cpu_kernel_ops(gate_up, self.kernels) if self.silu else None
            act = ops.silu_and_mul(gate_up) if ops is not None else self.gated(gate_up)
            out[order[start:start + n]] = F.linear(
                act, self._weight("down_proj", expert, act.dtype), b2).float()
            start += n
        out = out.view(t, k, -1) * weights.unsqueeze(-1)
        return out.sum(dim=1).to(x.dtype)


class MoERouter(nn.Module):
    """The router's logits ([E, H] weight, as checkpoints name it `gate`), and DeepSeek-V3's
    score correction bias when the spec has one."""

    def __init__(self, hidden_size: int, moe: MoESpec) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(moe.num_experts)) if moe.router_bias else None
        self.e_score_correction_bias = (nn.Parameter(torch.empty(moe.num_experts))
                                        if moe.score_correction_bias else None)
        self.config = RouterConfig(
            num_experts=moe.num_experts, top_k=moe.top_k, scoring=moe.scoring,
            renormalize=moe.renormalize, num_groups=moe.num_groups,
            topk_groups=moe.topk_groups, routed_scaling_factor=moe.routed_scaling_factor)
        self.float32 = moe.router_float32

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.float32:
            logits = F.linear(x.float(), self.weight.float(),
                              None if self.bias is None else self.bias.float())
        else:
            logits = F.linear(x, self.weight, self.bias)
        return select_experts(logits, self.config, self.e_score_correction_bias)


class SparseMoeBlock(nn.Module):
    """The MoE MLP of one decoder layer (in place of GatedMLP)."""

    def __init__(self, spec: ArchSpec, kernels: KernelConfig = DEFAULT_KERNEL_CONFIG) -> None:
        super().__init__()
        moe = spec.moe
        assert moe is not None
        self.gate = MoERouter(spec.hidden_size, moe)
        self.experts = FusedMoE(moe.num_experts, spec.hidden_size, moe.intermediate_size,
                                spec.hidden_act, kernels, bias=moe.expert_bias,
                                activation=moe.activation, swiglu_alpha=moe.swiglu_alpha,
                                swiglu_limit=moe.swiglu_limit,
                                transposed_interleaved_checkpoint=moe
                                .transposed_interleaved_checkpoint)
        self.shared_expert = (GatedMLP(spec.hidden_size, moe.shared_expert_intermediate_size,
                                       False, spec.hidden_act, kernels)
                              if moe.shared_expert_intermediate_size else None)
        self.shared_expert_gate = (nn.Linear(spec.hidden_size, 1, bias=False)
                                   if moe.shared_expert_gate else None)
        # Expert parallelism: the rank's group (tensor_parallel.plan_shards sets it); None on
        # one device.
        self.tp = None
        # Expert parallelism: (token, expert) pairs this rank's experts ran since the worker
        # last read them, per local expert (made on the first forward, on its device).
        self.expert_load: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.tp is not None:
            # The tokens are on every rank; each runs its own experts' pairs (the others'
            # weigh 0, on a local expert) and the ranks' outputs are summed.
            local = ids - self.experts.expert_offset
            outside = (local < 0) | (local >= self.experts.num_experts)
            weights = weights.masked_fill(outside, 0)
            ids = local.masked_fill(outside, 0)
            if self.expert_load is None:
                self.expert_load = torch.zeros(self.experts.num_experts, dtype=torch.int64,
                                               device=x.device)
            # on the device, no sync: the other ranks' pairs add 0 (to expert 0)
            self.expert_load.scatter_add_(0, ids.flatten(), (~outside).flatten().long())
        out = self.experts(x, weights, ids)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
