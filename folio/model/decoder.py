"""The decoder-only transformer every supported family is built from."""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from folio.model.attention import AttentionBackend, AttentionMetadata
from folio.model.cpu_layer import CpuLayerRunner
from folio.model.families import ArchSpec
from folio.model.kernel_config import DEFAULT_KERNEL_CONFIG, KernelConfig
from folio.model.layers import Attention, GatedMLP, Linear, RMSNorm, RotaryEmbedding
from folio.model.mla import MLAttention
from folio.model.moe.layer import EXPERT_SHARDS, SparseMoeBlock
from folio.model.pipeline_parallel import WHOLE, PPStage
from folio.model.quant.formats import QUANTIZED_TENSOR_NAMES
from folio.model.tensor_parallel import (SINGLE, TPGroup, VocabParallelEmbedding, read_part,
                                         shard_of_checkpoint, vocab_part)

# Checkpoint names of projections that folio stores merged: (merged module, shard).
_MERGED_SHARDS = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
}
# Checkpoint names of the FP8 KV cache scales, past "self_attn.", and the Attention buffer each
# loads (Attention.load_kv_scale): compressed-tensors' kv_cache_scheme (vLLM's own names),
# older FP8 checkpoints' k/v_proj output_scale, ModelOpt's, and the deprecated single kv_scale
# (both scales, as vLLM reads it).
_KV_SCALE_NAMES = {
    "k_scale": "k_scale", "v_scale": "v_scale", "kv_scale": "kv_scale",
    "k_proj.output_scale": "k_scale", "v_proj.output_scale": "v_scale",
    "k_proj.k_scale": "k_scale", "v_proj.v_scale": "v_scale",
    "attn.k_scale": "k_scale", "attn.v_scale": "v_scale",   # vLLM's own parameter names
}
_KV_SCALE_ATTRS = frozenset(_KV_SCALE_NAMES.values())
# Scales of quantized attention arithmetic (FP8 queries, probabilities): folio's attention
# keeps both in the model's dtype, so a checkpoint's are not read.
_UNUSED_ATTN_SCALES = ("q_scale", "prob_scale")


