"""Qwen2-VL's and Qwen2.5-VL's vision transformers (issue 24): an image's patches (each a
temporal pair of 14 x 14 RGB squares, flattened by the processor) -> one feature per 2 x 2
block of patches, in the decoder's hidden size.

Patches are embedded by a linear map (the checkpoint's Conv3d, whose kernel equals its
stride, is one); each block adds 2D rotary positions (the patch's row on the first quarter
of each head's frequencies, its column on the second) to bidirectional attention that sees
only its own image's patches; the merger concatenates each 2 x 2 block (the processor lays
patches out block by block) and projects it. Images of any size batch together: their
patches are concatenated, attention runs per image (per frame pair of a video).

Qwen2.5-VL differs in the blocks (RMSNorm, a gated SiLU MLP) and in window attention: all
blocks but `fullatt_block_indexes` attend within windows of `window_size` pixels (whole 2 x 2
blocks); the patches are reordered window by window before the blocks and the merged
features put back in the image's order after the merger. Parameter names follow
transformers' vision models, so checkpoints load by name (`load_qwen2_vision`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from folio.model.layers import RMSNorm
from folio.model.vision.clip_vision import _activation
from folio.model.vision.weights import load_by_name


@dataclass(frozen=True)
class Qwen2VisionSpec:
    depth: int
    embed_dim: int
    out_hidden_size: int        # the decoder's hidden size (the merger's output)
    num_heads: int
    mlp_hidden: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    hidden_act: str = "quick_gelu"
    rope_theta: float = 10000.0
    # Qwen2.5-VL: RMSNorm and a gated MLP; window attention except in these blocks
    qwen2_5: bool = False
    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_hf(cls, cfg: Any) -> "Qwen2VisionSpec":
        rope = getattr(cfg, "rope_parameters", None) or {}
        common = dict(patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size,
                      spatial_merge_size=cfg.spatial_merge_size,
                      in_channels=getattr(cfg, "in_channels", getattr(cfg, "in_chans", 3)),
                      hidden_act=cfg.hidden_act,
                      rope_theta=float(rope.get("rope_theta", 10000.0)))
        if hasattr(cfg, "fullatt_block_indexes"):           # Qwen2.5-VL
            return cls(cfg.depth, cfg.hidden_size, cfg.out_hidden_size, cfg.num_heads,
                       cfg.intermediate_size, qwen2_5=True, window_size=cfg.window_size,
                       fullatt_block_indexes=tuple(cfg.fullatt_block_indexes), **common)
        return cls(cfg.depth, cfg.embed_dim, cfg.hidden_size, cfg.num_heads,
                   int(cfg.embed_dim * cfg.mlp_ratio), **common)


def patch_positions(grid: Sequence[int], merge: int) -> torch.Tensor:
    """[patches, 2] (row, column) of an image's patches in the processor's order: frames,
    then merge x merge blocks row-major, then the patches of a block row-major."""
    t, h, w = grid
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    rows = rows.permute(0, 2, 1, 3).reshape(-1)
    cols = cols.permute(0, 2, 1, 3).reshape(-1)
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)


class _Attention(nn.Module):
    def __init__(self, spec: Qwen2VisionSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.qkv = nn.Linear(spec.embed_dim, 3 * spec.embed_dim)
        self.proj = nn.Linear(spec.embed_dim, spec.embed_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        n, d = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, d // self.num_heads).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = []
        start = 0
        for length in lengths:                     # each image sees only its own patches
            part = slice(start, start + length)
            out.append(F.scaled_dot_product_attention(
                q[part].transpose(0, 1), k[part].transpose(0, 1),
                v[part].transpose(0, 1)).transpose(0, 1))
            start += length
        return self.proj(torch.cat(out).reshape(n, d))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions, halves rotated, computed in float32 as transformers does."""
    dtype = x.dtype
    x = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(dtype)


def _norm(spec: Qwen2VisionSpec, dim: int) -> nn.Module:
    return RMSNorm(dim, eps=1e-6) if spec.qwen2_5 else nn.LayerNorm(dim, eps=1e-6)


class _Block(nn.Module):
    def __init__(self, spec: Qwen2VisionSpec) -> None:
        super().__init__()
        self.norm1 = _norm(spec, spec.embed_dim)
        self.norm2 = _norm(spec, spec.embed_dim)
        self.attn = _Attention(spec)
        self.mlp = nn.Module()
        self.gated = spec.qwen2_5
        if self.gated:
            self.mlp.gate_proj = nn.Linear(spec.embed_dim, spec.mlp_hidden)
            self.mlp.up_proj = nn.Linear(spec.embed_dim, spec.mlp_hidden)
            self.mlp.down_proj = nn.Linear(spec.mlp_hidden, spec.embed_dim)
            self.act = F.silu if spec.hidden_act == "silu" else _activation(spec.hidden_act)
        else:
            self.mlp.fc1 = nn.Linear(spec.embed_dim, spec.mlp_hidden)
            self.mlp.fc2 = nn.Linear(spec.mlp_hidden, spec.embed_dim)
            self.act = _activation(spec.hidden_act)

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        h = self.norm2(x)
        if self.gated:
            return x + self.mlp.down_proj(self.act(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(h)))


