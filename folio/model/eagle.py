"""EAGLE and EAGLE-3 draft heads (speculative decoding), in the checkpoint formats published for
vLLM and SGLang, built from the shared decoder layers.

Both predict the target's next token from a token and a hidden state at the position before
it: the input at position q is the pair (token q+1, hidden state of q).

- EAGLE (`eagle`, e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): `fc` [H, 2H] (bias optional) maps
  [embedding; target hidden] to H, then `layers.N.*` decoder layers (the first without its
  input norm), no final norm; the output (hidden + residual) feeds both the target's output
  matrix (the head has none) and the next drafting step. The target hidden is the target's
  final, normed hidden state. The embedding is the target's unless the checkpoint has one.
- EAGLE-3 (`eagle3`, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): `fc` [H, 3·Ht] fuses the target's
  residual streams entering three of its layers (`eagle_aux_hidden_state_layer_ids`, by
  default 2, L/2 and L-3) into H; one layer (`midlayer.*`) whose attention reads
  [input_layernorm(embedding); hidden_norm(hidden)] (2H wide); `norm`; its own `lm_head` over
  a smaller draft vocabulary, mapped to the target's by `d2t` (target id = draft id +
  d2t[draft id]). Logits come from the normed output; the next step gets the output before
  the norm. Later steps feed that H-wide state straight to the layer (not through `fc`).
"""
from __future__ import annotations

import glob
import os
from typing import Any

import torch
from torch import nn

from folio.model.attention import AttentionBackend, AttentionMetadata
from folio.model.decoder import _MERGED_SHARDS, DecoderLayer
from folio.model.families import FAMILIES, ArchSpec
from folio.model.kernel_config import DEFAULT_KERNEL_CONFIG, KernelConfig
from folio.model.layers import Linear, MergedLinear, RMSNorm, RotaryEmbedding

