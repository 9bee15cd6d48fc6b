"""A worker owns one device: it loads the model, sizes and allocates the KV cache, and runs steps."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any

import torch

from folio.config import EngineConfig
from folio.core.step_messages import GrammarBitmaskFn, ModelRunnerOutput, SchedulerOutput
from folio.core.startup_stages import STARTUP_STAGES
from folio.core.kv_cache_layout import KVCacheLayout, full_attention_layout, kv_cache_layout
from folio.model.attention.fp8 import fp8_max, is_fp8
from folio.model.attention.selector import check_kv_cache_dtype
from folio.model.families import ArchSpec
from folio.model.discovery import ModelSource, resolve_quantization
from folio.model.kernel_config import resolve_kernel_config
from folio.model.loader import load_model, resolve_dtype
from folio.model.pipeline_parallel import WHOLE, PPStage
from folio.model.tensor_parallel import SINGLE, TPGroup
from folio.worker.host_kv_pool import HostKVPool
from folio.worker.kv_connector import KVConnectorWorker, TierConnectorWorker
from folio.worker.kv_cache import (allocate_kv_caches, bytes_per_block, determine_num_blocks,
                                   gpu_kv_cache_bytes, resolve_cache_dtype)
from folio.worker.model_runner import ModelRunner, PendingRunnerOutput

logger = logging.getLogger(__name__)

# Quantization methods (config.QUANTIZATION_METHODS) that keep the target's projections packed
# on the CPU: an EAGLE head beside such a target is kept in int8 too (_load_eagle_head).
_CPU_PACKED_METHODS = ("gguf", "int8")

# Mixed steps above this many tokens run eagerly: their GPU work hides the launch overhead
# (with async scheduling), and a graph's activation pool grows with its token count.
MAX_MIXED_GRAPH_TOKENS = 8192

# Expert parallelism on a GPU: steps between reports of each rank's expert load.
EXPERT_LOAD_INTERVAL = 32



def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but no CUDA device is available")
    return torch.device(device)


def join_parallel(rank: int, tp_size: int, pp_size: int, init_method: str | None,
                  device: torch.device, expert_parallel: bool = False,
                  single_rank: bool = False) -> TPGroup:
    """This process as global rank `rank` of tp_size x pp_size ranks (torch.distributed: NCCL
    on GPUs, gloo on the CPU, meeting at `init_method`; rank = stage * tp_size + tp_rank).
    Returns its tensor-parallel group (SINGLE for tp_size 1): with pipeline stages, each
    stage's ranks form a group of their own. `expert_parallel`: mixture-of-experts layers
    spread their experts over the tensor-parallel group. `single_rank`
    (ParallelConfig.distributed_single_rank): one rank that joins a group of world size 1
    all the same and runs the tensor-parallel code path."""
    world = tp_size * pp_size
    if world == 1 and not single_rank:
        return SINGLE
    import torch.distributed as dist
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=init_method, rank=rank, world_size=world)
    stage, tp_rank = divmod(rank, tp_size)
    group = None   # the default (world) group, when it is the tensor-parallel group
    if pp_size > 1 and tp_size > 1:
        # every rank creates every stage's group, in the same order (torch.distributed's rule)
        for s in range(pp_size):
            made = dist.new_group(ranks=list(range(s * tp_size, (s + 1) * tp_size)))
            if s == stage:
                group = made
    if world == 1:
        return TPGroup(0, 1, expert_parallel=expert_parallel, single_rank_collectives=True)
    if tp_size == 1:
        return SINGLE
    return TPGroup(tp_rank, tp_size, group=group, expert_parallel=expert_parallel)


def pipeline_stage(rank: int, config: EngineConfig, hf_config: Any) -> PPStage:
    """Global rank `rank`'s pipeline stage (WHOLE without pipeline parallelism)."""
    from folio.model.families import arch_spec_from_hf_config
    from folio.model.pipeline_parallel import stage_of
    parallel = config.parallel
    return stage_of(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                    arch_spec_from_hf_config(hf_config).num_layers,
                    parallel.pp_layer_partition)


def _check_tp_features(config: EngineConfig, size: int) -> None:
    """ValueError for what tensor parallelism does not run yet."""
    what = None
    if config.lora is not None:
        what = "LoRA adapters"
    elif config.speculative is not None and config.speculative.drafts_on_worker:
        what = "a speculative draft model or head"
    elif config.pooling is not None:
        what = "pooling models"
    if what is not None:
        raise ValueError(f"tensor_parallel_size={size}: {what} are not supported with tensor "
                         "parallelism yet")


