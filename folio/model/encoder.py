"""Bidirectional encoders (BERT, RoBERTa, XLM-R) for the pooling runner.

A step is a flat batch of whole inputs, one per request: attention is bidirectional within a
request and never across requests (encoder_attention.py), and no KV cache is kept (an
encoder's keys depend on the whole input, so nothing could be reused).
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from folio.model.attention import AttentionMetadata
from folio.model.encoder_attention import EncoderLayout, encoder_attention, plan_attention
from folio.model.families import ArchSpec, encoder_position_offset
from folio.model.kernel_config import DEFAULT_KERNEL_CONFIG, KernelConfig
from folio.model.layers import Linear, MergedLinear, gate_activation

# The checkpoint's prefix of the encoder in *ForSequenceClassification (and some saved
# *Model) checkpoints.
_BASE_PREFIXES = ("bert.", "roberta.")
# Checkpoint names within a layer ("encoder.layer.N." stripped) -> (module, merged shard).
_LAYER_NAMES = {
    "attention.self.query": ("qkv_proj", "q"),
    "attention.self.key": ("qkv_proj", "k"),
    "attention.self.value": ("qkv_proj", "v"),
    "attention.output.dense": ("o_proj", None),
    "attention.output.LayerNorm": ("attention_norm", None),
    "intermediate.dense": ("up_proj", None),
    "output.dense": ("down_proj", None),
    "output.LayerNorm": ("output_norm", None),
}
# Older BERT checkpoints (TensorFlow-converted) name LayerNorm's weight and bias gamma, beta.
_LEGACY_NORM = {"gamma": "weight", "beta": "bias"}
_LAYOUT_KEY = "encoder_layout"


def strip_base_prefix(name: str) -> str:
    """A checkpoint name without the bert. / roberta. prefix of the encoder inside a
    classifier."""
    for prefix in _BASE_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def step_layout(metadata: AttentionMetadata, device: torch.device,
                dtype: torch.dtype) -> EncoderLayout:
    """The step's attention plan, built once and kept in metadata.cache for every layer."""
    layout = metadata.cache.get(_LAYOUT_KEY)
    if layout is None:
        layout = metadata.cache[_LAYOUT_KEY] = plan_attention(metadata.query_start_loc,
                                                              device, dtype)
    return layout


class EncoderAttention(nn.Module):
    def __init__(self, spec: ArchSpec, kernels: KernelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        width = spec.num_heads * spec.head_dim
        self.qkv_proj = MergedLinear(spec.hidden_size, {"q": width, "k": width, "v": width},
                                     bias=True, kernels=kernels)
        self.o_proj = Linear(width, spec.hidden_size, bias=True, kernels=kernels)

    def forward(self, hidden: torch.Tensor, layout: EncoderLayout) -> torch.Tensor:
        x = hidden.to(self.o_proj.weight.dtype)
        out = self.o_proj(encoder_attention(self.qkv_proj(x), layout, self.num_heads,
                                            self.head_dim))
        return out.to(hidden.dtype)


class EncoderLayer(nn.Module):
    """Post-LN: norm(x + attention(x)), then norm(x + down(act(up(x))))."""

    def __init__(self, spec: ArchSpec, kernels: KernelConfig) -> None:
        super().__init__()
        self.attention = EncoderAttention(spec, kernels)
        self.attention_norm = nn.LayerNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.up_proj = Linear(spec.hidden_size, spec.intermediate_size, kernels=kernels)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, kernels=kernels)
        self.output_norm = nn.LayerNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.act = gate_activation(spec.hidden_act)

    def forward(self, hidden: torch.Tensor, layout: EncoderLayout) -> torch.Tensor:
        hidden = self.attention_norm(hidden + self.attention(hidden, layout))
        x = hidden.to(self.up_proj.weight.dtype)
        return self.output_norm(hidden + self.down_proj(self.act(self.up_proj(x))).to(hidden.dtype))


