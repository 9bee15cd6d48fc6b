"""`folio bench throughput --task embed`: embeddings per second over real texts (standard-library
docstrings of mixed length, folio/bench/texts.py), folio's `LLM.embed` against
sentence-transformers' `encode` on the same model, device and dtype, in the same run.

The peer runs in its own spawned process at each of several batch sizes and is reported at its
best (the issue's target compares with sentence-transformers "at its best batch size"). Both
cut every text to the model's maximum length the same way (the first tokens kept, special
tokens intact): folio with truncate_prompt_tokens=-1 (max_model_len, which a
sentence-transformers model takes from its max_seq_length), the peer at that max_seq_length.
Throughput is measured around the embedding call only, each side after one untimed pass
over the same texts (the peer: at each batch size), so both run with every step shape seen
once; each side then makes `--embed-passes` timed passes (the peer: at each batch size) and is
reported by the median pass. A pass of 1,000 short texts lasts a few tenths of a second on a
GPU, where one pass alone moved folio's figure by 40 % between runs (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from folio.bench.child_process import ChildTimeout, in_child
from folio.bench.texts import stdlib_texts

PEER = "sentence-transformers"
DEFAULT_PEER_BATCH_SIZES = (16, 32, 64, 128)


def _cosine_rows(a: Any, b: Any) -> list[float]:
    import numpy as np
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    dots = (a * b).sum(axis=1)
    return (dots / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).tolist()


def sentence_transformers_peer(model_path: str, dtype: str, device: str, texts: list[str],
                               batch_sizes: list[int], max_seq_length: int,
                               check_count: int, passes: int = 1) -> dict[str, Any]:
    """In a child: sentence-transformers' encode of `texts` at each batch size (sentences/s,
    the median of `passes` timed passes), and its embeddings of the first `check_count`
    texts (for the agreement check)."""
    import torch
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:   # an optional extra: only this peer needs it
        raise ImportError("the sentence-transformers peer needs its package: "
                          "pip install 'folio[embed-bench]' (or sentence-transformers)") from exc
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}[dtype]
    model = SentenceTransformer(model_path, device=device,
                                model_kwargs={"dtype": torch_dtype})
    model.max_seq_length = max_seq_length
    rates = {}
    for batch_size in batch_sizes:
        # an untimed pass first, as folio's: every shape has been seen once (kernel selection)
        model.encode(texts, batch_size=batch_size)
        if device == "cuda":
            torch.cuda.synchronize()
        timed = []
        for _ in range(passes):
            start = time.perf_counter()
            model.encode(texts, batch_size=batch_size)
            if device == "cuda":
                torch.cuda.synchronize()
            timed.append(len(texts) / (time.perf_counter() - start))
        rates[batch_size] = statistics.median(timed)
    check = model.encode(texts[:check_count], batch_size=min(batch_sizes),
                         convert_to_numpy=True).astype("float32").tolist()
    return {"rates": rates, "check": check}


def run_embed(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The embeddings benchmark: folio's rate, the peer's at each batch size, the ratio to
    the peer's best, and how closely the two agree (cosine of their embeddings)."""
    from folio import LLM
    texts = stdlib_texts(args.num_prompts)
    start = time.perf_counter()
    llm = LLM(**engine_kwargs)
    ready_s = time.perf_counter() - start
    engine = llm.llm_engine
    info = engine.model_info
    max_len = engine.max_model_len
    llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)   # untimed: every shape once
    times = []
    for _ in range(embed_passes(args)):
        start = time.perf_counter()
        outputs = llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=not args.no_tqdm)
        times.append(time.perf_counter() - start)
    elapsed = statistics.median(times)
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    folio = {"engine": "folio", "sentences_per_s": len(texts) / elapsed,
             "tokens_per_s": num_tokens / elapsed, "elapsed_s": elapsed,
             "pass_sentences_per_s": [len(texts) / t for t in times],
             "start_to_ready_s": ready_s}
    device = engine.engine_core.executor.device_type
    dtype = _resolved_dtype(engine.config.model.dtype, info.hf_config, device)
    result: dict[str, Any] = {
        "task": "embed", "model": info.source.path, "num_texts": len(texts),
        "num_tokens": num_tokens, "max_model_len": max_len, "device": device, "dtype": dtype,
        "folio": folio,
    }
    print(f"folio: {folio['sentences_per_s']:.1f} sentences/s, {folio['tokens_per_s']:.0f} "
          f"tokens/s ({len(texts)} texts, {num_tokens} tokens, {elapsed:.2f} s; median of "
          f"{len(times)} passes: " + ", ".join(f"{r:.0f}" for r in
                                               folio["pass_sentences_per_s"]) + ")", flush=True)
    embeddings = [o.outputs.embedding for o in outputs]
    llm.llm_engine.shutdown()
    del llm
    if PEER in (args.peer or []):
        peer_dtype = getattr(args, "peer_dtype", None) or dtype
        result["peer"] = _run_peer(args, info.source.path, peer_dtype, device, texts, max_len,
                                   embeddings)
        best = result["peer"].get("best_sentences_per_s")
        if best:
            result["speedup_vs_peer_best"] = folio["sentences_per_s"] / best
            print(f"folio / {PEER} at its best batch size: "
                  f"{result['speedup_vs_peer_best']:.2f}x", flush=True)
    return result


def embed_passes(args: argparse.Namespace) -> int:
    passes = getattr(args, "embed_passes", 1)
    if not isinstance(passes, int) or not 1 <= passes <= 100:
        raise ValueError(f"--embed-passes must be in [1, 100], got {passes!r}")
    return passes


def _resolved_dtype(requested: str, hf_config: Any, device: str) -> str:
    """The dtype folio's worker ran the model in ("auto" resolved as the worker does); the
    peer runs in the same."""
    import torch
    from folio.model.loader import resolve_dtype
    return str(resolve_dtype(requested, hf_config, torch.device(device))).removeprefix("torch.")


def _run_peer(args: argparse.Namespace, model_path: str, dtype: str, device: str,
              texts: list[str], max_len: int, embeddings: list[list[float]]) -> dict[str, Any]:
    sizes = [int(s) for s in args.peer_batch_sizes]
    check = min(100, len(texts))
    print(f"running peer {PEER} ({device}, {dtype}, batch sizes {sizes}) ...", flush=True)
    try:
        out = in_child(sentence_transformers_peer, model_path, dtype, device, texts, sizes,
                       max_len, check, embed_passes(args), timeout=args.peer_timeout or None)
    except ChildTimeout as exc:
        return {"error": f"timed out after {exc.timeout:g} s"}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    rates = {int(k): v for k, v in out["rates"].items()}
    best_size = max(rates, key=rates.get)
    cosines = _cosine_rows(embeddings[:check], out["check"])
    for size, rate in sorted(rates.items()):
        print(f"{PEER} batch {size}: {rate:.1f} sentences/s", flush=True)
    print(f"agreement: cosine min {min(cosines):.6f} over {check} texts", flush=True)
    return {"engine": PEER, "dtype": dtype, "rates": rates, "best_batch_size": best_size,
            "best_sentences_per_s": rates[best_size], "cosine_min": min(cosines),
            "cosine_mean": sum(cosines) / len(cosines)}