def _check_pp_features(config: EngineConfig, size: int, spec: ArchSpec) -> None:
    """ValueError for what pipeline parallelism does not run yet."""
    what = None
    if config.lora is not None:
        what = "LoRA adapters"
    elif config.speculative is not None:
        what = "speculative decoding"
    elif config.pooling is not None:
        what = "pooling models"
    elif any(window is not None for window in spec.sliding_windows):
        what = "models with sliding-window layers (their KV cache groups span the stages)"
    elif spec.mla is not None:
        what = "latent-attention (DeepSeek) models"
    if what is not None:
        raise ValueError(f"pipeline_parallel_size={size}: {what} are not supported with "
                         "pipeline parallelism yet")


def _format_bytes(num: int) -> str:
    return f"{num / 2**30:.2f} GiB" if num >= 2**30 else f"{num / 2**20:.1f} MiB"


class Worker:
    def __init__(self, config: EngineConfig, source: ModelSource, hf_config: Any,
                 tp: TPGroup = SINGLE, pp: PPStage = WHOLE) -> None:
        """`tp`: this worker's rank in a tensor-parallel group (the worker process joined
        torch.distributed's group first); it holds that rank's slice of the model. `pp`:
        its pipeline stage, whose layers (and their KV cache) alone it holds."""
        self.config = config
        self.tp = tp
        self.pp = pp
        self._steps_since_load = 0   # expert parallelism's load report (execute_model_async)
        self._moe_blocks: list | None = None
        pp.communicate = False   # start-up runs (profiling, warm-up) are each stage's own
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, hf_config, self.device)
        # How the weights are kept (config.QUANTIZATION_METHODS), decided here: it depends on
        # the device.
        self.quantization = resolve_quantization(config.model.quantization, source,
                                                 self.device.type, hf_config)
        if pp.size > 1:
            from folio.model.families import arch_spec_from_hf_config
            _check_pp_features(config, pp.size, arch_spec_from_hf_config(hf_config))
        if tp.sharded:
            _check_tp_features(config, tp.size)
        if tp.sharded or pp.size > 1:
            if self.quantization == "gguf" and config.model.quantization is None:
                # a GGUF's packed planes are not split; its converted float weights are
                self.quantization = "none"
        # The KV cache's dtype (--kv-cache-dtype; "auto" = the model's, float16 for GGUF
        # weights on the CPU), checked against the attention backend the model will get before
        # any weight is read.
        self.kv_cache_dtype = resolve_cache_dtype(config.cache.cache_dtype, self.dtype,
                                                  self.quantization)
        kernel_config = resolve_kernel_config(speculative=config.speculative is not None)
        check_kv_cache_dtype(self.device, self.dtype, self.kv_cache_dtype, kernel_config)
        torch.manual_seed(config.model.seed)
        # Seconds spent in each start-up stage, for benchmarks' start-to-ready split. A stage that
        # did not run (profiling without CUDA or with a fixed KV size, graph capture on the CPU
        # or with enforce_eager) counts 0.0.
        self.timings: dict[str, float] = dict.fromkeys(STARTUP_STAGES, 0.0)
        # What sleep mode has freed ("weights", "kv_cache"); empty = awake.
        self.asleep: set[str] = set()
        start = time.perf_counter()
        logger.info("loading weights from %s (%s, %s)", source.path, self.dtype, self.device)
        if config.pooling is not None:
            from folio.model.families import arch_spec_from_hf_config
            from folio.model.pooling_loader import encoder_matmul_dtype, load_pooling_model
            matmul_dtype = encoder_matmul_dtype(config.model.dtype, self.device,
                                                arch_spec_from_hf_config(hf_config))
            if matmul_dtype is not None:
                self.dtype = torch.float32   # the activations; the projections bfloat16
                logger.info("encoder projections in bfloat16, embeddings, norms and "
                            "activations in float32 (--dtype bfloat16 on the CPU)")
            self.model, self.spec = load_pooling_model(
                source, hf_config, config.pooling, self.dtype, self.device,
                config.model.max_model_len, kernel_config=kernel_config,
                quantization=self.quantization, matmul_dtype=matmul_dtype)
        else:
            self.model, self.spec = load_model(source, hf_config, self.dtype, self.device,
                                               config.model.max_model_len,
                                               kernel_config=kernel_config,
                                               quantization=self.quantization,
                                               kv_cache_dtype=self.kv_cache_dtype, tp=tp,
                                               pp=pp)
        # LoRA adapters' device slots in every projection (their memory is the model's, so
        # the KV cache is sized after them).
        self.lora = None
        if config.lora is not None:
            from folio.worker.lora_manager import LoRAManager
            sched = config.scheduler
            self.lora = LoRAManager(self.model, self.spec, config.lora, self.dtype, self.device,
                                    max(sched.max_num_batched_tokens, sched.max_num_seqs))
        # A vision-language model's image encoder (None for a text model).
        self.hf_config_vision = getattr(hf_config, "vision_language", None)
        self.vision_encoder = self._load_vision_encoder(source, hf_config)
        # (image tokens, bytes) of the encoder's pass in the memory profile, once measured.
        self.encoder_profile: tuple[int, int] | None = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # weight copies still in flight belong here
        # Speculative decoding's draft model (None without one): loaded like the target,
        # its KV cache sized and addressed in the target's blocks.
        self.draft_model, self.draft_spec = self._load_draft_model(kernel_config, source,
                                                                   hf_config)
        self.load_seconds = time.perf_counter() - start
        self.timings["load_s"] = self.load_seconds
        self.kv_cache_layout = self._kv_cache_layout()
        # What this worker's cache holds: every layer's, or its pipeline stage's (one
        # full-attention group; the scheduler still counts blocks by the whole model's layout).
        self.kv_spec, self.kv_alloc_layout = self.spec, self.kv_cache_layout
        if pp.size > 1:
            num_stage_layers = len(self.model.stage_layers)
            self.kv_spec = replace(self.spec, num_layers=num_stage_layers, sliding_windows=())
            self.kv_alloc_layout = full_attention_layout(num_stage_layers)
        cache = config.cache
        kv_bytes = cache.kv_cache_memory_bytes
        if self.device.type == "cuda" and cache.num_gpu_blocks_override is None \
                and kv_bytes is None and not self.spec.is_encoder:
            start = time.perf_counter()
            from folio.worker import profile_cache
            key = profile_cache.profile_key(config, kernel_config, source.path,
                                            profile_cache.gpu_name(self.device))
            stored = profile_cache.load_activation_bytes(key)
            kv_bytes, measured = gpu_kv_cache_bytes(self._profile_run, self.device,
                                                    cache.gpu_memory_utilization, stored,
                                                    self._peak_detail)
            if stored is None:
                profile_cache.store_activation_bytes(key, measured)
            else:
                logger.info("KV profiling: the result of an identical earlier start reused "
                            "(%.2f GiB above the weights)", stored / 2**30)
            self.timings["profile_s"] = time.perf_counter() - start
        start = time.perf_counter()
        layout = self.kv_alloc_layout
        self.num_blocks = determine_num_blocks(
            self.kv_spec, block_size=cache.block_size, dtype=self.kv_cache_dtype,
            max_model_len=config.model.max_model_len,
            kv_cache_memory_bytes=kv_bytes,
            num_blocks_override=cache.num_gpu_blocks_override,
            extra_bytes_per_block=0 if self.draft_spec is None else
            bytes_per_block(self.draft_spec, cache.block_size, self.kv_cache_dtype),
            layout=layout, max_step_tokens=config.scheduler.max_num_batched_tokens,
            max_num_seqs=config.scheduler.max_num_seqs)
        self.kv_caches = allocate_kv_caches(self.kv_spec, self.num_blocks, cache.block_size,
                                            self.kv_cache_dtype, self.device, layout)
        if layout.num_groups > 1:
            for layer, (group, _) in zip(self.model.layers,
                                         layout.layer_placement(self.spec.num_layers)):
                layer.self_attn.kv_group = group
        # The host-memory KV tier's pool (--kv-offloading-size): evicted prefix blocks kept
        # in host memory, loaded back on a hit.
        self.host_kv = None
        self.host_block_bytes = HostKVPool.bytes_per_slot(self.kv_caches) if self.kv_caches else 0
        if cache.kv_offloading_size is not None:
            num_slots = int(cache.kv_offloading_size * 2**30) // max(self.host_block_bytes, 1)
            if num_slots < 1:
                raise ValueError(f"kv_offloading_size={cache.kv_offloading_size} GiB holds no "
                                 f"block of {self.host_block_bytes} bytes")
            if layout.num_groups > 1 or self.draft_spec is not None:
                raise ValueError("kv_offloading_size: the host KV tier runs with one "
                                 "full-attention KV cache group and no draft model's cache")
            self.host_kv = HostKVPool(self.kv_caches, num_slots)
            logger.info("host KV tier: %d blocks (%s) in host memory", num_slots,
                        _format_bytes(num_slots * self.host_block_bytes))
        # The disk KV tier's files (--kv-disk-path): blocks the host tier evicts.
        self.disk_kv = None
        if cache.kv_disk_path is not None:
            if tp.size > 1 or pp.size > 1:
                raise ValueError("kv_disk_path: the disk KV tier runs with one worker (no "
                                 "tensor or pipeline parallelism) yet")
            from folio.worker.disk_kv_store import DiskKVStore, namespace_of
            namespace = namespace_of(source.path, repr(self.spec), str(self.kv_cache_dtype),
                                     cache.block_size, [tuple(c.shape[:1]) + tuple(c.shape[2:])
                                                        for c in self.kv_caches])
            self.disk_kv = DiskKVStore(cache.kv_disk_path, namespace, self.host_kv)
            logger.info("disk KV tier: %s (%d blocks there)", self.disk_kv.dir,
                        len(self.disk_kv.existing()))
        # Disaggregated prefill (a P2pConnector --kv-transfer-config): serves finished
        # prompts' KV to decode servers, or fetches it from prefill servers.
        self.kv_p2p = None
        if config.kv_transfer is not None:
            self.kv_p2p = self._start_kv_p2p(config, source, layout, tp, pp)
        # The KV connector (one at a time): the tiers' copies, or disaggregated prefill's.
        self.kv_connector: KVConnectorWorker | None = self.kv_p2p if self.host_kv is None \
            else TierConnectorWorker(self.host_kv, self.disk_kv)
        self.draft_kv_caches = [] if self.draft_spec is None else allocate_kv_caches(
            self.draft_spec, self.num_blocks, cache.block_size, self.kv_cache_dtype, self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the allocation's memset, not the next stage's
        self.timings["kv_alloc_s"] = time.perf_counter() - start
        # --calculate-kv-scales: the runner's first real step sets the FP8 cache's scales.
        self.runner = self._new_runner(
            self.kv_caches,
            calculate_kv_scales=cache.calculate_kv_scales and is_fp8(self.kv_cache_dtype))
        if self.draft_model is not None:
            self.runner.draft_proposer = self._new_proposer()
        if self.device.type == "cuda":
            start = time.perf_counter()
            logger.info("warming up kernels (Triton compiles and autotunes on a first start)")
            self.runner.warm_up(min(config.scheduler.max_num_batched_tokens,
                                    config.model.max_model_len))
            self.timings["warm_up_s"] = time.perf_counter() - start
        start = time.perf_counter()
        self.graph_runner = self._capture_decode_graphs()
        self.mixed_graph_runner = self._capture_mixed_graphs()
        if self.graph_runner is not None:
            self.timings["graph_capture_s"] = time.perf_counter() - start
        self.runner.graph_runner = self.graph_runner
        self.runner.mixed_graph_runner = self.mixed_graph_runner
        if self.device.type == "cuda" and config.pooling is None and pp.is_last:
            self.runner.warm_up_sampling(config.scheduler.max_num_seqs)
        pp.communicate = True    # the start-up runs are done: the stages pass the stream on
        with torch.inference_mode():
            for module in self.model.modules():   # nor do they count as expert load
                if getattr(module, "expert_load", None) is not None:
                    module.expert_load.zero_()
        kv_total = self.num_blocks * bytes_per_block(self.kv_spec, cache.block_size,
                                                     self.kv_cache_dtype, layout.group_size)
        max_len = config.model.max_model_len
        logger.info("model loaded in %.1f s (%s, %s%s); KV cache: %d blocks of %d = %d tokens "
                    "(%s, %s)%s; max concurrency at %d tokens: %.1fx", self.load_seconds,
                    self.dtype, self.device,
                    "" if self.quantization == "none" else f", quantization {self.quantization}",
                    self.num_blocks, cache.block_size,
                    self.num_blocks * cache.block_size,
                    str(self.kv_cache_dtype).removeprefix("torch."), _format_bytes(kv_total),
                    "" if layout.num_groups == 1 else
                    f" shared by {layout.num_groups} KV cache groups of {layout.group_size} "
                    f"layer{'s' if layout.group_size > 1 else ''}", max_len,
                    (self.num_blocks - layout.num_reserved_blocks)
                    / layout.blocks_per_sequence(max_len, cache.block_size))
        if is_fp8(self.kv_cache_dtype):
            self._log_kv_scales()

    def _kv_cache_layout(self) -> KVCacheLayout:
        """The KV cache groups (folio/core/kv_cache_layout.py) by the layers' windows. A draft
        model or EAGLE head keeps its K/V in the target's blocks through one block table, so
        with one the cache stays a single full-attention group (every block kept)."""
        windows = self.spec.sliding_windows
        if self.draft_model is not None and any(w is not None for w in windows):
            logger.info("KV cache: one full-attention group (blocks out of the sliding window "
                        "kept): the %s shares the target's block table",
                        self.config.speculative.method)
            return full_attention_layout(self.spec.num_layers)
        return kv_cache_layout(windows, self.spec.num_layers, self.config.model.max_model_len)

    def _new_proposer(self):
        spec_config = self.config.speculative
        common = dict(block_size=self.config.cache.block_size,
                      num_speculative_tokens=spec_config.num_speculative_tokens,
                      max_model_len=self.config.model.max_model_len, device=self.device)
        if spec_config.method == "draft_model":
            from folio.worker.draft_model import DraftModelProposer
            return DraftModelProposer(self.draft_model, self.draft_kv_caches, **common)
        from folio.worker.eagle_proposer import EagleProposer
        return EagleProposer(self.draft_model, self.model, self.draft_kv_caches, **common)

    def _load_draft_model(self, kernel_config, target_source: ModelSource,
                          target_hf_config: Any) -> tuple[Any, ArchSpec | None]:
        """speculative_config's draft model, EAGLE head or (mtp) the target's own
        multi-token-prediction module, on this device in the target's dtype (a draft model
        with its own quantization, as its files say). Its vocabulary must be the target's:
        its token ids are proposed to the target as they are."""
        spec_config = self.config.speculative
        if spec_config is None or not spec_config.drafts_on_worker:
            return None, None
        if spec_config.method == "mtp":
            from folio.model.attention.selector import get_attention_backend
            from folio.model.loader import iter_checkpoint_weights
            from folio.model.mtp import load_mtp_head
            logger.info("loading the multi-token-prediction module from %s",
                        target_source.path)
            return load_mtp_head(iter_checkpoint_weights(target_source), target_hf_config,
                                 self.spec, self.dtype, self.device,
                                 self.config.model.max_model_len,
                                 get_attention_backend(self.device, kernel_config),
                                 kernel_config)
        from folio.model.discovery import load_hf_config, resolve_model_source
        try:
            source = resolve_model_source(spec_config.model, spec_config.revision)
            hf_config, _ = load_hf_config(source)
        except ValueError as exc:
            raise ValueError(f"speculative_config.model: {exc}") from None
        if spec_config.method in ("eagle", "eagle3"):
            return self._load_eagle_head(spec_config.method, source.path, hf_config,
                                         kernel_config)
        quantization = resolve_quantization(None, source, self.device.type, hf_config)
        logger.info("loading the draft model from %s", source.path)
        model, spec = load_model(source, hf_config, self.dtype, self.device,
                                 self.config.model.max_model_len, kernel_config=kernel_config,
                                 quantization=quantization)
        if spec.vocab_size != self.spec.vocab_size:
            raise ValueError(f"speculative_config.model: the draft model's vocabulary has "
                             f"{spec.vocab_size} tokens, the target's {self.spec.vocab_size}; "
                             "a draft model must share the target's tokenizer")
        return model, spec

    def _load_eagle_head(self, method: str, path: str, hf_config: Any, kernel_config):
        from folio.model.attention.selector import get_attention_backend
        from folio.model.eagle import default_aux_layers, load_eagle_head
        logger.info("loading the %s head from %s", method, path)
        head, spec = load_eagle_head(method, path, hf_config, self.model, self.spec,
                                     self.dtype, self.device, self.config.model.max_model_len,
                                     get_attention_backend(self.device, kernel_config),
                                     kernel_config)
        if self.device.type == "cpu" and self.quantization in _CPU_PACKED_METHODS:
            # beside a target kept packed on the CPU the head's float32 projections cost as
            # much as several target layers (2.6 ms a step against ~14 ms for SmolLM2's 30
            # 4-bit layers): int8 per channel, as --quantization int8 keeps a target. The
            # drafts may change, never the output.
            from folio.model.quant.int8_install import quantize_linears
            logger.info("the %s head's projections: int8 (%d), beside the %s target",
                        method, quantize_linears(head), self.quantization)
        if method == "eagle3":
            layers = tuple(getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)
                           or default_aux_layers(self.spec.num_layers))
            if len(layers) != 3 or not all(0 <= i < self.spec.num_layers for i in layers):
                raise ValueError(f"speculative_config.model: eagle_aux_hidden_state_layer_ids "
                                 f"{list(layers)} must be three of the target's "
                                 f"{self.spec.num_layers} layers")
            self.model.aux_hidden_layers = layers
        return head, spec

    def _log_kv_scales(self) -> None:
        """Where the FP8 cache's scales come from; vLLM warns of 1.0 too."""
        if self.config.cache.calculate_kv_scales:
            logger.info("FP8 KV cache: scales computed at start-up from a calibration text's "
                        "keys and values (the engine's first step)")
        elif self.model.kv_scales_loaded:
            logger.info("FP8 KV cache: scales from the checkpoint")
        else:
            logger.warning("FP8 KV cache with scales 1.0 (the checkpoint has none): keys and "
                           "values past %g saturate; calculate_kv_scales computes scales from "
                           "a calibration text at start-up", fp8_max(self.kv_cache_dtype))

    def _profile_run(self) -> int:
        """One forward pass at the largest step (max_num_batched_tokens tokens, logits for
        max_num_seqs rows), on a scratch KV cache just big enough. Returns the scratch bytes."""
        cache = self.config.cache
        num_tokens = min(self.config.scheduler.max_num_batched_tokens, self.config.model.max_model_len)
        num_blocks = -(-num_tokens // cache.block_size)
        scratch = allocate_kv_caches(self.kv_spec, num_blocks, cache.block_size,
                                     self.kv_cache_dtype, self.device)
        runner = self._new_runner(scratch)
        runner.profile_run(num_tokens, self.config.scheduler.max_num_seqs)
        if runner.encoder_profile_bytes is not None:
            self.encoder_profile = (runner.images.max_pass_tokens, runner.encoder_profile_bytes)
        del runner, scratch
        return num_blocks * bytes_per_block(self.kv_spec, cache.block_size, self.kv_cache_dtype)

    def _peak_detail(self) -> str:
        """What the start-up message says of the peak's parts and the flags that lower it
        (a vision-language model's encoder batch among them)."""
        if self.vision_encoder is None:
            return ""
        if self.encoder_profile is None:
            return " (the vision encoder's batch included)"
        tokens, peak = self.encoder_profile
        return (f" (the vision encoder's {peak / 2**30:.2f} GiB for a pass of {tokens} image "
                "tokens included; lower --limit-mm-per-prompt, --max-num-batched-tokens or "
                "the processor's max_pixels to shrink it)")

    def _load_vision_encoder(self, source, hf_config):
        vision = getattr(hf_config, "vision_language", None)
        if vision is None:
            return None
        if self.tp.size > 1 or self.pp.size > 1:
            raise ValueError("vision-language models run on one worker (no tensor or "
                             "pipeline parallelism) yet")
        from folio.model.loader import iter_checkpoint_weights
        from folio.model.vision import build_vision_encoder
        encoder = build_vision_encoder(vision, self.spec.hidden_size, source.path,
                                       iter_checkpoint_weights(source),
                                       self.config.multimodal.mm_processor_kwargs)
        return encoder.to(self.device, self.dtype).eval()

    def _new_runner(self, kv_caches: list[torch.Tensor],
                    calculate_kv_scales: bool = False) -> ModelRunner:
        sched = self.config.scheduler
        runner = ModelRunner(self.model, kv_caches, self.config.cache.block_size, self.device,
                             max_num_seqs=sched.max_num_seqs,
                             max_model_len=self.config.model.max_model_len,
                             max_num_tokens=sched.max_num_batched_tokens,
                             calculate_kv_scales=calculate_kv_scales,
                             num_kv_groups=self.kv_cache_layout.num_groups)
        if self.config.pooling is not None:
            from folio.worker.pooling import PoolingRunner
            runner.pooling = PoolingRunner(self.model.pooler, self.config.pooling.pooling_type)
        runner.lora = self.lora
        if self.vision_encoder is not None:
            from folio.worker.image_embeds import ImageEmbedder, max_encoder_tokens
            runner.images = ImageEmbedder(self.vision_encoder, self.device, max_encoder_tokens(
                sched.max_num_batched_tokens, self.vision_encoder.largest_image_tokens,
                self.config.multimodal.limit("image"), sched.max_num_seqs))
            vision = self.hf_config_vision
            if vision["kind"] == "qwen2_vl":
                runner.mrope_merge = vision["spatial_merge_size"]
        return runner

    def _capture_decode_graphs(self):
        """CUDA graphs for pure-decode steps, captured once the KV cache exists (they bake in
        its addresses). None on CPU, with enforce_eager, or with a backend that has no static
        path (FOLIO_ATTENTION=torch)."""
        if self.device.type != "cuda" or self.config.model.enforce_eager:
            return None
        if self.config.pooling is not None:
            return None   # pooling steps are whole prompts, the mixed steps' eager path
        if self.pp.size > 1:
            # a stage's forward receives and sends the stream outside any graph
            logger.info("CUDA graphs off: pipeline parallelism")
            return None
        if self.kv_cache_layout.num_groups > 1:
            # The graphs' static buffers hold one block table and slot mapping per step.
            logger.info("CUDA graphs off: the KV cache has %d groups (sliding-window and full "
                        "layers)", self.kv_cache_layout.num_groups)
            return None
        from folio.worker.cuda_graphs import DecodeGraphRunner, triton_backend_of
        if triton_backend_of(self.model) is None:
            logger.info("CUDA graphs off: the attention backend is not Triton")
            return None
        runner = DecodeGraphRunner(
            self.model, self.kv_caches, block_size=self.config.cache.block_size,
            max_num_seqs=self.config.scheduler.max_num_seqs,
            max_model_len=self.config.model.max_model_len, device=self.device,
            lora_batch=None if self.lora is None else self.lora.batch)
        runner.capture()
        return runner

    def _capture_mixed_graphs(self):
        """CUDA graphs for mixed steps (prefill chunks, with decodes beside them), at padded
        token counts up to the step budget; only with decode graphs and cudagraph_mode "full"."""
        if self.graph_runner is None or self.config.model.cudagraph_mode != "full":
            return None
        from folio.worker.mixed_graphs import MixedGraphRunner
        sched = self.config.scheduler
        runner = MixedGraphRunner(
            self.model, self.kv_caches, block_size=self.config.cache.block_size,
            max_num_seqs=sched.max_num_seqs, max_model_len=self.config.model.max_model_len,
            max_num_tokens=min(sched.max_num_batched_tokens, MAX_MIXED_GRAPH_TOKENS),
            device=self.device)
        # With LoRA, mixed graphs hold the adapters' kernels (a step without adapters pays
        # their early exits); decode graphs are captured both ways.
        if self.lora is not None:
            self.lora.batch.force = True
        try:
            runner.capture()
        finally:
            if self.lora is not None:
                self.lora.batch.force = False
        return runner

    @property
    def arch_spec(self) -> ArchSpec:
        return self.spec

    # ---- sleep mode ------------------------------------------------------------------------

    def sleep(self) -> dict[str, int]:
        """Sleep level 1: the KV cache and the CUDA graphs freed, the weights moved to host
        memory (through a bounded pinned buffer: folio/worker/sleep.py; on the CPU they are
        host memory already). Returns the bytes freed of each. The engine calls it only
        when no request is in flight, and resets the prefix cache (the KV is gone)."""
        from folio.worker.sleep import offload_to_host, tensors_bytes, trim_host_heap
        if self.draft_model is not None:
            raise ValueError("sleep mode with a speculative draft model or head is not supported")
        self.graph_runner = self.mixed_graph_runner = None
        self.runner.graph_runner = self.runner.mixed_graph_runner = None
        kv_bytes = tensors_bytes(self.kv_caches)
        self.kv_caches = []
        self.runner.kv_caches = []
        if self.lora is not None:
            self.lora.before_weights_move()
        weight_bytes = offload_to_host(self.model)
        self.asleep = {"weights", "kv_cache"}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        else:
            trim_host_heap()
        logger.info("asleep: KV cache freed (%s), weights moved to host memory (%s)",
                    _format_bytes(kv_bytes), _format_bytes(weight_bytes))
        return {"kv_cache": kv_bytes, "weights": weight_bytes}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep freed: `tags` "weights" and / or "kv_cache" (None: both, and
        then the CUDA graphs are captured again)."""
        from folio.worker.sleep import reload_to_device
        asleep = self.asleep
        for tag in tags or sorted(asleep):
            if tag not in ("weights", "kv_cache"):
                raise ValueError(f"tags: unknown tag {tag!r} (weights, kv_cache)")
            if tag not in asleep:
                continue
            if tag == "weights":
                reload_to_device(self.model, self.device)
                if self.lora is not None:
                    self.lora.after_weights_move(self.model)
            else:
                cache = self.config.cache
                self.kv_caches = allocate_kv_caches(self.spec, self.num_blocks, cache.block_size,
                                                    self.kv_cache_dtype, self.device,
                                                    self.kv_cache_layout)
                self.runner.kv_caches = self.kv_caches
            asleep.discard(tag)
        if not asleep and self.device.type == "cuda":
            self.graph_runner = self._capture_decode_graphs()
            self.mixed_graph_runner = self._capture_mixed_graphs()
            self.runner.graph_runner = self.graph_runner
            self.runner.mixed_graph_runner = self.mixed_graph_runner
        self.asleep = asleep

    def execute_model(self, step: SchedulerOutput,
                      grammar_bitmask: GrammarBitmaskFn | None = None) -> ModelRunnerOutput:
        return self.runner.execute_model(step, grammar_bitmask)

    def execute_model_async(self, step: SchedulerOutput,
                            grammar_bitmask: GrammarBitmaskFn | None = None) -> PendingRunnerOutput:
        connector = self.kv_connector
        loads = None if connector is None else connector.start_load_kv(step, self.kv_caches)
        if loads is not None:
            # the step (and later work on this stream: the next step's saves into host slots
            # these loads read) after every load
            torch.cuda.current_stream().wait_event(loads)
        pending = self.runner.execute_model_async(step, grammar_bitmask)
        if connector is not None:
            connector.get_finished(step, pending)
        if self.tp.expert_parallel and self.tp.size > 1:
            self._steps_since_load += 1
            # every step on the CPU; on a GPU every EXPERT_LOAD_INTERVAL steps (reading the
            # counts waits for the device)
            if self.device.type != "cuda" or self._steps_since_load >= EXPERT_LOAD_INTERVAL:
                pending.expert_load = self._gather_expert_load()
                self._steps_since_load = 0
        return pending

    def _start_kv_p2p(self, config, source, layout, tp, pp):
        if tp.size > 1 or pp.size > 1:
            raise ValueError("kv_transfer_config: the P2pConnector runs with one worker (no "
                             "tensor or pipeline parallelism) yet")
        if layout.num_groups > 1 or self.draft_spec is not None:
            raise ValueError("kv_transfer_config: the P2pConnector runs with one "
                             "full-attention KV cache group and no draft model's cache")
        from folio.worker.disk_kv_store import namespace_of
        from folio.worker.kv_p2p import P2PKVTransfer
        # what a consumer checks before it takes a producer's bytes: the same model (by
        # its file's name), dtype and layout
        layout_id = namespace_of(os.path.basename(str(source.path).rstrip("/")),
                                 repr(self.spec), str(self.kv_cache_dtype),
                                 config.cache.block_size,
                                 [tuple(c.shape[:1]) + tuple(c.shape[2:]) for c in self.kv_caches])
        return P2PKVTransfer(config.kv_transfer, lambda: self.kv_caches, tp.rank, layout_id)

    @torch.inference_mode()
    def _gather_expert_load(self) -> list[int]:
        """(token, expert) pairs each rank's experts ran since the last call, summed over the
        MoE layers, in rank order (an all-gather over the tensor-parallel group: every rank
        calls it at the same step)."""
        import torch.distributed as dist
        mine = torch.zeros((), dtype=torch.int64, device=self.device)
        if self._moe_blocks is None:   # found once: this runs every step on the CPU
            self._moe_blocks = [m for m in self.model.modules() if hasattr(m, "expert_load")]
        for module in self._moe_blocks:
            load = module.expert_load
            if load is not None:
                mine += load.sum()
                load.zero_()
        parts = [torch.zeros_like(mine) for _ in range(self.tp.size)]
        dist.all_gather(parts, mine, group=self.tp.group)
        return [int(part) for part in parts]
