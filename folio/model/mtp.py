"""Multi-token prediction (DeepSeek-V3's MTP module) as a speculative-decoding head.

DeepSeek-V3 checkpoints carry `num_nextn_predict_layers` modules after the decoder layers,
named model.layers.{L}.* for L = num_hidden_layers, ...: each predicts the token after next
from the pair (token q+1, the target's final hidden state at q), as an EAGLE head does
(folio/model/eagle.py), through
  x = eh_proj([enorm(embed(token)); hnorm(hidden)]),  one full decoder layer (latent attention
  and mixture of experts, like the target's), shared_head.norm, shared_head.head.
The module's embedding and output matrix are copies of the target's in the checkpoint; they
are loaded as they are (vLLM does the same). The module is built as a one-layer DecoderLM so
that its layer, its experts and its latent attention load through the target's own code.

Chained drafting feeds the layer's output state (before shared_head.norm) to the next step,
as the EAGLE proposer does; a checkpoint with several MTP modules drafts with the first only.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
from torch import nn

from folio.model.attention import AttentionBackend, AttentionMetadata
from folio.model.decoder import DecoderLM
from folio.model.families import ArchSpec
from folio.model.kernel_config import DEFAULT_KERNEL_CONFIG, KernelConfig
from folio.model.layers import Linear, RMSNorm

MTP_METHOD = "mtp"
# the module's own tensors (past "model.layers.{L}."), and where the one-layer DecoderLM
# keeps the shared ones
_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight")
_RENAMES = {"shared_head.norm.weight": "model.norm.weight",
            "shared_head.head.weight": "lm_head.weight",
            "embed_tokens.weight": "model.embed_tokens.weight"}


def mtp_spec(target: ArchSpec) -> ArchSpec:
    """The MTP module's one layer: the target's kind of layer (sparse when the target's
    last layer is), with its own output matrix."""
    if not target.num_mtp_layers:
        raise ValueError("speculative_config.method mtp: the model has no multi-token-prediction "
                         "layers (num_nextn_predict_layers is 0 or absent)")
    moe = target.moe
    if moe is not None:
        moe = dataclasses.replace(moe, sparse_layers=(moe.sparse_layers[-1],))
    return dataclasses.replace(
        target, num_layers=1, moe=moe, num_mtp_layers=0, tie_word_embeddings=False,
        sliding_windows=target.sliding_windows[-1:] if target.sliding_windows else (),
        layer_rope_parameters=target.layer_rope_parameters[-1:])


class MtpHead(nn.Module):
    """The EagleHead face (method, forward, compute_logits) over one MTP module."""

    method = MTP_METHOD

    def __init__(self, spec: ArchSpec, hf_config: Any, backend: AttentionBackend,
                 max_positions: int, kernels: KernelConfig = DEFAULT_KERNEL_CONFIG) -> None:
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        self.block = DecoderLM(spec, hf_config, backend, max_positions, kernels)
        self.enorm = RMSNorm(h, spec.rms_norm_eps, kernels)
        self.hnorm = RMSNorm(h, spec.rms_norm_eps, kernels)
        self.eh_proj = Linear(2 * h, h, bias=False, kernels=kernels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (token q+1, the target's hidden state at q) at positions q -> (the state the
        logits are read from, the state the next drafting step takes)."""
        embeds = self.block.embed_tokens(input_ids)
        # position 0 has no earlier state in DeepSeek's training; vLLM zeroes its embedding
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        x, residual = self.block.layers[0](positions, x, None, kv_caches[0], metadata)
        out = x + residual
        return self.block.norm(out), out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.block.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], first_layer: int) -> None:
        """The checkpoint's tensors of module model.layers.{first_layer}.*; others skipped."""
        prefix = f"model.layers.{first_layer}."
        own = dict(self.named_parameters())
        block_weights = []
        seen: set[str] = set()
        for name, tensor in weights:
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            if rest in _OWN:
                target = own[rest]
                if target.shape != tensor.shape:
                    raise ValueError(f"MTP module: {name} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(target.shape)}")
                with torch.no_grad():
                    target.copy_(tensor)
                seen.add(rest)
            elif rest in _RENAMES:
                block_weights.append((_RENAMES[rest], tensor))
            else:
                block_weights.append((f"model.layers.0.{rest}", tensor))
        missing = [n for n in _OWN if n not in seen]
        if missing:
            raise ValueError(f"MTP module model.layers.{first_layer} lacks {missing}")
        self.block.load_weights(block_weights)


def load_mtp_head(checkpoint: Iterable[tuple[str, torch.Tensor]], hf_config: Any,
                  target_spec: ArchSpec, dtype: torch.dtype, device: torch.device,
                  max_model_len: int, backend: AttentionBackend,
                  kernels: KernelConfig) -> tuple[MtpHead, ArchSpec]:
    """The target checkpoint's first MTP module, on `device` in `dtype`."""
    from folio.model.decoder import make_rotaries
    spec = mtp_spec(target_spec)
    with torch.device("meta"):
        head = MtpHead(spec, hf_config, backend, max_model_len, kernels)
    head = head.to(dtype=dtype).to_empty(device=device)
    head.load_weights(checkpoint, target_spec.num_layers)
    with torch.device(device):
        rotaries = make_rotaries(spec, max_model_len, hf_config, kernels)
    head.block.layers[0].self_attn.rotary = rotaries[0]
    head.eval()
    return head, spec
