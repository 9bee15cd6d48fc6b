"""Bidirectional attention over a flat batch of whole inputs (the encoders' attention): each
input attends to all of its own tokens and to no other input's.

One padded grid for the whole step would cost B * Lmax^2 where the inputs need sum(L_i^2)
(several times more for mixed lengths), and one SDPA call per input costs a call's overhead per
input and layer (most of the attention time for short inputs on the CPU). So the inputs are
sorted by length and cut into groups of similar length; each group is one SDPA call over its
own padded grid (with a key mask only where its lengths differ). On CUDA, torch's
variable-length flash attention takes the flat batch as it is, when this torch has it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from folio.model.host_copy import to_device

# A group grows while its padded cost (inputs x longest^2) stays within this factor of what
# its inputs need (sum of length^2).
_GROUP_SLACK = 1.25


@dataclass(frozen=True)
class AttentionGroup:
    """Inputs attended in one SDPA call: `num` inputs in a [num, length] grid. `rows`: the
    flat rows of their tokens in grid order, `slots`: where each lands in the grid
    (num * length rows; None = every slot is filled, no padding); `mask` [num, 1, 1, length]
    of real keys (None: no padding). `rows` None: the group is the whole flat batch, already a
    grid (equal lengths, in order)."""
    num: int
    length: int
    rows: torch.Tensor | None
    slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(frozen=True)
class EncoderLayout:
    """A step's attention plan: its groups, or (CUDA variable-length attention) the inputs'
    cumulative lengths `cu_seqlens` (int32, on the device) and the longest length."""
    groups: tuple[AttentionGroup, ...]
    cu_seqlens: torch.Tensor | None = None
    max_len: int = 0


def varlen_attention(device: torch.device):
    """torch's variable-length flash attention where this torch has it for `device` (CUDA);
    None elsewhere (its CPU build has none)."""
    if device.type != "cuda":
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def group_by_length(lengths: list[int]) -> list[list[int]]:
    """The inputs (indices) in groups of similar length, longest first: a group grows while
    its padded cost stays within _GROUP_SLACK of its real cost."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    need = 0
    for i in order:
        length = lengths[i]
        if groups:
            longest = lengths[groups[-1][0]]
            if (len(groups[-1]) + 1) * longest * longest <= _GROUP_SLACK * (need + length * length):
                groups[-1].append(i)
                need += length * length
                continue
        groups.append([i])
        need = length * length
    return groups


def plan_attention(query_start_loc: list[int], device: torch.device,
                   dtype: torch.dtype) -> EncoderLayout:
    qsl = query_start_loc
    lengths = [end - start for start, end in zip(qsl[:-1], qsl[1:])]
    if min(lengths) == max(lengths):
        return EncoderLayout((AttentionGroup(len(lengths), lengths[0], None, None, None),))
    if varlen_attention(device) is not None and dtype in (torch.float16, torch.bfloat16):
        return EncoderLayout((), to_device(torch.tensor(qsl, dtype=torch.int32), device),
                             max(lengths))
    groups = []
    for members in group_by_length(lengths):
        longest = lengths[members[0]]
        rows = torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in members])
        padded = any(lengths[i] != longest for i in members)
        slots = mask = None
        if padded:
            slots = torch.cat([torch.arange(lengths[i]) + j * longest
                               for j, i in enumerate(members)])
            lens = torch.tensor([lengths[i] for i in members])
            mask = to_device((torch.arange(longest)[None, :] < lens[:, None]).view(
                len(members), 1, 1, longest), device)
            slots = to_device(slots, device)
        groups.append(AttentionGroup(len(members), longest, to_device(rows, device), slots,
                                     mask))
    return EncoderLayout(tuple(groups))


def encoder_attention(qkv: torch.Tensor, layout: EncoderLayout, num_heads: int,
                      head_dim: int) -> torch.Tensor:
    """qkv [T, 3 * H * D] (the fused projection's output) -> attention output [T, H * D]."""
    t = qkv.shape[0]
    if layout.cu_seqlens is not None:
        q, k, v = qkv.view(t, 3, num_heads, head_dim).unbind(1)
        varlen = varlen_attention(qkv.device)
        return varlen(q, k, v, layout.cu_seqlens, layout.cu_seqlens, layout.max_len,
                      layout.max_len).reshape(t, -1)
    if len(layout.groups) == 1 and layout.groups[0].rows is None:
        group = layout.groups[0]
        return _attend(qkv, group, num_heads, head_dim)
    out = qkv.new_empty(t, num_heads * head_dim)
    for group in layout.groups:
        part = qkv.index_select(0, group.rows)
        if group.slots is not None:
            grid = part.new_zeros(group.num * group.length, part.shape[-1])
            part = grid.index_copy_(0, group.slots, part)
        result = _attend(part, group, num_heads, head_dim)
        if group.slots is not None:
            result = result.index_select(0, group.slots)
        out.index_copy_(0, group.rows, result)
    return out


def _attend(grid: torch.Tensor, group: AttentionGroup, num_heads: int,
            head_dim: int) -> torch.Tensor:
    """One SDPA over a group's grid rows [num * length, 3 * H * D] -> [num * length, H * D].
    Padded query rows attend to their input's real keys: harmless rows, never NaN."""
    b, length = group.num, group.length
    q, k, v = grid.view(b, length, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask)
    return out.transpose(1, 2).reshape(b * length, -1)
