"""Loading a pooling model: the encoder (BERT, RoBERTa, XLM-R) or the decoder, with its Pooler
(model.pooler), from one checkpoint whose tensors are routed between the two."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterator

import torch
from torch import nn

from folio.model.discovery import ModelSource
from folio.model.encoder import EncoderModel, strip_base_prefix
from folio.model.families import ArchSpec, arch_spec_from_hf_config
from folio.model.kernel_config import KernelConfig, resolve_kernel_config
from folio.model.loader import install_rotaries, iter_checkpoint_weights, new_decoder
from folio.model.pooler import HEAD_PREFIXES, Pooler
from folio.pooling_params import PoolingModelInfo


def load_pooling_model(source: ModelSource, hf_config: Any, info: PoolingModelInfo,
                       dtype: torch.dtype, device: torch.device, max_model_len: int,
                       kernel_config: KernelConfig | None = None, *,
                       quantization: str = "none",
                       matmul_dtype: torch.dtype | None = None) -> tuple[nn.Module, ArchSpec]:
    """The model on `device` in `dtype` (its Pooler's head in float32), and the spec it was
    built from; an encoder's projections in `matmul_dtype` when given (encoder_matmul_dtype:
    bfloat16 matmuls beside float32 activations, `--dtype bfloat16` on a CPU). An EncoderModel for the encoders, else a DecoderLM without a language-model
    head (a pooling model computes no logits; a reranker's classifier is made from that head's
    rows, `info.classifier_token_ids`). `kernel_config`: as load_model's."""
    if quantization != "none":
        raise ValueError(f"quantization {quantization!r} is not supported for pooling models "
                         "(they load in the model's dtype only)")
    if info.classifier_from_token and not info.classifier_token_ids:
        raise ValueError("classifier_from_token needs its token ids "
                         "(PoolingModelInfo.classifier_token_ids, from the tokenizer)")
    kernel_config = kernel_config or resolve_kernel_config()
    spec = arch_spec_from_hf_config(hf_config)
    pooler = Pooler(info, hf_config).to(device)
    head_weights: list[tuple[str, torch.Tensor]] = []
    from_lm_head = bool(info.classifier_from_token)
    lm_head_seen = False

    def body_weights() -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint without the head's tensors, which are set aside for the pooler."""
        nonlocal lm_head_seen
        for name, tensor in iter_checkpoint_weights(source):
            if pooler.checkpoint_param(name) is not None:
                head_weights.append((name, tensor))
            elif from_lm_head and name == "lm_head.weight":
                pooler.from_lm_head(tensor)
                lm_head_seen = True
            elif not strip_base_prefix(name).startswith(HEAD_PREFIXES):
                yield name, tensor
            # else: a head this model does not run (BertModel's pooler in an embedding model)

    if spec.is_encoder:
        with torch.device("meta"):   # as new_decoder: no random init, materialised once
            model: nn.Module = EncoderModel(spec, hf_config, kernel_config)
        model = model.to(dtype=dtype).to_empty(device=device)
        model.load_weights(body_weights())
        if matmul_dtype is not None and matmul_dtype != dtype:
            model.set_matmul_dtype(matmul_dtype)
    else:
        # no lm_head built: DecoderLM skips the checkpoint's (the reranker took its rows above)
        spec = replace(spec, tie_word_embeddings=True)
        model = new_decoder(spec, hf_config, device, max_model_len, kernel_config)
        model = model.to(dtype=dtype).to_empty(device=device)
        model.load_weights(body_weights())
        install_rotaries(model, hf_config, device, max_model_len)
        if from_lm_head and not lm_head_seen:
            if not getattr(hf_config, "tie_word_embeddings", False):
                raise ValueError("checkpoint lacks lm_head.weight, which classifier_from_token "
                                 "reads")
            pooler.from_lm_head(model.embed_tokens.weight)   # tied: the embedding is the head
    pooler.load_weights(head_weights)
    model.pooler = pooler
    model.eval()
    return model, spec


def encoder_matmul_dtype(requested: str, device: torch.device,
                         spec: ArchSpec) -> torch.dtype | None:
    """`--dtype bfloat16` for an encoder on a CPU with native bfloat16 matmuls (AMX or
    AVX512-BF16): its projections in bfloat16, everything else (embeddings, LayerNorm, the
    residual stream, attention) in float32 — the projections are where bfloat16's speed is
    (about 3x float32's matmuls on this CPU), and the float32 rest keeps MiniLM within cosine
    0.99996 of sentence-transformers' float32 over 1,000 standard-library docstrings, where an
    all-bfloat16 run reaches 0.99992 (0.99990 on the tests' texts on a CPU without native
    bfloat16, which runs it so). None: one dtype throughout (the default, `auto`, keeps a
    float32 checkpoint exact)."""
    if requested not in ("bfloat16", "bf16") or device.type != "cpu" or not spec.is_encoder:
        return None
    native = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)() or \
        getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    return torch.bfloat16 if native else None