EAGLE_METHODS = ("eagle", "eagle3")


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The target layers whose input streams EAGLE-3 reads when the head does not say."""
    return (2, num_target_layers // 2, num_target_layers - 3)


class _NoNorm(nn.Module):
    """EAGLE's first layer has no input norm (its input is fc's output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class EagleHead(nn.Module):
    def __init__(self, method: str, spec: ArchSpec, hf_config: Any, backend: AttentionBackend,
                 max_positions: int, *, target_hidden_size: int, target_vocab_size: int,
                 fc_bias: bool, own_embedding: bool,
                 kernels: KernelConfig = DEFAULT_KERNEL_CONFIG) -> None:
        super().__init__()
        if method not in EAGLE_METHODS:
            raise ValueError(f"unknown EAGLE method {method!r}")
        self.method = method
        self.spec = spec
        self.target_vocab_size = target_vocab_size
        H = spec.hidden_size
        rotary = RotaryEmbedding(spec.head_dim, max(max_positions, 1), hf_config, kernels)
        # None: the target's embedding is used (EagleHead.share_target_weights)
        self.embed_tokens = nn.Embedding(target_vocab_size, H) if own_embedding else None
        # (the target's embedding, its logits function): set by share_target_weights; a
        # tuple, so the target's modules are not registered as this head's
        self._shared: tuple[nn.Module, Any] | None = None
        if method == "eagle":
            self.fc = Linear(2 * H, H, bias=fc_bias, kernels=kernels)
            self.layers = nn.ModuleList(DecoderLayer(spec, rotary, backend, None, kernels)
                                        for _ in range(spec.num_layers))
            self.layers[0].input_layernorm = _NoNorm()
            self.norm = None
            self.lm_head = None
        else:
            self.fc = Linear(3 * target_hidden_size, H, bias=False, kernels=kernels)
            layer = DecoderLayer(spec, rotary, backend, None, kernels)
            attn = layer.self_attn
            # the attention reads [embedding; hidden]: q/k/v over 2H
            attn.qkv_proj = MergedLinear(2 * H, {"q": spec.num_heads * spec.head_dim,
                                                 "k": spec.num_kv_heads * spec.head_dim,
                                                 "v": spec.num_kv_heads * spec.head_dim},
                                         bias=spec.qkv_bias, kernels=kernels)
            layer.hidden_norm = RMSNorm(H, spec.rms_norm_eps, kernels)
            self.layers = nn.ModuleList([layer])
            self.norm = RMSNorm(H, spec.rms_norm_eps, kernels)
            draft_vocab = getattr(hf_config, "draft_vocab_size", None) or target_vocab_size
            self.lm_head = nn.Linear(H, draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
            self.norm_before_residual = bool(getattr(hf_config, "norm_before_residual", False))

    # ---- the target's parts --------------------------------------------------------------

    def share_target_weights(self, target: nn.Module) -> None:
        """The target's embedding (when the head has none) and, for EAGLE, its output
        matrix."""
        self._shared = (target.embed_tokens, target.compute_logits)

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden state(s) at each row as the head's H-wide input: EAGLE-3 fuses
        its three streams ([T, 3·Ht], concatenated in layer order) through fc."""
        return self.fc(target_hidden) if self.method == "eagle3" else target_hidden

    # ---- forward -------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (token q+1, H-wide hidden state of q) at positions q. Returns (the state the
        logits are read from, the state the next drafting step takes)."""
        embedding = self.embed_tokens if self.embed_tokens is not None else self._shared[0]
        embeds = embedding(input_ids)
        if self.method == "eagle":
            x = self.fc(torch.cat([embeds, hidden], dim=-1))
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches):
                x, residual = layer(positions, x, residual, kv_cache, metadata)
            out = x + residual
            return out, out
        layer = self.layers[0]
        embeds = layer.input_layernorm(embeds)
        if self.norm_before_residual:
            h = layer.hidden_norm(hidden)
            residual = h
        else:
            residual = hidden
            h = layer.hidden_norm(hidden)
        x = layer.self_attn(positions, torch.cat([embeds, h], dim=-1), kv_caches[0], metadata)
        x, residual = layer.post_attention_layernorm(x, residual)
        x = layer.mlp(x)
        normed, prenorm = self.norm(x, residual)
        return normed, prenorm

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary (EAGLE-3: draft-vocabulary logits scattered to
        their target ids, -inf elsewhere)."""
        if self.method == "eagle":
            return self._shared[1](hidden)
        draft = self.lm_head(hidden)
        ids = torch.arange(draft.shape[-1], device=draft.device) + self.d2t
        out = draft.new_full((draft.shape[0], self.target_vocab_size), float("-inf"))
        out[:, ids] = draft
        return out

    # ---- weights -------------------------------------------------------------------------

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """The checkpoint's tensors (names as published: `fc.*`, `layers.N.*` or `midlayer.*`,
        `norm.weight`, `lm_head.weight`, `d2t`, optional `embed_tokens.weight`; a `model.`
        prefix is dropped; `t2d` is not needed)."""
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded: set[str] = set()
        for name, tensor in weights.items():
            name = name.removeprefix("model.")
            if name in ("t2d",) or "rotary_emb" in name:
                continue
            name = name.replace("midlayer.", "layers.0.")
            parts = name.split(".")
            merged = _MERGED_SHARDS.get(parts[-2]) if len(parts) >= 2 else None
            if merged is not None:
                path = ".".join(parts[:-2] + [merged[0]])
                module = self.get_submodule(path)
                module.load_shard(merged[1], parts[-1], tensor)
                loaded.add(f"{path}.{parts[-1]}:{merged[1]}")
                continue
            target = params.get(name)
            if target is None:
                target = buffers.get(name)
            if target is None:
                raise ValueError(f"EAGLE head: the checkpoint's {name!r} is not a weight of "
                                 f"an {self.method} head")
            if target.shape != tensor.shape:
                hint = ""
                if name.startswith("fc."):   # its input width is set by the target
                    parts = 3 if self.method == "eagle3" else 2
                    hint = (f" (fc reads {parts} vectors of the target's width "
                            f"{self.fc.in_features // parts}: a head made for another target?)")
                raise ValueError(f"speculative_config.model: EAGLE head: {name} has shape "
                                 f"{tuple(tensor.shape)}, expected {tuple(target.shape)}{hint}")
            with torch.no_grad():
                target.copy_(tensor)
            loaded.add(name)
        missing = []
        for pname, module in self.named_modules():
            if isinstance(module, MergedLinear):
                for shard in module.shard_offsets:
                    if f"{pname}.weight:{shard}" not in loaded:
                        missing.append(f"{pname}.weight:{shard}")
        merged = {f"{n}.weight" for n, m in self.named_modules() if isinstance(m, MergedLinear)}
        missing += [n for n in params if n not in loaded and n not in merged
                    and not n.endswith(".bias")]
        if self.method == "eagle3" and "d2t" not in loaded \
                and self.lm_head.out_features != self.target_vocab_size:
            missing.append("d2t")
        if missing:
            raise ValueError(f"EAGLE head: the checkpoint lacks {missing[:5]}")


def _read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    weights: dict[str, torch.Tensor] = {}
    if files:
        for file in files:
            weights.update(load_file(file))
        return weights
    bins = sorted(glob.glob(os.path.join(path, "*.bin")))
    if not bins:
        raise ValueError(f"EAGLE head {path!r} has no .safetensors or .bin weights")
    for file in bins:
        weights.update(torch.load(file, map_location="cpu", weights_only=True))
    return weights


def load_eagle_head(method: str, path: str, hf_config: Any, target: nn.Module,
                    target_spec: ArchSpec, dtype: torch.dtype, device: torch.device,
                    max_model_len: int, backend: AttentionBackend,
                    kernels: KernelConfig) -> tuple[EagleHead, ArchSpec]:
    """The head in `path` (config.json + weights) for `target`, on `device` in `dtype`."""
    weights = _read_checkpoint(path)
    # heads are Llama layers whatever their config's architectures say
    # (LlamaForCausalLMEagle3, EagleLlamaForCausalLM, ...)
    spec = FAMILIES["LlamaForCausalLM"](hf_config)
    if method == "eagle3" and spec.num_layers != 1:
        raise ValueError(f"speculative_config.model: an EAGLE-3 head has one layer, this one "
                         f"{spec.num_layers}")
    if spec.vocab_size != target_spec.vocab_size:
        raise ValueError(f"speculative_config.model: the head's vocabulary has "
                         f"{spec.vocab_size} tokens, the target's {target_spec.vocab_size}")
    target_hidden = getattr(hf_config, "target_hidden_size", None) or target_spec.hidden_size
    if method == "eagle" and spec.hidden_size != target_spec.hidden_size:
        raise ValueError("speculative_config.model: an EAGLE head's hidden size must be the "
                         f"target's ({target_spec.hidden_size}), got {spec.hidden_size}")
    names = {n.removeprefix("model.") for n in weights}
    head = EagleHead(method, spec, hf_config, backend, max_model_len,
                     target_hidden_size=target_hidden, target_vocab_size=target_spec.vocab_size,
                     fc_bias="fc.bias" in names, own_embedding="embed_tokens.weight" in names,
                     kernels=kernels)
    head.load_weights(weights)
    head = head.to(device=device, dtype=dtype)   # floating tensors only: d2t stays int64
    # as load_model does: the rotary table in float32, the KV scales float32 ones
    with torch.device(device):
        rotary = RotaryEmbedding(spec.head_dim, max(max_model_len, 1), hf_config, kernels)
    for layer in head.layers:
        layer.self_attn.rotary = rotary
        layer.self_attn.reset_kv_scales(device)
    head.share_target_weights(target)
    head.eval()
    return head, spec
