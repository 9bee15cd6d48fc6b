"""Router top-k: which experts each token visits, and with what weight.

The variants the supported families use, as one function of a RouterConfig:
- softmax over all experts, top-k, optionally renormalized to sum to 1 (Mixtral always;
  Qwen2/3-MoE with norm_topk_prob);
- sigmoid scores plus a learned per-expert correction bias used only for the choice, with the
  experts first narrowed to the best `topk_groups` of `num_groups` groups (DeepSeek-V3's
  "noaux_tc"), weights from the unbiased scores;
- softmax with group-limited choice (DeepSeek-V2's "group_limited_greedy": a group's score is
  its best expert's);
- top-k on the raw logits, softmax over the k chosen (GPT-OSS).
Weights come out float32 (the routers compute the softmax in float32) and ids int64.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from folio.model.families import MoEScoring


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    scoring: MoEScoring = MoEScoring.SOFTMAX
    renormalize: bool = True
    # Experts split into num_groups equal groups; the choice looks only at the best
    # topk_groups of them (1 / 1: no grouping).
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in 1..{self.num_experts}")
        if self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"expert groups {self.num_groups} (top {self.topk_groups}) do not "
                             f"divide {self.num_experts} experts")


def _group_mask(choice: torch.Tensor, cfg: RouterConfig) -> torch.Tensor:
    """choice [T, E] -> the same with experts outside each token's best groups at -inf."""
    t = choice.shape[0]
    grouped = choice.view(t, cfg.num_groups, -1)
    if cfg.scoring is MoEScoring.SIGMOID:
        # V3: a group scores the sum of its two best (biased) experts
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
    else:
        group_scores = grouped.amax(dim=-1)
    best = group_scores.topk(cfg.topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, -1)


def select_experts(logits: torch.Tensor, cfg: RouterConfig,
                   correction_bias: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (the router's output, any float dtype) -> (weights [T, k] float32,
    expert ids [T, k] int64)."""
    logits = logits.float()
    if cfg.scoring is MoEScoring.TOPK_SOFTMAX:
        values, ids = logits.topk(cfg.top_k, dim=-1)
        weights = values.softmax(dim=-1)
        if cfg.routed_scaling_factor != 1.0:
            weights = weights * cfg.routed_scaling_factor
        return weights, ids
    if cfg.scoring is MoEScoring.SIGMOID:
        scores = logits.sigmoid()
    else:
        scores = logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.num_groups > 1:
        choice = _group_mask(choice, cfg)
    if correction_bias is None and cfg.num_groups == 1:
        weights, ids = scores.topk(cfg.top_k, dim=-1)
    else:
        ids = choice.topk(cfg.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids
