"""A CLIP vision tower and LLaVA's projector (LLaVA-1.5-style vision-language models): an
image's patches -> the decoder's hidden size, one feature per patch.

The tower runs only the layers the selected feature layer needs (LLaVA reads the
second-to-last layer: the last one is never run), on whole images (every image of a model has
the same number of patches, so a batch of images is one [images, patches, hidden] tensor and
attention is plain bidirectional SDPA). Parameter names follow transformers' CLIPVisionModel
and LlavaMultiModalProjector, so checkpoints load by name (`load_llava_vision`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from folio.model.vision.weights import load_by_name


@dataclass(frozen=True)
class ClipVisionSpec:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    num_channels: int = 3

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, cfg: Any) -> "ClipVisionSpec":
        return cls(cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
                   cfg.num_attention_heads, cfg.image_size, cfg.patch_size,
                   cfg.layer_norm_eps, cfg.hidden_act, getattr(cfg, "num_channels", 3))


def _activation(name: str):
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name in ("gelu", "gelu_pytorch_tanh", "gelu_new"):
        approximate = "none" if name == "gelu" else "tanh"
        return lambda x: F.gelu(x, approximate=approximate)
    raise ValueError(f"vision activation {name!r} is not supported")


class _Embeddings(nn.Module):
    def __init__(self, spec: ClipVisionSpec) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(spec.hidden_size))
        self.patch_embedding = nn.Conv2d(spec.num_channels, spec.hidden_size, spec.patch_size,
                                         stride=spec.patch_size, bias=False)
        self.position_embedding = nn.Embedding(spec.num_patches + 1, spec.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)             # [images, patches, hidden]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class _Attention(nn.Module):
    def __init__(self, spec: ClipVisionSpec) -> None:
        super().__init__()
        d = spec.hidden_size
        self.num_heads = spec.num_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.num_heads

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, h, d // h).transpose(1, 2)
        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)),
                                             heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(b, t, d))


class _MLP(nn.Module):
    def __init__(self, spec: ClipVisionSpec) -> None:
        super().__init__()
        self.fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size)
        self.act = _activation(spec.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, spec: ClipVisionSpec) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.self_attn = _Attention(spec)
        self.layer_norm2 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.mlp = _MLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


def _needed_layers(feature_layers: list[int], num_layers: int) -> int:
    """How many encoder layers produce the hidden states `feature_layers` index (hidden
    state i is the output of layer i; 0 is the embeddings; negatives count from the end)."""
    indices = [i if i >= 0 else num_layers + 1 + i for i in feature_layers]
    if not all(0 <= i <= num_layers for i in indices):
        raise ValueError(f"vision_feature_layer {feature_layers} is outside the tower's "
                         f"{num_layers} layers")
    return max(indices)


class LlavaVisionEncoder(nn.Module):
    """Pixels [images, channels, H, W] -> image features [images, patches, text hidden]."""

    def __init__(self, spec: ClipVisionSpec, text_hidden_size: int,
                 feature_layer: int | list[int] = -2, select_strategy: str = "default",
                 projector_act: str = "gelu", projector_bias: bool = True) -> None:
        super().__init__()
        if select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {select_strategy!r} is not "
                             "supported (default, full)")
        self.spec = spec
        self.feature_layers = [feature_layer] if isinstance(feature_layer, int) \
            else list(feature_layer)
        self.select_strategy = select_strategy
        self.indices = [i if i >= 0 else spec.num_layers + 1 + i for i in self.feature_layers]
        self.embeddings = _Embeddings(spec)
        self.pre_layrnorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.layers = nn.ModuleList(
            _Layer(spec) for _ in range(_needed_layers(self.feature_layers, spec.num_layers)))
        width = spec.hidden_size * len(self.feature_layers)
        self.linear_1 = nn.Linear(width, text_hidden_size, bias=projector_bias)
        self.projector_act = _activation(projector_act)
        self.linear_2 = nn.Linear(text_hidden_size, text_hidden_size, bias=projector_bias)

    @property
    def tokens_per_image(self) -> int:
        return self.spec.num_patches + (1 if self.select_strategy == "full" else 0)

    @property
    def largest_image_tokens(self) -> int:
        return self.tokens_per_image        # every image is resized to one size

    def encode_batch(self, pixels: list[torch.Tensor], grids: list) -> list[torch.Tensor]:
        """Each image's features; images of one pixel shape run as one batch."""
        out: list[torch.Tensor | None] = [None] * len(pixels)
        by_shape: dict[tuple, list[int]] = {}
        for i, p in enumerate(pixels):
            by_shape.setdefault(tuple(p.shape), []).append(i)
        for indices in by_shape.values():
            features = self(torch.stack([pixels[i] for i in indices]))
            for i, feature in zip(indices, features):
                out[i] = feature
        return out

    def profile_batch(self, tokens: int) -> tuple[list[torch.Tensor], list]:
        """Blank images, `tokens` features in all (at least one), for the memory profile."""
        weight = self.linear_1.weight
        count = max(1, tokens // self.tokens_per_image)
        shape = (self.spec.num_channels, self.spec.image_size, self.spec.image_size)
        return [torch.zeros(shape, dtype=weight.dtype, device=weight.device)] * count, \
            [None] * count

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [hidden]
        for layer in self.layers:
            hidden = layer(hidden)
            states.append(hidden)
        picked = [states[i] for i in self.indices]
        if self.select_strategy == "default":
            picked = [s[:, 1:] for s in picked]              # the CLS token is dropped
        features = torch.cat(picked, dim=-1) if len(picked) > 1 else picked[0]
        return self.linear_2(self.projector_act(self.linear_1(features)))

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> "LlavaVisionEncoder":
        return cls(ClipVisionSpec.from_hf(hf_config.vision_config),
                   hf_config.text_config.hidden_size, hf_config.vision_feature_layer,
                   hf_config.vision_feature_select_strategy,
                   getattr(hf_config, "projector_hidden_act", "gelu"),
                   getattr(hf_config, "multimodal_projector_bias", True))


# Checkpoint prefixes of the tower and the projector: transformers 5's layouts (with and
# without the CLIPVisionModel's vision_model), and the older one of llava-hf checkpoints.
_TOWER_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.",
                   "model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def load_llava_vision(encoder: LlavaVisionEncoder,
                      tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Copy the tower's and the projector's weights from a LLaVA checkpoint's (name,
    tensor) pairs; names of other parts are skipped, and so are the tower's layers past the
    feature layer and its post-layernorm (never run). Returns the parameters not found."""
    def local(name: str) -> str | None:
        for prefix in _TOWER_PREFIXES:
            if name.startswith(prefix):
                return name[len(prefix):].replace("encoder.layers.", "layers.")
        for prefix in _PROJECTOR_PREFIXES:
            if name.startswith(prefix):
                return name[len(prefix):]
        return None
    return load_by_name(encoder, tensors, local)
