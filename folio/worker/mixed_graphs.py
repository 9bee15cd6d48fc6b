"""CUDA graphs for mixed steps: any step that is not pure decode (prefill chunks, with or without
decodes beside them), captured at a ladder of padded token counts.

Run eagerly, such a step is a few hundred kernel launches from Python (about 15 ms of host time
for a 28-layer model on the lent H200's host), while its GPU work can be a few milliseconds:
with chunked prefill the GPU mostly waits. The varlen attention kernel needs nothing from the
host but its grid, and its grid has a bound that depends only on the token count and the
number of request slots (`triton_kernels.paged_attention_varlen`), so the whole forward pass
can be captured, attention included (what vLLM calls a FULL graph for its Triton backend).

Static buffers, sized for the largest captured token count N and R = max_num_seqs + 1 request
slots:
  * tokens [0, T) are the step's, [T, n) padding up to the captured size n: slot -1 (no cache
    write), position 0;
  * request slots [0, B) are the step's; slot B is a dummy request that owns the padding
    tokens, a fresh prefill of n - T tokens that reads only its own causal context through
    whatever valid block ids its block-table row holds (the cache only ever holds finite
    values, so the padding rows stay finite); slots past B have no query tokens and return at
    once.
Every op of the model but attention is row-wise, and attention reads only its own request's
context, so padding never touches a real row.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from folio.core.step_messages import SchedulerOutput
from folio.model.attention import AttentionMetadata
from folio.model.attention.triton_backend import STEP_CACHE_KEY, TritonStepTensors
from folio.model.decoder import DecoderLM
from folio.worker.cuda_graphs import (AuxStateBuffers, FillPending, capture_graphs,
                                      triton_backend_of)
from folio.worker.flat_batch import Padding, StepBuffers, build_flat_batch
from folio.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)

# Steps of up to this many tokens are captured as several graphs (graph_pieces), replayed one
# after another. A graph's first kernel starts only once the whole graph has been launched,
# which for a model's few hundred kernels took ~0.6-0.85 ms on the lent H100 (the gap between
# a verify step's input copies and its embedding; tools/gpu_verify_cost.py --gaps). Under
# async scheduling a plain step's launch hides behind the step before it, but a verify step
# is launched only after the previous one's kept tokens are known, so at batch 1 the device
# idled that long each step. In pieces, the first (one layer) starts at once and each later
# launch runs while the pieces before it execute. Large steps run long enough to hide it.
PIECEWISE_MAX_TOKENS = 64


def graph_pieces(num_layers: int) -> list[tuple[int, int]]:
    """The layer ranges [first, last) of a piecewise-captured step: one layer, then up to
    three, then the rest, each launched while the pieces before it run (a layer's work
    outlasts the next piece's launch; tools/gpu_verify_cost.py --gaps shows what is left).
    Small models split too (nothing to gain there, but the GPU tests' models then take the
    same path as large ones); a one-layer model stays whole."""
    bounds = [b for b in (0, 1, 4) if b < num_layers] + [num_layers]
    return list(zip(bounds[:-1], bounds[1:]))


def mixed_capture_sizes(max_num_tokens: int) -> list[int]:
    """Token counts to capture: powers of two from 8 to 512, then even steps of about an
    eighth of the budget (a multiple of 256), and the budget itself. Most mixed steps under
    chunked prefill fill the budget, so the coarse steps above 512 cost little padding. The
    smallest, 8, holds a batch-1 verify step of speculative decoding (1 + k tokens, k <= 7)
    in rows the few-row GEMV serves (gemv.MAX_M), where 16 ran its projections at three
    times its rows through cuBLAS and its attention over 11 padding tokens."""
    sizes = [s for s in (8, 16, 32, 64, 128, 256, 512) if s < max_num_tokens]
    step = max(512, -(-max_num_tokens // 8 // 256) * 256)
    sizes += [s for s in range(step, max_num_tokens, step) if s > 512]
    sizes.append(max_num_tokens)
    return sizes


class MixedGraphRunner:
    """Captures the forward pass of mixed steps at `mixed_capture_sizes` token counts and
    replays the smallest that fits. Without `capture()` (or on the CPU), `run` executes the
    same padded static path eagerly, which is how the padding is tested off the GPU."""

    def __init__(self, model: DecoderLM, kv_caches: list[torch.Tensor], *, block_size: int,
                 max_num_seqs: int, max_model_len: int, max_num_tokens: int,
                 device: torch.device) -> None:
        """Steps of up to PIECEWISE_MAX_TOKENS tokens are captured as graph_pieces where the
        model is one pipeline stage without EAGLE-3's kept states."""
        backend = triton_backend_of(model)
        assert backend is not None, "mixed-step graphs need the Triton attention backend"
        self.backend = backend
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.max_model_len = max_model_len
        self.sizes = mixed_capture_sizes(max_num_tokens)
        self.max_tokens = self.sizes[-1]
        self.max_reqs = max_num_seqs
        slots = max_num_seqs + 1  # + the dummy request of the padding tokens
        # Wide enough for the longest request and for the dummy's longest padding run.
        self.max_blocks = max(-(-max_model_len // block_size), -(-self.max_tokens // block_size))
        n, w = self.max_tokens, self.max_blocks
        dtype = next(model.parameters()).dtype

        def buffer(shape, dtype_, fill=0):
            return torch.full(shape, fill, dtype=dtype_, device=device)

        # Host buffers, written by the flat-batch builder (pinned on CUDA), and their device
        # mirror (one copy a step): the inputs the graphs read.
        self._host = StepBuffers(n, slots, w, pin=device.type == "cuda")
        self._device = self._host.mirror(device)
        t = self._device.tensors
        self.input_ids, self.positions = t["input_ids"], t["positions"]
        self.slot_mapping, self.query_start_loc = t["slot_mapping"], t["query_start_loc"]
        self.seq_lens, self.block_tables = t["seq_lens"], t["block_tables"]
        self.hidden = buffer((n, model.spec.hidden_size), dtype)
        self.aux = AuxStateBuffers(model, n, device)
        # Piecewise capture: the residual stream between pieces, in buffers outside the graph
        # pool (no graph's temporaries outlive its own replay).
        pieces = graph_pieces(len(model.stage_layers))
        if not (len(pieces) > 1 and model.pp.is_first and model.pp.is_last
                and not model.aux_hidden_layers):
            pieces = [(0, len(model.stage_layers))]
        self.pieces = pieces
        self.piece_max_tokens = min(PIECEWISE_MAX_TOKENS, n) if len(pieces) > 1 else 0
        m = self.piece_max_tokens
        self.mid_hidden = buffer((m, model.spec.hidden_size), model.norm_dtype())
        self.mid_residual = buffer((m, model.spec.hidden_size), model.norm_dtype())

        # Keyed (token count, piece): len(pieces) pieces up to piece_max_tokens, one above.
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._metas: dict[int, AttentionMetadata] = {}
        self.num_replays = 0
        self.replayed_sizes: set[int] = set()
        self.capture_seconds = 0.0

    # ---- capture --------------------------------------------------------------------------

    def _meta(self, n: int) -> AttentionMetadata:
        meta = self._metas.get(n)
        if meta is not None:
            return meta
        st = TritonStepTensors(
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
            block_tables=self.block_tables, slot_mapping=self.slot_mapping[:n],
            # Picks the attention kernel's tuning bucket; a step's own longest query may be
            # shorter, which costs some efficiency, never correctness.
            max_query_len=n, max_seq_len=self.max_model_len, all_decode=False)
        slots = self.seq_lens.shape[0]
        # The host-side lists are never read on this path (the backend finds its tensors in
        # the cache); they only keep the metadata well formed: everything in the dummy slot.
        meta = AttentionMetadata(
            slot_mapping=st.slot_mapping, query_start_loc=[0] + [n] * slots,
            seq_lens=[n] + [0] * (slots - 1), num_computed_tokens=[0] * slots,
            block_tables=self.block_tables, block_size=self.block_size)
        meta.cache[STEP_CACHE_KEY] = st
        self._metas[n] = meta
        return meta

    def _pieces_for(self, n: int) -> int:
        return len(self.pieces) if n <= self.piece_max_tokens else 1

    def _forward(self, key: tuple[int, int]) -> None:
        """Piece p of the forward of an n-token step (key (n, p)); the whole forward where
        n has one piece."""
        n, p = key
        if self._pieces_for(n) == 1:
            out = self.model(self.input_ids[:n], self.positions[:n], self.kv_caches,
                             self._meta(n))
            self.hidden[:n].copy_(out)
            self.aux.keep(n)
            return
        model = self.model
        first, last = self.pieces[p]
        if first == 0:
            hidden, residual = model.embed(self.input_ids[:n]), None
        else:
            hidden, residual = self.mid_hidden[:n], self.mid_residual[:n]
        hidden, residual = model.run_layers(first, last, self.positions[:n], hidden, residual,
                                            self.kv_caches, self._meta(n))
        if last == len(model.stage_layers):
            hidden, _ = model.norm(hidden, residual)
            self.hidden[:n].copy_(hidden)
        else:
            self.mid_hidden[:n].copy_(hidden)
            self.mid_residual[:n].copy_(residual)

    def _keys(self) -> list[tuple[int, int]]:
        """(count, piece) for every graph, in the order capture_graphs takes them reversed:
        the largest count first, each count's pieces in replay order."""
        return [(n, p) for n in self.sizes for p in reversed(range(self._pieces_for(n)))]

    def _stage_padding_only(self, key: tuple[int, int]) -> None:
        """Buffers for an all-padding step of n tokens (capture and its warm-up write nothing
        to the KV cache)."""
        n = key[0]
        self._copy_to_device(self._build(_EMPTY_STEP, None, {}, n), n)

    def _build(self, step: SchedulerOutput, batch: InputBatch | None, prev_rows: dict[str, int],
               n: int):
        self._host.wait_for_copies()
        return build_flat_batch(step, batch, prev_rows, self._host, self.block_size,
                                Padding.DUMMY_REQUEST, padded=n)

    def _copy_to_device(self, flat, n: int) -> None:
        self._host.copy_to(self._device, flat.num_reqs + 1)   # the dummy request's row too
        self._host.copies_queued()

    @torch.inference_mode()
    def capture(self) -> None:
        assert self.device.type == "cuda", "CUDA graphs need a CUDA device"
        start = time.perf_counter()
        self.graphs = capture_graphs(self._keys(), self._stage_padding_only, self._forward,
                                     self.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d CUDA graphs for mixed steps (token counts %s; up to %d "
                    "tokens in %d pieces) in %.1f s", len(self.graphs), self.sizes,
                    self.piece_max_tokens, len(self.pieces), self.capture_seconds)

    # ---- replay ---------------------------------------------------------------------------

    def can_run(self, step: SchedulerOutput) -> bool:
        return (0 < len(step.num_scheduled_tokens) <= self.max_reqs
                and step.total_num_scheduled_tokens <= self.max_tokens
                and not self._has_dense_prefill(step))

    def _has_dense_prefill(self, step: SchedulerOutput) -> bool:
        """Whether a request of the step takes the backend's dense prefill path (a long
        fresh prompt: attention through torch's fused kernel, which a graph captured for
        other shapes cannot replay). Such a step runs eagerly; its GPU time hides the
        launches."""
        if not self.backend.takes_dense_path(0, step.total_num_scheduled_tokens):
            return False    # no request of the step can be long enough (or the path is off)
        n = step.num_scheduled_tokens
        return any(self.backend.takes_dense_path(r.num_computed_tokens, n.get(r.req_id, 0))
                   for reqs in (step.scheduled_new_reqs, step.scheduled_cached_reqs)
                   for r in reqs)

    def run(self, step: SchedulerOutput, batch: InputBatch, prev_rows: dict[str, int],
            fill_pending: FillPending) -> tuple[torch.Tensor, list[int]]:
        """Run the step on the static buffers (replaying its graph when captured). Returns the
        final hidden states of the real tokens [T, hidden] (a view of the static output, valid
        until the next run) and the real requests' query_start_loc."""
        T = step.total_num_scheduled_tokens
        n = self.sizes[bisect.bisect_left(self.sizes, T)]
        flat = self._build(step, batch, prev_rows, n)
        self._copy_to_device(flat, n)
        if flat.pending_dst:
            fill_pending(self.input_ids, flat.pending_dst, flat.pending_src)
        pieces = self._pieces_for(n)
        if (n, 0) in self.graphs:
            for p in range(pieces):
                self.graphs[(n, p)].replay()
            self.num_replays += 1
            self.replayed_sizes.add(n)
        else:
            with torch.inference_mode():
                for p in range(pieces):
                    self._forward((n, p))
        self.aux.publish(T)
        return self.hidden[:T], flat.query_start_loc


# A step with no requests: staging it leaves only padding in the buffers.
_EMPTY_STEP = SchedulerOutput(step_id=0, scheduled_new_reqs=[], scheduled_cached_reqs=[],
                              num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                              sampling_req_ids=[], finished_req_ids=[], preempted_req_ids=[])
