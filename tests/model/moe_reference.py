"""Plain references for the MoE tests: a per-token, per-slot loop (the slowest, most obvious
form of a mixture of experts) and routing written out token by token."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_oai(gate, up, alpha=1.702, limit=7.0):
    """GPT-OSS's clamped SwiGLU, written out."""
    gate = torch.minimum(gate, torch.tensor(limit, dtype=gate.dtype))
    up = torch.maximum(torch.minimum(up, torch.tensor(limit, dtype=up.dtype)),
                       torch.tensor(-limit, dtype=up.dtype))
    return (up + 1) * gate / (1 + torch.exp(-alpha * gate))


def experts_loop(x, gate_up, down, weights, ids, act=F.silu, gated=None, b13=None, b2=None):
    """For each token, for each of its k slots: that expert's gated MLP (biases optional;
    `gated(gate, up)` replaces act(gate) * up), scaled, summed."""
    inter = gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            h = gate_up[e].double() @ x[t].double()
            if b13 is not None:
                h = h + b13[e].double()
            a = gated(h[:inter], h[inter:]) if gated else act(h[:inter]) * h[inter:]
            y = down[e].double() @ a
            if b2 is not None:
                y = y + b2[e].double()
            out[t] += float(weights[t, slot]) * y
    return out


def route_loop(logits, top_k, scoring="softmax", renormalize=True, bias=None, num_groups=1,
               topk_groups=1, scale=1.0):
    """Token by token: scores, optional group narrowing, top-k on (biased) scores."""
    all_w, all_i = [], []
    for row in logits.double():
        scores = row.softmax(-1) if scoring == "softmax" else row.sigmoid()
        choice = scores + (bias.double() if bias is not None else 0)
        if num_groups > 1:
            groups = choice.view(num_groups, -1)
            if scoring == "sigmoid":
                group_score = torch.stack([g.sort(descending=True).values[:2].sum()
                                           for g in groups])
            else:
                group_score = groups.max(-1).values
            keep = group_score.sort(descending=True).indices[:topk_groups]
            mask = torch.full_like(groups, float("-inf"))
            mask[keep] = 0
            choice = (groups + mask).view(-1)
        idx = choice.sort(descending=True, stable=True).indices[:top_k]
        w = scores[idx]
        if renormalize:
            w = w / w.sum()
        all_w.append(w * scale)
        all_i.append(idx)
    return torch.stack(all_w), torch.stack(all_i)


def make_routes(kind: str, tokens: int, top_k: int, num_experts: int, gen):
    """Expert ids [T, k] with distinct experts per token: random; skewed (almost every token
    on expert 0 and 1); sparse (the same k experts, every other one from the top, for every
    token; the rest empty)."""
    ids = []
    for _ in range(tokens):
        if kind == "random":
            row = torch.randperm(num_experts, generator=gen)[:top_k]
        elif kind == "skewed":
            rest = torch.randperm(num_experts - 2, generator=gen)[:max(0, top_k - 2)] + 2
            row = torch.cat([torch.tensor([0, 1])[:top_k], rest])
        else:  # sparse
            row = torch.tensor([num_experts - 1 - 2 * i for i in range(top_k)])
        ids.append(row)
    return torch.stack(ids).to(torch.int64)