class EncoderEmbeddings(nn.Module):
    def __init__(self, spec: ArchSpec, hf_config: Any) -> None:
        super().__init__()
        self.position_offset = encoder_position_offset(hf_config)
        self.word_embeddings = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.position_embeddings = nn.Embedding(
            spec.max_position_embeddings + self.position_offset, spec.hidden_size)
        self.token_type_embeddings = nn.Embedding(
            getattr(hf_config, "type_vocab_size", None) or 1, spec.hidden_size)
        self.LayerNorm = nn.LayerNorm(spec.hidden_size, eps=spec.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(
            positions + self.position_offset)
        if token_type_ids is None:
            hidden = hidden + self.token_type_embeddings.weight[0]
        else:
            hidden = hidden + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(hidden)


class EncoderModel(nn.Module):
    """BertModel / RobertaModel / XLMRobertaModel (the encoder of their
    *ForSequenceClassification too): final hidden states of a flat batch of whole inputs."""

    def __init__(self, spec: ArchSpec, hf_config: Any,
                 kernels: KernelConfig = DEFAULT_KERNEL_CONFIG) -> None:
        super().__init__()
        self.spec = spec
        self.kernel_config = kernels
        self.embeddings = EncoderEmbeddings(spec, hf_config)
        self.layers = nn.ModuleList(EncoderLayer(spec, kernels) for _ in range(spec.num_layers))

    def set_matmul_dtype(self, dtype: torch.dtype) -> None:
        """Keep the layers' projections in `dtype` (their inputs are cast to it and their
        outputs back); the embeddings, norms and residual stream keep the model's dtype."""
        for layer in self.layers:
            for proj in (layer.attention.qkv_proj, layer.attention.o_proj, layer.up_proj,
                         layer.down_proj):
                proj.to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions, token_type_ids: [T]; request i owns rows
        [query_start_loc[i], query_start_loc[i + 1]), its whole input. `kv_caches` is not
        read (the worker's signature for every model). Returns [T, hidden]."""
        if any(metadata.num_computed_tokens):
            raise ValueError("an encoder runs each input whole in one step (no prefix cache, "
                             f"no chunks); num_computed_tokens {metadata.num_computed_tokens}")
        layout = step_layout(metadata, input_ids.device, self.embeddings.LayerNorm.weight.dtype)
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.layers:
            hidden = layer(hidden, layout)
        return hidden

    # ---- weights -------------------------------------------------------------------------

    @staticmethod
    def weight_target(name: str) -> tuple[str, str | None, str] | None:
        """Where checkpoint tensor `name` goes: (module path, merged shard or None, parameter);
        None for what the encoder does not hold (the position_ids buffer, BERT's pooler: a
        head, the Pooler's when a classifier uses it)."""
        name = strip_base_prefix(name)
        if name.startswith("pooler.") or name.endswith("position_ids"):
            return None
        parts = name.split(".")
        attr = _LEGACY_NORM.get(parts[-1], parts[-1]) if "LayerNorm" in name else parts[-1]
        if parts[0] == "embeddings":
            return ".".join(parts[:-1]), None, attr
        if len(parts) > 4 and parts[:2] == ["encoder", "layer"] and parts[2].isdigit():
            found = _LAYER_NAMES.get(".".join(parts[3:-1]))
            if found is not None:
                module, shard = found
                if module in ("qkv_proj", "o_proj"):
                    module = f"attention.{module}"
                return f"layers.{parts[2]}.{module}", shard, attr
        return ".".join(parts[:-1]), None, parts[-1]   # reported as unexpected if unknown

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into the parameters (names with or without the bert. /
        roberta. prefix); a tensor the encoder has no place for, or a parameter the checkpoint
        lacks, is a ValueError naming them."""
        params = dict(self.named_parameters())
        expected: set[str] = set()   # parameters, and each shard of a merged one
        for path, module in self.named_modules():
            for attr, _ in module.named_parameters(recurse=False):
                if isinstance(module, MergedLinear):
                    expected |= {f"{path}.{attr}:{shard}" for shard in module.shard_offsets}
                else:
                    expected.add(f"{path}.{attr}")
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            target = self.weight_target(name)
            if target is None:
                continue
            path, shard, attr = target
            full = f"{path}.{attr}"
            if full not in params:
                unexpected.append(name)
                continue
            if shard is not None:
                self.get_submodule(path).load_shard(shard, attr, tensor)
                loaded.add(f"{full}:{shard}")
                continue
            param = params[full]
            if param.shape != tensor.shape:
                raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(full)
        if unexpected:
            raise ValueError(f"checkpoint has weights this model does not use: {unexpected[:5]}"
                             f"{' ...' if len(unexpected) > 5 else ''}")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks weights: {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}")
