"""A pooling model's last step: a flat batch's final hidden states -> one output per request
(an embedding, class probabilities, or one of either per token).

The classifier heads and their checkpoint weights live here, in float32: they see a few rows
per request (the pooled ones), so the precision costs nothing, and a reranker's logit is the
difference of two large dot products, where bfloat16 would lose digits.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from folio.model.encoder import strip_base_prefix
from folio.model.host_copy import device_tensor, to_device
from folio.pooling_params import PoolingModelInfo, PoolingParams, PoolingTask, PoolingType

_BERT_HEAD = {"pooler.dense.weight": "dense.weight", "pooler.dense.bias": "dense.bias",
              "classifier.weight": "out.weight", "classifier.bias": "out.bias"}
_ROBERTA_HEAD = {"classifier.dense.weight": "dense.weight",
                 "classifier.dense.bias": "dense.bias",
                 "classifier.out_proj.weight": "out.weight",
                 "classifier.out_proj.bias": "out.bias"}
_SCORE_HEAD = {"score.weight": "out.weight"}
# Checkpoint names of heads (after the bert. / roberta. prefix): a model that does not run a
# head skips its weights (BertModel's pooler in an embedding model).
HEAD_PREFIXES = ("pooler.", "classifier.", "score.")


class ClassifierHead(nn.Module):
    """logits = out(tanh(dense(x))), or out(x) without the dense layer, row by row.
    `checkpoint_names`: checkpoint tensor -> parameter."""

    def __init__(self, hidden_size: int, num_labels: int, dense: bool, bias: bool,
                 checkpoint_names: dict[str, str]) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size) if dense else None
        self.out = nn.Linear(hidden_size, num_labels, bias=bias)
        self.checkpoint_names = checkpoint_names

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            rows = torch.tanh(self.dense(rows))
        return self.out(rows)


def _make_head(info: PoolingModelInfo, hidden_size: int) -> ClassifierHead | None:
    if info.kind != "classify":
        return None
    arch, labels = info.architecture, info.num_labels
    if info.classifier_from_token:
        return ClassifierHead(hidden_size, labels, dense=False, bias=False, checkpoint_names={})
    if arch.startswith("Bert"):
        return ClassifierHead(hidden_size, labels, dense=True, bias=True,
                              checkpoint_names=_BERT_HEAD)
    if arch.startswith(("Roberta", "XLMRoberta")):
        return ClassifierHead(hidden_size, labels, dense=True, bias=True,
                              checkpoint_names=_ROBERTA_HEAD)
    return ClassifierHead(hidden_size, labels, dense=False, bias=False,
                          checkpoint_names=_SCORE_HEAD)


class Pooler(nn.Module):
    def __init__(self, info: PoolingModelInfo, hf_config: Any) -> None:
        super().__init__()
        self.info = info
        self.head = _make_head(info, int(hf_config.hidden_size))

    # ---- weights -------------------------------------------------------------------------

    def checkpoint_param(self, name: str) -> str | None:
        """The head parameter checkpoint tensor `name` fills (None: not one of the head's)."""
        if self.head is None:
            return None
        return self.head.checkpoint_names.get(strip_base_prefix(name))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The head's checkpoint tensors (names as checkpoint_param takes them); any other
        name, or a head parameter left unfilled, is a ValueError."""
        params = dict(self.named_parameters())
        loaded, unexpected = set(), []
        for name, tensor in weights:
            target = self.checkpoint_param(name)
            if target is None:
                unexpected.append(name)
                continue
            param = params[f"head.{target}"]
            if param.shape != tensor.shape:
                raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(target)
        if unexpected:
            raise ValueError(f"the pooler has no use for weights {unexpected}")
        names = self.head.checkpoint_names if self.head is not None else {}
        missing = sorted(name for name, target in names.items() if target not in loaded)
        if missing:
            raise ValueError(f"checkpoint lacks the classifier's weights {missing}")

    @torch.no_grad()
    def from_lm_head(self, weight: torch.Tensor) -> None:
        """A decoder reranker's classifier from the language-model head `weight` [vocab, H]
        (vLLM's classifier_from_token): rows (no, yes) give one logit row w_yes - w_no, whose
        sigmoid is softmax over (no, yes) of yes; one id gives its row."""
        ids = self.info.classifier_token_ids
        if self.head is None or not self.info.classifier_from_token:
            raise ValueError("from_lm_head: the model has no classifier_from_token")
        if len(ids) != len(self.info.classifier_from_token):
            raise ValueError(f"classifier_token_ids {list(ids)} do not match "
                             f"classifier_from_token {list(self.info.classifier_from_token)}")
        rows = weight[list(ids)].to(self.head.out.weight.device, torch.float32)
        if len(ids) == 2:
            rows = rows[1:] - rows[:1]
        self.head.out.weight.copy_(rows)

    # ---- forward -------------------------------------------------------------------------

    def forward(self, hidden: torch.Tensor, query_start_loc: list[int],
                tasks: list[PoolingTask], params: list[PoolingParams]) -> list[torch.Tensor]:
        """hidden [T, H]; request i's rows are hidden[qsl[i]:qsl[i + 1]], its task tasks[i].
        Per request, float32 on hidden's device: [D] (embed), [num_labels] (classify, score),
        [L, D] or [L, num_labels] (token_embed, token_classify, or any task when the pooling
        type is ALL)."""
        embed_seq, classify_seq, embed_tok, classify_tok = [], [], [], []
        for i, task in enumerate(tasks):
            embed = self._is_embed(task)
            if task.per_token or self.info.pooling_type == PoolingType.ALL:
                (embed_tok if embed else classify_tok).append(i)
            else:
                (embed_seq if embed else classify_seq).append(i)
        out: list[torch.Tensor | None] = [None] * len(tasks)

        def put(requests: list[int], values: list[torch.Tensor]) -> None:
            for i, value in zip(requests, values):
                out[i] = value

        if embed_seq or classify_seq:
            pooled = self._pool(hidden, query_start_loc, embed_seq + classify_seq)
            n = len(embed_seq)
            if embed_seq:
                put(embed_seq, self._embeddings(pooled[:n], [params[i] for i in embed_seq]))
            if classify_seq:
                put(classify_seq, self._probabilities(self.head(pooled[n:]),
                                                      [params[i] for i in classify_seq]))
        if embed_tok:
            rows, counts = _request_rows(hidden, query_start_loc, embed_tok)
            put(embed_tok, self._embeddings(rows, [params[i] for i in embed_tok], counts))
        if classify_tok:
            rows, counts = _request_rows(hidden, query_start_loc, classify_tok)
            put(classify_tok, self._probabilities(self.head(rows),
                                                  [params[i] for i in classify_tok], counts))
        return out  # type: ignore[return-value]

    def _is_embed(self, task: PoolingTask) -> bool:
        """Whether `task` returns hidden states (normalized) rather than classifier output;
        encode and score run the model's own kind."""
        if task not in self.info.tasks:
            raise ValueError(f"task {task.value!r} is not supported by this model "
                             f"(supported: {sorted(t.value for t in self.info.tasks)})")
        if task in (PoolingTask.EMBED, PoolingTask.TOKEN_EMBED):
            return True
        if task in (PoolingTask.CLASSIFY, PoolingTask.TOKEN_CLASSIFY):
            return False
        return self.info.kind == "embed"

    def _pool(self, hidden: torch.Tensor, qsl: list[int], requests: list[int]) -> torch.Tensor:
        """[len(requests), H] float32: each request's rows pooled by the model's type."""
        kind = self.info.pooling_type
        if kind == PoolingType.CLS:
            index = [qsl[i] for i in requests]
        elif kind == PoolingType.LAST:
            index = [qsl[i + 1] - 1 for i in requests]
        else:   # MEAN: per-request sums of every row (one index_add for the whole batch)
            lengths = torch.tensor([b - a for a, b in zip(qsl[:-1], qsl[1:])])
            segment = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
            sums = hidden.new_zeros(len(lengths), hidden.shape[-1], dtype=torch.float32)
            sums.index_add_(0, to_device(segment, hidden.device), hidden.float())
            means = sums / to_device(lengths, hidden.device).to(sums)[:, None]
            return means[device_tensor(requests, hidden.device)]
        return hidden[device_tensor(index, hidden.device)].float()

    def _embeddings(self, rows: torch.Tensor, params: list[PoolingParams],
                    counts: list[int] | None = None) -> list[torch.Tensor]:
        """Request j owns the next counts[j] rows (None: one row each, returned as a vector):
        each truncated to its `dimensions` (Matryoshka) and L2-normalized where its
        `normalize` (or the model's default) says."""
        dims = {p.dimensions for p in params}
        if len(dims) > 1:   # rare: requests of one step asking for different sizes
            per_request = rows.split([1] * len(params) if counts is None else counts)
            return [self._embeddings(r, [p], None if counts is None else [len(r)])[0]
                    for r, p in zip(per_request, params)]
        (size,) = dims
        if size is not None:
            rows = rows[:, :size]
        flags = [self.info.normalize if p.normalize is None else p.normalize for p in params]
        return _split(_where_rows(flags, counts, F.normalize(rows, dim=-1), rows), counts)

    def _probabilities(self, logits: torch.Tensor, params: list[PoolingParams],
                       counts: list[int] | None = None) -> list[torch.Tensor]:
        """The classifier's activation on each row of the requests whose `use_activation` (or
        the model's default) asks for it, raw logits for the others (counts: as in
        _embeddings)."""
        flags = [self.info.use_activation if p.use_activation is None else p.use_activation
                 for p in params]
        activated = (torch.sigmoid(logits) if self.info.activation == "sigmoid"
                     else torch.softmax(logits, dim=-1))
        return _split(_where_rows(flags, counts, activated, logits), counts)


def _request_rows(hidden: torch.Tensor, qsl: list[int],
                  requests: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Every row of `requests`, float32, one after the other, and how many each owns."""
    rows = torch.cat([hidden[qsl[i]:qsl[i + 1]] for i in requests]).float()
    return rows, [qsl[i + 1] - qsl[i] for i in requests]


def _split(rows: torch.Tensor, counts: list[int] | None) -> list[torch.Tensor]:
    """Request j's counts[j] rows each; counts None: request j's row j, as a vector."""
    return list(rows.unbind(0) if counts is None else rows.split(counts))


def _where_rows(flags: list[bool], counts: list[int] | None, yes: torch.Tensor,
                no: torch.Tensor) -> torch.Tensor:
    """Rows of `yes` for the requests whose flag is set, of `no` for the others (request j owns
    counts[j] rows; None: one each)."""
    if all(flags):
        return yes
    if not any(flags):
        return no
    mask = torch.tensor(flags)
    if counts is not None:
        mask = torch.repeat_interleave(mask, torch.tensor(counts))
    return torch.where(to_device(mask, yes.device)[:, None], yes, no)
