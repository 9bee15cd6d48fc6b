"""CUDA graphs for pure-decode steps.

A decode step of a small model is dominated by launch overhead: a few hundred tiny kernels, each
costing more on the host than on the GPU. Capturing the forward pass once per batch size and
replaying it turns those launches into one.

A graph replays fixed kernels on fixed addresses, so everything the forward pass reads lives in
static device buffers sized for the largest batch (`max_num_seqs` rows, `ceil(max_model_len /
block_size)` block-table columns). Each step copies its values into them and replays the graph of
the smallest captured size that fits; the rows past the real batch are padding that:
  * write nothing to the KV cache (slot -1, which `reshape_and_cache` skips), and
  * attend over one key of block 0 (seq_len 1): the cache is zero-initialised and only ever holds
    finite values, so the padding rows stay finite and never touch a real row (every op of the
    model except attention is row-wise, and attention reads only its own row's context).

The attention backend must not derive anything from the step on the host while capturing: the
runner puts a `TritonStepTensors` built on the static buffers into the step metadata's cache
(so every layer reuses it), with `max_seq_len = max_model_len` and a fixed split count per batch
size. That split count is chosen for the longest possible context; shorter contexts leave some
splits empty, which the merge kernel weighs as zero.
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import Callable, Hashable, TypeVar

import torch

from folio.core.step_messages import SchedulerOutput
from folio.model.attention import AttentionMetadata
from folio.model.attention.triton_backend import (STEP_CACHE_KEY, TritonPagedAttention,
                                                  TritonStepTensors)
from folio.model.decoder import DecoderLM
from folio.model.layers import Attention
from folio.model.mla import MLAttention
from folio.model.lora.projection import LoRABatch
from folio.worker.flat_batch import Padding, StepBuffers, build_flat_batch
from folio.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)

# Writes the inputs still being sampled by the step in flight into the given input ids, on the
# device: (input ids, their flat positions, those requests' rows in the previous sampled ids).
FillPending = Callable[[torch.Tensor, list[int], list[int]], None]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8, and max_num_seqs itself so
    that every decode batch the scheduler can form has a graph."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


_Key = TypeVar("_Key", bound=Hashable)


def capture_graphs(sizes: list[_Key], prepare: Callable[[_Key], None],
                   forward: Callable[[_Key], None], device: torch.device
                   ) -> dict[_Key, torch.cuda.CUDAGraph]:
    """One CUDA graph per size (or key: mixed_graphs.py captures (size, piece) pairs),
    captured from the list's end: sizes come in ascending order, so the largest is captured
    first and later, smaller graphs reuse the pool memory it reserved (graphs sharing the
    pool never run at once, and no graph's temporaries outlive its replay). `prepare(size)`
    stages padding-only inputs; eager runs precede each capture, because Triton compiles and
    autotunes on a new key, which cannot happen inside one: two when the first benchmarked
    autotune configs (a first start: as before, so the state benchmarking leaves behind is
    run over before capture), one when it only read the choices from disk (a restart: a third
    of its capture time saved)."""
    from folio.model.kernels._common import autotune_benchmarks
    pool = torch.cuda.graph_pool_handle()
    graphs: dict[_Key, torch.cuda.CUDAGraph] = {}
    for size in reversed(sizes):
        prepare(size)
        tuned = autotune_benchmarks()
        forward(size)
        if autotune_benchmarks() != tuned:
            forward(size)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            forward(size)
        graphs[size] = graph
    torch.cuda.synchronize(device)
    return graphs


def triton_backend_of(model: DecoderLM) -> TritonPagedAttention | None:
    """The model's attention backend if every layer uses the Triton one (the only backend with
    a capture-safe static path), else None. Latent attention (MLA) runs on the same backend
    over its one latent head."""
    backends = {id(m.backend): m.backend for m in model.modules()
                if isinstance(m, (Attention, MLAttention))}
    if not backends or not all(isinstance(b, TritonPagedAttention) for b in backends.values()):
        return None
    return next(iter(backends.values()))


class AuxStateBuffers:
    """An EAGLE-3 target's kept residual streams (`DecoderLM.aux_hidden_states`, the head's
    input) in static buffers, so that its steps can run in CUDA graphs: the captured forward
    ends by copying the streams there (`keep`, three [n, hidden] copies), and after each run
    the model's list points at them (`publish`), where the head reads them as it does after
    an eager forward. Nothing for a model that keeps no streams."""

    def __init__(self, model: DecoderLM, rows: int, device: torch.device) -> None:
        self.model = model
        layers = len(model.aux_hidden_layers)
        self.buffers = torch.zeros((layers, rows, model.spec.hidden_size),
                                   dtype=model.norm_dtype(), device=device) if layers else None

    def keep(self, n: int) -> None:
        """Copy the forward's streams of its n rows (called inside the captured forward)."""
        if self.buffers is not None:
            for buf, state in zip(self.buffers, self.model.aux_hidden_states):
                buf[:n].copy_(state)

    def publish(self, rows: int) -> None:
        """Point the model's streams at the buffers' first `rows` rows (after a replay)."""
        if self.buffers is not None:
            self.model.aux_hidden_states = [buf[:rows] for buf in self.buffers]