def make_mlp(spec: ArchSpec, layer_idx: int, kernels: KernelConfig) -> nn.Module:
    """Layer `layer_idx`'s MLP: the mixture of experts where the spec places one, else the
    dense gated MLP."""
    if spec.moe is not None and spec.moe.sparse_layers[layer_idx]:
        return SparseMoeBlock(spec, kernels)
    return GatedMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias, spec.hidden_act,
                    kernels)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ArchSpec, rotary: RotaryEmbedding, backend: AttentionBackend,
                 sliding_window: int | None,
                 kernels: KernelConfig = DEFAULT_KERNEL_CONFIG, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels)
        if spec.mla is not None:
            self.self_attn = MLAttention(spec, rotary, backend, kernels)
        else:
            self.self_attn = Attention(
                hidden_size=spec.hidden_size, num_heads=spec.num_heads,
                num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, qkv_bias=spec.qkv_bias,
                o_bias=spec.o_bias, qk_norm=spec.qk_norm, rms_norm_eps=spec.rms_norm_eps,
                rotary=rotary, backend=backend, sliding_window=sliding_window, kernels=kernels,
                scale=spec.attn_scale, logits_soft_cap=spec.attn_logit_softcapping,
                sinks=spec.attention_sinks)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels)
        self.mlp = make_mlp(spec, layer_idx, kernels)
        # The whole layer as one C++ call on the CPU where it qualifies (folio.model.cpu_layer)
        self.cpu_runner = CpuLayerRunner()

    @property
    def _qkv_proj(self) -> Linear | None:
        """The projection the input norm feeds, where it may take QuantizedRows."""
        return self.self_attn.qkv_proj if isinstance(self.self_attn, Attention) else None

    @property
    def _dense_mlp(self) -> GatedMLP | None:
        """The MLP the post-attention norm feeds, where it may take QuantizedRows."""
        return self.mlp if isinstance(self.mlp, GatedMLP) else None

    def _input_norm(self, hidden, residual):
        """The input norm, adding the previous layer's output to the stream first (the
        first layer's input is the stream itself)."""
        if residual is None:
            return self.input_layernorm(hidden), hidden
        return self.input_layernorm(hidden, residual)

    @staticmethod
    def _norm_into(norm: nn.Module, consumer: Linear | GatedMLP | None, hidden, residual):
        """norm(hidden (+ residual)) and the stream, as _input_norm gives them; handed to
        `consumer` already quantized (QuantizedRows) where it would quantize its input per
        token (a W8A8 projection at prefill rows): one launch instead of two, and the 16-bit
        rows are never written. Only folio's RMSNorm does this (EAGLE's head has no input
        norm); a bf16 model pays one attribute check."""
        dtype = None if consumer is None else consumer.quantized_input_dtype(hidden)
        if dtype is not None and isinstance(norm, RMSNorm) and norm.quantized_output_ok(hidden):
            rows, stream = norm.forward_quantized(hidden, residual, dtype)
            return rows, hidden if residual is None else stream
        if residual is None:
            return norm(hidden), hidden
        return norm(hidden, residual)

    def forward(self, positions, hidden, residual, kv_cache, metadata):
        if not hidden.is_cuda:
            out = self.cpu_runner.run(self, positions, hidden, residual, kv_cache, metadata)
            if out is not None:
                return out
        hidden, residual, _ = self.forward_chained(positions, hidden, residual, kv_cache,
                                                   metadata, False, None, None)
        return hidden, residual

    def forward_chained(self, positions, hidden, residual, kv_cache, metadata, normed: bool,
                        next_norm: RMSNorm | None, next_qkv: Linear | None):
        """`forward`'s body (past the CPU's whole-layer call), also for a run of layers
        (DecoderLM.run_layers, CUDA): `normed` says
        hidden is already this layer's input norm's output (the layer before ended with it),
        and with `next_norm` (the next layer's input norm, which feeds `next_qkv`) the MLP's
        down projection ends with it where its GEMV serves. Returns (hidden, residual,
        whether hidden is the next layer's normed input)."""
        if not normed:
            hidden, residual = self._norm_into(self.input_layernorm, self._qkv_proj, hidden,
                                               residual)
        hidden, residual = self._attention_into_mlp(positions, hidden, residual, kv_cache,
                                                    metadata)
        if next_norm is not None and isinstance(self.mlp, GatedMLP) and (
                next_qkv is None or next_qkv.quantized_input_dtype(residual) is None):
            out, stream = self.mlp.forward_add_norm(hidden, residual, next_norm)
            return (out, stream, True) if stream is not None else (out, residual, False)
        return self.mlp(hidden), residual, False

    def _attention_into_mlp(self, positions, hidden, residual, kv_cache, metadata):
        """The attention, then the post-attention norm with the stream added: at decode rows
        the norm ends o_proj's GEMV launch (Linear.forward_add_norm), unless the MLP wants
        its input quantized per token by the norm (QuantizedRows, prefill rows)."""
        attn, mlp = self.self_attn, self._dense_mlp
        if isinstance(attn, Attention) and (mlp is None
                                            or mlp.quantized_input_dtype(residual) is None):
            heads = attn.attend(positions, hidden, kv_cache, metadata)
            fused = attn.o_proj.forward_add_norm(heads, residual, self.post_attention_layernorm)
            if fused is not None:
                return fused
            hidden = attn.o_proj(heads)
        else:
            hidden = attn(positions, hidden, kv_cache, metadata)
        return self._norm_into(self.post_attention_layernorm, mlp, hidden, residual)


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2/3's layer: besides the input norm, a norm on the attention's output before it
    joins the stream, and norms before and after the MLP. Returns (the MLP's normed output,
    the stream before it), so the next layer's input norm adds the two, as DecoderLayer's
    callers expect."""

    def __init__(self, spec: ArchSpec, rotary: RotaryEmbedding, backend: AttentionBackend,
                 sliding_window: int | None,
                 kernels: KernelConfig = DEFAULT_KERNEL_CONFIG, layer_idx: int = 0) -> None:
        super().__init__(spec, rotary, backend, sliding_window, kernels, layer_idx)
        self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels)
        self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels)

    def forward(self, positions, hidden, residual, kv_cache, metadata):
        hidden, residual = self._input_norm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache,
                                                              metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


def make_rotaries(spec: ArchSpec, max_positions: int, hf_config: Any,
                  kernels: KernelConfig) -> list[RotaryEmbedding]:
    """Each layer's rotary table: one shared by all layers, or one per distinct set of
    parameters (Gemma 3's local and global bases). They are buffers, not weights."""
    if not spec.layer_rope_parameters:
        rotary = RotaryEmbedding(spec.head_dim, max(max_positions, 1), hf_config, kernels)
        return [rotary] * spec.num_layers
    tables: dict[str, RotaryEmbedding] = {}
    out = []
    for params in spec.layer_rope_parameters:
        key = repr(sorted(params.items()))
        if key not in tables:
            tables[key] = RotaryEmbedding(spec.head_dim, max(max_positions, 1), hf_config,
                                          kernels, params=params)
        out.append(tables[key])
    return out


class MissingLayer(nn.Module):
    """A layer another pipeline stage holds: keeps the layer indices (and the checkpoint's
    names) of this stage's layers as they are; never run."""


class DecoderLM(nn.Module):
    def __init__(self, spec: ArchSpec, hf_config: Any, backend: AttentionBackend,
                 max_positions: int, kernels: KernelConfig = DEFAULT_KERNEL_CONFIG,
                 tp: TPGroup = SINGLE, pp: PPStage = WHOLE) -> None:
        """`kernels`: the kernel choices every layer is built with (load_model resolves them
        from the environment once; the backend should have been picked from the same config).
        `tp`: this rank's tensor-parallel group; `spec` is then the rank's local spec
        (tensor_parallel.local_spec), and the embedding and output matrix hold its
        vocabulary rows. `pp`: this rank's pipeline stage: only its layers are built (and
        the embedding on the first stage, the final norm and output matrix on the last)."""
        super().__init__()
        self.spec = spec
        self.kernel_config = kernels
        self.tp = tp
        self.pp = pp
        rotaries = make_rotaries(spec, max_positions, hf_config, kernels)
        # The embedding: the first stage's input, and the last stage's output matrix if tied.
        self.embed_tokens = None
        if pp.is_first or (pp.is_last and spec.tie_word_embeddings):
            self.embed_tokens = (nn.Embedding(spec.vocab_size, spec.hidden_size)
                                 if not tp.sharded else VocabParallelEmbedding(spec.vocab_size, spec.hidden_size,
                                                             tp))
        windows = spec.sliding_windows or (None,) * spec.num_layers
        layer_type = SandwichDecoderLayer if spec.sandwich_norms else DecoderLayer
        self.layers = nn.ModuleList(
            layer_type(spec, rotaries[i], backend, windows[i], kernels, i) if pp.owns(i)
            else MissingLayer() for i in range(spec.num_layers))
        # This stage's layers, in order (with kv_caches[j] the cache of the j-th of them).
        self.stage_layers = [i for i in range(spec.num_layers) if pp.owns(i)]
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels) if pp.is_last else None
        self.lm_head = None if spec.tie_word_embeddings or not pp.is_last else nn.Linear(
            spec.hidden_size, vocab_part(spec.vocab_size, tp).size, bias=False)
        if self.lm_head is not None and tp.sharded:
            self.lm_head.tp_vocab = spec.vocab_size   # its rows: this rank's vocabulary
        # The output matrix as packed planes (folio.model.quant, CPU), when it is kept
        # quantized; None = the float weight.
        self.lm_head_packed: nn.Module | None = None
        # Whether the checkpoint held FP8 KV cache scales (load_weights), for the start-up log.
        self.kv_scales_loaded = False
        # Layers whose input residual stream each forward keeps in `aux_hidden_states`, in
        # this order (an EAGLE-3 draft head reads them; empty = none kept).
        self.aux_hidden_layers: tuple[int, ...] = ()
        self.aux_hidden_states: list[torch.Tensor] = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | None:
        """Flat batch in, final hidden states out ([T, hidden]); logits are computed only for
        the rows that need them (compute_logits). `kv_caches`: this stage's layers' caches.
        `inputs_embeds`: the input embeddings when they are not all the tokens' (an image's
        features at its placeholder tokens; `embed`). A pipeline stage before the last sends
        its residual stream on and returns None."""
        pp = self.pp
        if pp.is_first:
            hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            hidden, residual = pp.receive(input_ids.shape[0], self.spec.hidden_size,
                                          self.norm_dtype(), input_ids.device)
        aux = self.aux_hidden_layers
        if aux:
            kept: dict[int, torch.Tensor] = {}
            for i, kv_cache in zip(self.stage_layers, kv_caches):
                if i in aux:
                    kept[i] = hidden if residual is None else hidden + residual
                hidden, residual = self.layers[i](positions, hidden, residual, kv_cache,
                                                  metadata)
            self.aux_hidden_states = [kept[i] for i in aux]
        else:
            hidden, residual = self.run_layers(0, len(self.stage_layers), positions, hidden,
                                               residual, kv_caches, metadata)
        if not pp.is_last:
            pp.send(hidden, residual)
            return None
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def run_layers(self, first: int, last: int, positions: torch.Tensor, hidden: torch.Tensor,
                   residual: torch.Tensor | None, kv_caches: list[torch.Tensor],
                   metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This stage's layers first..last-1 (indices into stage_layers, whose caches are
        kv_caches[first:last]) on the residual stream (hidden, residual); residual is None
        before the first layer. The forward between the embedding and the final norm, or a
        piece of it (worker/mixed_graphs.py captures small steps as several graphs)."""
        chain = self._norm_chain(hidden)
        normed = False
        for j in range(first, last):
            layer = self.layers[self.stage_layers[j]]
            link = chain[j] if chain is not None and j + 1 < last else None
            if link is None and not normed:
                hidden, residual = layer(positions, hidden, residual, kv_caches[j], metadata)
                continue
            next_norm, next_qkv = link if link is not None else (None, None)
            hidden, residual, normed = layer.forward_chained(
                positions, hidden, residual, kv_caches[j], metadata, normed, next_norm,
                next_qkv)
        return hidden, residual

    def _norm_chain(self, hidden: torch.Tensor
                    ) -> list[tuple[RMSNorm, Linear | None] | None] | None:
        """Per stage layer j: (the next layer's input norm, the projection it feeds) where
        layer j's down projection may end with that norm (both plain decoder layers, the
        skinny GEMV's norm epilogue on: KernelConfig.gemv_norm_on), else None. Built once;
        None off CUDA (the epilogue is a CUDA kernel, and the CPU runs whole layers in C++)."""
        if not hidden.is_cuda:
            return None
        chain = self.__dict__.get("_chain")
        if chain is None:
            on = self.kernel_config.gemv_norm_on
            layers = [self.layers[i] for i in self.stage_layers]
            chain = [(b.input_layernorm, b._qkv_proj)
                     if on and type(a) is DecoderLayer and type(b) is DecoderLayer
                     and type(b.input_layernorm) is RMSNorm else None
                     for a, b in zip(layers, layers[1:])] + [None]
            self.__dict__["_chain"] = chain
        return chain

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' input embeddings."""
        hidden = self.embed_tokens(input_ids)
        if self.spec.embed_scale != 1.0:
            # Gemma: the scale rounded to the activations' dtype first, as transformers does
            hidden = hidden * torch.tensor(self.spec.embed_scale, dtype=hidden.dtype)
        return hidden

    def norm_dtype(self) -> torch.dtype:
        """The activations' dtype (a later stage has no embedding to read it from); found
        once, not per step (the weights keep their dtype)."""
        dtype = self.__dict__.get("_act_dtype")
        if dtype is None:
            dtype = next((p.dtype for p in self.parameters()
                          if p.is_floating_point() and p.element_size() == 2), torch.float32)
            self.__dict__["_act_dtype"] = dtype
        return dtype

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_packed is not None:
            logits = self.lm_head_packed(hidden)
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = hidden @ weight.t()
            if self.tp.sharded:   # each rank's vocabulary rows, side by side
                logits = self.tp.all_gather_last(logits)[..., :self.spec.vocab_size]
        cap = self.spec.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ---- weights -------------------------------------------------------------------------

    def _module_paths(self) -> frozenset[str]:
        """Every submodule's path, built once (the module tree is fixed after __init__)."""
        paths = self.__dict__.get("_paths")
        if paths is None:
            paths = frozenset(name for name, _ in self.named_modules())
            self.__dict__["_paths"] = paths
        return paths

    def weight_target(self, name: str) -> tuple[str, str | None, str] | None:
        """Where checkpoint tensor `name` goes: (module path, shard of a merged module or None,
        parameter name); None for what folio does not load (derived rotary buffers, a tied
        lm_head, attention scales it does not use). A KV cache scale goes to its Attention:
        (path, None, "k_scale" / "v_scale" / "kv_scale")."""
        if "rotary_emb" in name:
            return None  # derived buffers some checkpoints carry
        name = name.removeprefix("model.") if not name.startswith("lm_head") else name
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied (the embedding is the output matrix), or not this stage's
        if (name.startswith("embed_tokens.") and self.embed_tokens is None) \
                or (name == "norm.weight" and self.norm is None):
            return None  # another pipeline stage's
        layer, sep, rest = name.partition(".self_attn.")
        if sep and rest in _KV_SCALE_NAMES:
            return f"{layer}.self_attn", None, _KV_SCALE_NAMES[rest]
        if sep and rest in _UNUSED_ATTN_SCALES:
            return None
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's MoE block
        name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")  # DeepSeek's
        name = name.replace(".mlp.router.", ".mlp.gate.")  # GPT-OSS's router
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit() \
                and int(parts[1]) < self.spec.num_layers and not self.pp.owns(int(parts[1])):
            return None  # another pipeline stage's layer
        if self.spec.num_mtp_layers and len(parts) > 2 and parts[0] == "layers" \
                and parts[1].isdigit() and int(parts[1]) >= self.spec.num_layers:
            return None  # a multi-token-prediction module, not a decoder layer
        if len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit() \
                and parts[-2] in EXPERT_SHARDS:
            # one expert's projection, into its slice of the stacked weights (FusedMoE)
            param, part = EXPERT_SHARDS[parts[-2]]
            return ".".join(parts[:-3]), f"{parts[-3]}.{part}", param
        merged = _MERGED_SHARDS.get(parts[-2]) if len(parts) >= 2 else None
        if merged is not None and ".".join(parts[:-1]) not in self._module_paths():
            # a projection folio stores merged (a layer with its own module of that name,
            # such as latent attention's q_proj, loads it as it is)
            return ".".join(parts[:-2] + [merged[0]]), merged[1], parts[-1]
        return ".".join(parts[:-1]), None, parts[-1]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     preloaded: Iterable[str] = ()) -> None:
        """Copy checkpoint tensors into the parameters; `preloaded`: checkpoint names whose
        weights were installed otherwise (packed planes, int8 codes), counted as loaded. It is
        read once `weights` is consumed, so a loader that takes tensors out of the stream (int8
        quantization on load) can fill it as it goes. The FP8 KV cache scales are optional:
        1.0 unless the checkpoint has them (vLLM's default)."""
        params = dict(self.named_parameters())
        attentions = {name: m for name, m in self.named_modules() if isinstance(m, Attention)}
        device = next(iter(params.values())).device
        for attention in attentions.values():
            attention.reset_kv_scales(device)
        self.kv_scales_loaded = False
        loaded: set[str] = set()
        unexpected: list[str] = []
        # lazy checkpoint tensors: each rank reads only its slice (or its stage's tensors)
        sharded = self.tp.sharded or self.pp.size > 1
        for name, tensor in weights:
            target = self.weight_target(name)
            if target is None:
                continue
            module_path, shard, attr = target
            if sharded:   # this rank's slice (a lazy checkpoint tensor reads only that)
                try:
                    owner = self.get_submodule(module_path) if module_path else self
                except AttributeError:   # not a weight of this model: reported below
                    owner = None
                tensor = (read_part(tensor, 0, None) if owner is None else
                          shard_of_checkpoint(owner, attr, shard, tensor, self.tp))
            if attr in _KV_SCALE_ATTRS and shard is None:
                if module_path not in attentions:
                    unexpected.append(name)
                    continue
                attentions[module_path].load_kv_scale(attr, tensor, name)
                self.kv_scales_loaded = True
                continue
            if shard is not None:
                full = f"{module_path}.{attr}"
                if full not in params:
                    unexpected.append(name)
                    continue
                self.get_submodule(module_path).load_shard(shard, attr, tensor)
                loaded.add(f"{full}:{shard}")
                continue
            name = f"{module_path}.{attr}"
            if name not in params:
                unexpected.append(name)
                continue
            param = params[name]
            module = self.get_submodule(module_path) if module_path else self
            if hasattr(module, "convert_checkpoint_tensor"):
                tensor = module.convert_checkpoint_tensor(attr, tensor)  # stacked experts
            if param.shape != tensor.shape:
                raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            if self.spec.norm_offset and name.endswith("norm.weight"):
                # Gemma's norms scale by 1 + w: stored here as the scale itself
                tensor = tensor.float() + self.spec.norm_offset
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
            if hasattr(module, "checkpoint_shards"):
                # a checkpoint that stores the projections fused (Phi-3's qkv_proj,
                # gate_up_proj; stacked experts), in the merged module's shard order
                loaded.update(f"{module_path}.{attr}:{shard}"
                              for shard in module.checkpoint_shards().get(attr, ()))
        for name in preloaded:
            target = self.weight_target(name)
            if target is not None:
                path, shard, attr = target
                loaded.add(f"{path}.{attr}" + (f":{shard}" if shard else ""))
        if unexpected:
            hint = ""
            if any(n.rsplit(".", 1)[-1] in QUANTIZED_TENSOR_NAMES for n in unexpected):
                hint = (" (quantized tensors of projections read as float: the config.json "
                        "quantization_config's targets or ignore list leave them out, or "
                        "there is none)")
            raise ValueError(f"checkpoint has weights this model does not use: {unexpected[:5]}"
                             f"{' ...' if len(unexpected) > 5 else ''}{hint}")
        missing = []
        merged_names = set()
        for pname, module in self.named_modules():
            if hasattr(module, "checkpoint_shards"):
                for attr, shards in module.checkpoint_shards().items():
                    merged_names.add(f"{pname}.{attr}")
                    missing += [f"{pname}.{attr}:{shard}" for shard in shards
                                if f"{pname}.{attr}:{shard}" not in loaded]
        missing += [n for n in params if n not in loaded and n not in merged_names]
        if missing:
            raise ValueError(f"checkpoint lacks weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        for module in self.modules():
            if hasattr(module, "after_load"):  # layouts fixed once the weights are in (MLA)
                module.after_load()
