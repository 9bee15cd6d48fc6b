"""The offline pooling API, in vLLM's shape: LLM.encode, embed, classify, reward and score
(a mixin of LLM: they share its engine and request loop)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from folio.pooling_params import PoolingParams, PoolingTask
from folio.request_outputs import (ClassificationRequestOutput, EmbeddingRequestOutput,
                                   PoolingOutput, PoolingRequestOutput, ScoringOutput,
                                   ScoringRequestOutput)


def score_pairs(data_1: Any, data_2: Any) -> list[tuple[Any, Any]]:
    """vLLM's pairing for scoring: one query against each document (1-to-N), or the i-th of
    one list against the i-th of the other (N-to-N)."""
    first = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
    second = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
    if not first or not second:
        raise ValueError("score needs at least one text on each side")
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise ValueError(f"score pairs text_1 and text_2 one to one, or one text_1 with every "
                         f"text_2: got {len(first)} and {len(second)}")
    return list(zip(first, second))


def cosine(a: Any, b: Any) -> float:
    """Cosine similarity of two 1-D arrays (numpy), as a float."""
    import numpy as np
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    denom = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / denom if denom else 0.0


# Plain texts are tokenized and queued this many at a time (about one step's token budget of
# sentence-length texts), the next chunk tokenized while the engine runs the ones before.
_TOKENIZE_CHUNK = 256
# _batch_truncation's answer when the prompts cannot be tokenized in batches.
_NOT_BATCHED = object()


class PoolingAPI:
    """LLM's pooling methods. Needs LLM's `llm_engine`, `_next_request_id`, `_step` and
    `_run`."""

    llm_engine: Any

    def encode(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams]
               | None = None, *, use_tqdm: bool = True, pooling_task: str | None = None,
               truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Run a pooling task over prompts (the model's default task unless `pooling_task`
        names one); outputs in prompt order, each `outputs.data` a torch tensor."""
        outputs = self._pool(prompts, pooling_params, pooling_task, truncate_prompt_tokens,
                             use_tqdm)
        import torch
        for out in outputs:
            if out.outputs is not None:
                out.outputs = PoolingOutput(torch.from_numpy(out.outputs.data.copy()))
        return outputs

    def embed(self, prompts: Any, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | Sequence[PoolingParams]
              | None = None) -> list[EmbeddingRequestOutput]:
        return [EmbeddingRequestOutput.from_base(o) for o in self._pool(
            prompts, pooling_params, PoolingTask.EMBED.value, truncate_prompt_tokens,
            use_tqdm)]

    def classify(self, prompts: Any, *, truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = True, pooling_params: PoolingParams
                 | Sequence[PoolingParams] | None = None) -> list[ClassificationRequestOutput]:
        return [ClassificationRequestOutput.from_base(o) for o in self._pool(
            prompts, pooling_params, PoolingTask.CLASSIFY.value, truncate_prompt_tokens,
            use_tqdm)]

    def reward(self, prompts: Any, *, truncate_prompt_tokens: int | None = None,
               use_tqdm: bool = True, pooling_params: PoolingParams
               | Sequence[PoolingParams] | None = None) -> list[PoolingRequestOutput]:
        """Per-token scores of a reward (classification) model: `outputs.data` [tokens,
        labels]."""
        return self.encode(prompts, pooling_params, use_tqdm=use_tqdm,
                           pooling_task=PoolingTask.TOKEN_CLASSIFY.value,
                           truncate_prompt_tokens=truncate_prompt_tokens)

    def score(self, data_1: Any, data_2: Any, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | None = None
              ) -> list[ScoringRequestOutput]:
        """Relevance of each (data_1, data_2) pair (one data_1 against every data_2, or one to
        one): a cross-encoder scores each pair in one pass; an embedding model embeds both
        sides and gives their cosine similarity."""
        pairs = score_pairs(data_1, data_2)
        info = self.llm_engine.model_info.pooling
        params = pooling_params or PoolingParams()
        if info is not None and info.kind == "embed":
            texts = list(dict.fromkeys(t for pair in pairs for t in pair
                                       if isinstance(t, str)))
            others = [t for pair in pairs for t in pair if not isinstance(t, str)]
            if others:
                raise ValueError("score: texts must be strings")
            embedded = self._pool(texts, params, PoolingTask.EMBED.value,
                                  truncate_prompt_tokens, use_tqdm)
            vectors = {t: o.outputs.data for t, o in zip(texts, embedded)}
            tokens = {t: o.prompt_token_ids for t, o in zip(texts, embedded)}
            return [ScoringRequestOutput(str(i), ScoringOutput(cosine(vectors[a], vectors[b])),
                                         tokens[a] + tokens[b])
                    for i, (a, b) in enumerate(pairs)]
        outputs = self._pool([a for a, _ in pairs], params, PoolingTask.SCORE.value,
                             truncate_prompt_tokens, use_tqdm, pairs=[b for _, b in pairs])
        return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])),
                                     o.prompt_token_ids) for o in outputs]

    # ---- helpers -------------------------------------------------------------------------

    def _pool(self, prompts: Any, pooling_params: Any, task: str | None,
              truncate_prompt_tokens: int | None, use_tqdm: bool,
              pairs: list[str] | None = None) -> list[PoolingRequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(pooling_params, (list, tuple)):
            if len(pooling_params) != len(prompts):
                raise ValueError(f"pooling_params has {len(pooling_params)} entries for "
                                 f"{len(prompts)} prompts")
            params_list = list(pooling_params)
        else:
            params_list = [pooling_params or PoolingParams()] * len(prompts)
        engine = self.llm_engine
        request_ids: list[str] = []
        results: dict[str, Any] = {}
        shared: dict[int, PoolingParams] = {}     # one copy per params object given

        def add(i: int, prompt: Any) -> None:
            given = params_list[i]
            params = shared.get(id(given))
            if params is None:
                params = given.clone()
                if task is not None:
                    params.task = task
                if truncate_prompt_tokens is not None:
                    params.truncate_prompt_tokens = truncate_prompt_tokens
                params.__post_init__()
                shared[id(given)] = params
            request_ids.append(engine.add_pooling_request(
                self._next_request_id(), prompt, params,
                pair=None if pairs is None else pairs[i]))
        try:
            keep = self._batch_truncation(prompts, params_list, truncate_prompt_tokens, pairs)
            if keep is _NOT_BATCHED:
                for i, prompt in enumerate(prompts):
                    add(i, prompt)
            else:
                self._add_tokenizing_ahead(prompts, keep, add, results)
        except Exception:
            engine.abort_request(request_ids)
            raise
        outputs = self._run(request_ids, use_tqdm, results)
        failed = [o for o in outputs if o.outputs is None]
        if failed:
            raise RuntimeError(f"{len(failed)} pooling request(s) failed in the engine "
                               f"(finish reason {failed[0].finish_reason!r})")
        return outputs

    @staticmethod
    def _batch_truncation(prompts: list, params_list: list, truncate_prompt_tokens: int | None,
                          pairs: list | None) -> Any:
        """The one truncation setting of plain texts that can be tokenized in batches (None:
        none), or _NOT_BATCHED (pairs, token ids, prompts with settings of their own)."""
        if pairs is not None or not prompts or not all(
                isinstance(p, str) and p for p in prompts):
            return _NOT_BATCHED
        keeps = {truncate_prompt_tokens if truncate_prompt_tokens is not None
                 else (p or PoolingParams()).truncate_prompt_tokens for p in params_list}
        return keeps.pop() if len(keeps) == 1 else _NOT_BATCHED

    def _add_tokenizing_ahead(self, texts: list[str], keep: int | None,
                              add: Callable[[int, Any], None], results: dict[str, Any]) -> None:
        """Queue plain texts _TOKENIZE_CHUNK at a time, each chunk tokenized in one batched
        call on a thread while the engine runs a step on the chunks queued before it (the
        fast tokenizer encodes without holding the GIL): on a GPU, tokenizing 1,000 texts
        took as long as embedding them. Each text goes in as its ids beside its text, the
        same ids one by one would give. Finished outputs land in `results`."""
        from concurrent.futures import ThreadPoolExecutor
        tokenize = self.llm_engine.preparer.input_processor.tokenize_pooling_texts
        starts = range(0, len(texts), _TOKENIZE_CHUNK)
        pool = ThreadPoolExecutor(1, thread_name_prefix="folio-tokenize")
        try:
            futures = [pool.submit(tokenize, texts[s:s + _TOKENIZE_CHUNK], keep)
                       for s in starts]
            for s, future in zip(starts, futures):
                for j, tokens in enumerate(future.result()):
                    if not tokens:
                        # too long to tokenize whole: process_pooling refuses it, tokenizing
                        # it here, so the tokenizer's thread must be done first
                        pool.shutdown(wait=True, cancel_futures=True)
                    add(s + j, {"prompt": texts[s + j], "prompt_token_ids": tokens}
                        if tokens else texts[s + j])
                if s + _TOKENIZE_CHUNK < len(texts):
                    self._step(results)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