class DecodeGraphRunner:
    def __init__(self, model: DecoderLM, kv_caches: list[torch.Tensor], *, block_size: int,
                 max_num_seqs: int, max_model_len: int, device: torch.device,
                 lora_batch: LoRABatch | None = None) -> None:
        """`lora_batch`: the LoRA adapters' step map (None without LoRA); each size is then
        captured twice, with the adapters' kernels and without, and a step replays the
        second when none of its requests has an adapter."""
        assert device.type == "cuda", "CUDA graphs need a CUDA device"
        backend = triton_backend_of(model)
        assert backend is not None, "CUDA graphs need the Triton attention backend"
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.backend = backend
        self.sizes = capture_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        n, w = self.max_batch, self.max_blocks
        dtype = next(model.parameters()).dtype

        # Pinned host buffers, written by the flat-batch builder, and their device mirror
        # (one copy a step, non-blocking): the buffers the graphs read, at fixed addresses
        # for their lifetime.
        self._host = StepBuffers(n, n, w, pin=True)
        self._device = self._host.mirror(device)
        t = self._device.tensors
        self.input_ids, self.positions = t["input_ids"], t["positions"]
        self.slot_mapping, self.block_tables = t["slot_mapping"], t["block_tables"]
        self.seq_lens = t["seq_lens"].fill_(1)
        # Decode: request i owns query row i.
        self.query_start_loc = t["query_start_loc"].copy_(
            torch.arange(n + 1, dtype=torch.int32))
        self.hidden = torch.zeros((n, model.spec.hidden_size), dtype=dtype, device=device)
        self.aux = AuxStateBuffers(model, n, device)

        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.lora_batch = lora_batch
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._metas: dict[int, AttentionMetadata] = {}
        self.num_replays = 0
        self.replayed_sizes: set[int] = set()
        self.capture_seconds = 0.0

    # ---- capture --------------------------------------------------------------------------

    def _static_metadata(self, bs: int) -> AttentionMetadata:
        st = TritonStepTensors(
            query_start_loc=self.query_start_loc[:bs + 1], seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs], slot_mapping=self.slot_mapping[:bs],
            max_query_len=1, max_seq_len=self.max_model_len, all_decode=True)
        kv_heads = self.kv_caches[0].shape[3]
        st.num_splits = self.backend.num_splits(st, kv_heads, self.device)
        # The host-side lists are never read on this path (the backend finds its tensors in
        # the cache); they only keep the metadata well formed.
        meta = AttentionMetadata(
            slot_mapping=st.slot_mapping, query_start_loc=list(range(bs + 1)),
            seq_lens=[1] * bs, num_computed_tokens=[0] * bs, block_tables=st.block_tables,
            block_size=self.block_size)
        meta.cache[STEP_CACHE_KEY] = st
        return meta

    def _forward(self, bs: int) -> None:
        out = self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches,
                         self._metas[bs])
        self.hidden[:bs].copy_(out)
        self.aux.keep(bs)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()

        def prepare(bs: int) -> None:
            # The buffers hold padding values (slot -1, seq_len 1): warm-up and capture write
            # nothing to the KV cache.
            self._metas[bs] = self._static_metadata(bs)

        self.graphs = capture_graphs(self.sizes, prepare, self._forward, self.device)
        if self.lora_batch is not None:
            self.lora_batch.force = True
            try:
                self.lora_graphs = capture_graphs(self.sizes, prepare, self._forward,
                                                  self.device)
            finally:
                self.lora_batch.force = False
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d CUDA graphs for decode (batch sizes %s) in %.1f s",
                    len(self.graphs), self.sizes, self.capture_seconds)

    # ---- replay ---------------------------------------------------------------------------

    def can_run(self, step: SchedulerOutput) -> bool:
        """A pure-decode step (one new token per request) that fits the static buffers (the
        block table is as wide as max_model_len, so any request fits)."""
        num_reqs = len(step.num_scheduled_tokens)
        return 0 < num_reqs <= self.max_batch and step.total_num_scheduled_tokens == num_reqs

    def run(self, step: SchedulerOutput, batch: InputBatch, prev_rows: dict[str, int],
            fill_pending: FillPending) -> tuple[torch.Tensor, list[int]]:
        """Replay the graph for this step; returns the final hidden states [B, hidden] (a view
        of the static output buffer, valid until the next replay) and the query_start_loc.
        Inputs still being sampled by the previous step are written on the device, before
        the replay."""
        B = len(step.num_scheduled_tokens)
        bs = self.sizes[bisect.bisect_left(self.sizes, B)]
        host = self._host
        host.wait_for_copies()
        flat = build_flat_batch(step, batch, prev_rows, host, self.block_size,
                                Padding.DECODE_ROWS, padded=bs)
        host.copy_to(self._device, bs)
        host.copies_queued()
        if flat.pending_dst:
            fill_pending(self.input_ids, flat.pending_dst, flat.pending_src)
        lora = self.lora_batch
        (self.lora_graphs if lora is not None and lora.active else self.graphs)[bs].replay()
        self.num_replays += 1
        self.replayed_sizes.add(bs)
        self.aux.publish(B)
        return self.hidden[:B], flat.query_start_loc