def window_order(grids: Sequence[Sequence[int]], merge: int, window: int
                 ) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: (the merged tokens' order, window by window: frames, then
    windows row-major, then tokens row-major inside a window; the windows' lengths in
    patches). `window`: a window's side in merged tokens; edge windows are smaller."""
    order: list[torch.Tensor] = []
    lengths: list[int] = []
    base = 0
    for t, h, w in grids:
        lh, lw = h // merge, w // merge
        index = torch.arange(t * lh * lw).view(t, lh, lw)
        for frame in range(t):
            for r in range(0, lh, window):
                for c in range(0, lw, window):
                    block = index[frame, r:r + window, c:c + window].reshape(-1)
                    order.append(block + base)
                    lengths.append(len(block) * merge * merge)
        base += t * lh * lw
    return torch.cat(order), lengths


class Qwen2VisionEncoder(nn.Module):
    """Patches [patches, patch_dim] of one or more images (their grids [t, h, w] in
    patches) -> features [patches / merge^2, decoder hidden]."""

    def __init__(self, spec: Qwen2VisionSpec, largest_patches: int = 16384) -> None:
        """`largest_patches`: the most patches the processor makes of one image (its
        max_pixels / 14^2), for the memory profile."""
        super().__init__()
        self.spec = spec
        merge = spec.spatial_merge_size ** 2
        self.largest_image_tokens = max(1, largest_patches // merge)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(spec.patch_dim, spec.embed_dim, bias=False)
        self.blocks = nn.ModuleList(_Block(spec) for _ in range(spec.depth))
        merged = spec.embed_dim * spec.spatial_merge_size ** 2
        self.merger = nn.Module()
        self.merger.ln_q = _norm(spec, spec.embed_dim)
        self.merger.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(),
                                        nn.Linear(merged, spec.out_hidden_size))
        head_dim = spec.embed_dim // spec.num_heads
        quarter = head_dim // 2
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32)
                                              / quarter))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def tokens_for_grid(self, grid: Sequence[int]) -> int:
        t, h, w = grid
        return t * h * w // self.spec.spatial_merge_size ** 2

    def _rotary(self, grids: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, ...]:
        positions = torch.cat([patch_positions(g, self.spec.spatial_merge_size) for g in grids])
        freqs = positions.to(device, torch.float32)[..., None] * self.inv_freq  # [n, 2, q/2]
        freqs = freqs.flatten(1)                                              # rows, cols
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]                  # [n, 1, head]
        return emb.cos(), emb.sin()

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grids: Sequence[Sequence[int]]) -> torch.Tensor:
        spec = self.spec
        x = self.patch_embed.proj(patches.to(self.patch_embed.proj.weight.dtype))
        cos, sin = self._rotary(grids, x.device)
        # full attention: each frame (pair) of each image alone
        frames = [h * w for t, h, w in grids for _ in range(t)]
        windows, order = frames, None
        if spec.qwen2_5:
            unit = spec.spatial_merge_size ** 2
            side = spec.window_size // spec.spatial_merge_size // spec.patch_size
            order, windows = window_order(grids, spec.spatial_merge_size, side)
            order = order.to(x.device)

            def permute(y: torch.Tensor) -> torch.Tensor:
                return y.reshape(-1, unit, *y.shape[1:])[order].reshape(y.shape)
            x, cos, sin = permute(x), permute(cos), permute(sin)
        for i, block in enumerate(self.blocks):
            full = not spec.qwen2_5 or i in spec.fullatt_block_indexes
            x = block(x, cos, sin, frames if full else windows)
        merged = self.merger.ln_q(x).view(-1, self.merger.mlp[0].in_features)
        out = self.merger.mlp(merged)
        if order is not None:
            out = out[torch.argsort(order)]
        return out

    def encode_batch(self, pixels: list[torch.Tensor], grids: list) -> list[torch.Tensor]:
        """Each image's features; the images run as one concatenated batch."""
        features = self(torch.cat(pixels), grids)
        return list(features.split([self.tokens_for_grid(g) for g in grids]))

    def profile_batch(self, tokens: int) -> tuple[list[torch.Tensor], list]:
        """Blank images of the largest size, `tokens` features in all (at least one image),
        for the start-up memory profile."""
        merge = self.spec.spatial_merge_size
        side = max(1, int(self.largest_image_tokens ** 0.5))       # merged tokens per side
        grid = [1, side * merge, side * merge]
        count = max(1, tokens // (side * side))
        weight = self.patch_embed.proj.weight
        pixels = torch.zeros(side * side * merge * merge, self.spec.patch_dim,
                             dtype=weight.dtype, device=weight.device)
        return [pixels] * count, [grid] * count


_VISUAL_PREFIXES = ("model.visual.", "visual.")


def load_qwen2_vision(encoder: Qwen2VisionEncoder,
                      tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Copy the vision transformer's weights from a Qwen2-VL checkpoint's (name, tensor)
    pairs (other names skipped; the patch embedding's Conv3d kernel flattened to the linear
    map it is). Returns the parameters not found."""
    def local(name: str) -> str | None:
        prefix = next((p for p in _VISUAL_PREFIXES if name.startswith(p)), None)
        return None if prefix is None else name[len(prefix):]

    def flatten_conv(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name == "patch_embed.proj.weight":
            return tensor.reshape(tensor.shape[0], -1)
        return tensor
    return load_by_name(encoder, tensors, local, flatten_conv)
