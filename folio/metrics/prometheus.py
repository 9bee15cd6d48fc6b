"""Prometheus metrics for one folio engine, named like vLLM's (``folio:`` instead of ``vllm:``).

The async front end calls :class:`EngineMetrics` as requests run: once per scheduler step with
the scheduler's stats, and per request as it is added, produces tokens, finishes or is aborted.
``render()`` gives the text exposition for a ``/metrics`` endpoint.

Each instance owns its own ``CollectorRegistry`` rather than using prometheus_client's global
one: registering the same metric name twice in one registry raises, so several engines (or
tests) in one process would otherwise clash.

Everything is called from a single asyncio loop, so no locking is done here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

if TYPE_CHECKING:  # only for annotations; keeps this module free of engine imports
    from folio.core.engine_core_outputs import SchedulerStats

PREFIX = "folio:"

# Finish reasons pre-created on request_success so they are exported (at 0) from the start,
# which lets dashboards compute ratios before the first request of each kind finishes.
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")
ABORT_REASON = "abort"

# Why a structured-output constraint is not enforced by the backend "auto" tries first
# (folio.structured_output.compilers.FALLBACK_REASONS; kept literal here so this module stays
# free of engine imports). Pre-created so each is exported at 0 from the start.
STRUCTURED_OUTPUT_FALLBACK_REASONS: tuple[str, ...] = (
    "xgrammar_rejected", "unenforced_feature", "best_effort_partial")

# folio:lora_requests_total keeps at most this many adapter names as label values; requests
# of any later name count under LORA_OTHER. Adapters loaded at run time (or through the
# resolver directory) could otherwise grow the series without bound.
MAX_LORA_NAME_LABELS = 1024
LORA_OTHER = "other"

# Latency buckets (seconds). Dense where interactive serving lives (tens of ms to a few
# seconds), then coarse out to long-queue / long-generation tails.
TTFT_BUCKETS: list[float] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]
ITL_BUCKETS: list[float] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]
REQUEST_LATENCY_BUCKETS: list[float] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to and including ``max_value`` (at least ``[1]``).

    Token-length histograms are scaled to the model's context so a 2k model doesn't carry
    empty buckets up to 1M and a 128k model still resolves its long requests.
    """
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets or [1.0]
            buckets.append(float(value))
        exponent += 1


@dataclass
class _RequestState:
    """What we must remember about an in-flight request to derive its latencies."""

    arrival_time: float
    num_prompt_tokens: int
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    queue_time_observed: bool = False


class EngineMetrics:
    """Prometheus metrics for one engine, in a private registry, labelled by ``model_name``."""

    CONTENT_TYPE: str = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, max_model_len: int, *, max_lora: int = 0,
                 cache_info: dict[str, str] | None = None) -> None:
        """`max_lora`: the adapters a step may run (--max-loras); 0 = LoRA off, and the
        LoRA metrics are not exported. `cache_info`: the KV cache's settings as
        `cache_config_info` labels (CacheConfig.metrics_info)."""
        self.model_name = model_name
        self._cache_info = dict(cache_info or {})
        self.max_model_len = max_model_len
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests: dict[str, _RequestState] = {}
        # Last cumulative values seen in SchedulerStats, to turn them into counter deltas.
        self._last_cumulative: dict[str, int] = {}
        self._cache_info_blocks: int | None = None

        labels = ["model_name"]
        reg = self.registry
        p = PREFIX

        # --- scheduler state (gauges: last observed value) ---
        # Scheduler metrics are labelled by `engine` too (the data-parallel replica, "0"
        # with one engine), as vLLM's are.
        engine_labels = ["model_name", "engine"]
        self._g_running = Gauge(
            p + "num_requests_running", "Number of requests in model execution batches.",
            engine_labels, registry=reg)
        self._g_waiting = Gauge(
            p + "num_requests_waiting", "Number of requests waiting to be processed.",
            engine_labels, registry=reg)
        self._g_kv_usage = Gauge(
            p + "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
            engine_labels, registry=reg)
        # State held per request, by process (folio's own): 0 when idle, or it is leaking.
        self._g_tracked = Gauge(
            p + "tracked_requests", "Requests a process holds state for (engine: the "
            "scheduler; api: streams, output processor and metrics).",
            ["model_name", "process"], registry=reg)
        self._g_tracked_engine = self._g_tracked.labels(model_name, "engine")
        self._engine_tracked: dict[int, int] = {}
        self._g_tracked.labels(model_name, "api").set_function(
            lambda: len(self._requests) + sum(f() for f in self._api_trackers))
        self._api_trackers: list = []
        # Info-style gauge (always 1); the block count lives in a label, like vLLM's.
        self._g_cache_info = Gauge(
            p + "cache_config_info", "Information of the KV cache configuration.",
            ["model_name", "num_gpu_blocks", *self._cache_info], registry=reg)

        # --- cumulative scheduler counters (fed as deltas) ---
        # prometheus_client appends "_total" on exposition: folio:num_preemptions_total etc.
        self._c_preemptions = Counter(
            p + "num_preemptions", "Cumulative number of preemptions from the engine.",
            engine_labels, registry=reg)
        self._c_prefix_queries = Counter(
            p + "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            engine_labels, registry=reg)
        self._c_prefix_hits = Counter(
            p + "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
            engine_labels, registry=reg)
        # Data parallelism (--data-parallel-size): requests routed to each replica, and
        # those routed there because it held their prefix (track_dp_routing; absent with
        # one engine).
        self._dp_routed: Any = None
        self._dp_prefix_routed: Any = None
        for family in (self._g_running, self._g_waiting, self._g_kv_usage, self._c_preemptions,
                       self._c_prefix_queries, self._c_prefix_hits):
            family.labels(model_name, "0")   # exported (as 0) before the first step

        # --- speculative decoding (vLLM's spec_decode counters and labels; zero when off) ---
        self._c_spec_drafts = Counter(
            p + "spec_decode_num_drafts", "Number of spec decoding drafts.",
            engine_labels, registry=reg)
        self._c_spec_draft_tokens = Counter(
            p + "spec_decode_num_draft_tokens", "Number of draft tokens.",
            engine_labels, registry=reg)
        self._c_spec_accepted = Counter(
            p + "spec_decode_num_accepted_tokens", "Number of accepted tokens.",
            engine_labels, registry=reg)
        self._c_spec_per_pos = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.", [*engine_labels, "position"], registry=reg)
        for family in (self._c_spec_drafts, self._c_spec_draft_tokens, self._c_spec_accepted):
            family.labels(model_name, "0")

        # --- expert parallelism: each rank's experts' (token, expert) pairs ---
        self._c_expert_load = Counter(
            p + "expert_load_tokens",
            "Token-expert pairs run by each tensor-parallel rank's experts (expert "
            "parallelism; summed over the MoE layers).",
            ["model_name", "engine", "rank"], registry=reg)

        # --- the host KV tier (--kv-offloading-size; zero when off) ---
        self._g_offload_usage = Gauge(
            p + "kv_offload_usage_perc", "Host KV tier usage. 1 means 100 percent usage.",
            labels, registry=reg).labels(model_name)
        self._c_offload_hits = Counter(
            p + "kv_offload_hit_blocks", "Prompt blocks found in the host KV tier past the "
            "device prefix hit (loaded, not recomputed).", labels, registry=reg).labels(model_name)
        self._c_offload_misses = Counter(
            p + "kv_offload_miss_blocks", "Prompt blocks past the device prefix hit that the "
            "host KV tier did not hold.", labels, registry=reg).labels(model_name)
        self._c_offload_saved = Counter(
            p + "kv_offload_saved_bytes", "KV bytes copied from the device to the host tier.",
            labels, registry=reg).labels(model_name)
        self._c_offload_loaded = Counter(
            p + "kv_offload_loaded_bytes", "KV bytes copied from the host tier to the device.",
            labels, registry=reg).labels(model_name)
        self._c_swap_preemptions = Counter(
            p + "kv_swap_preemptions", "Preemptions whose full blocks were kept for the host "
            "KV tier (a swap: priced cheaper than recomputing them).",
            labels, registry=reg).labels(model_name)
        self._c_recompute_preemptions = Counter(
            p + "kv_recompute_preemptions", "Preemptions with the host KV tier left to "
            "recompute (priced cheaper than a swap, or no room in the tier).",
            labels, registry=reg).labels(model_name)

        self._c_disk_reads = Counter(
            p + "kv_disk_read_blocks", "Blocks read back from the disk KV tier.",
            labels, registry=reg).labels(model_name)
        self._c_disk_bad = Counter(
            p + "kv_disk_bad_blocks", "Disk KV tier files found bad (computed instead).",
            labels, registry=reg).labels(model_name)

        # --- disaggregated prefill (P2pConnector; zero when off) ---
        self._c_transfer = {
            name: Counter(p + f"kv_transfer_{name}", text, labels, registry=reg).labels(model_name)
            for name, text in (
                ("held_requests", "Prompts a prefill server kept for decode servers to fetch."),
                ("sent_requests", "Prompts whose KV a decode server fetched from this server."),
                ("received_requests", "Prompts whose KV this server fetched from a prefill "
                 "server."),
                ("received_tokens", "Prompt tokens whose KV was fetched, not computed."),
                ("failed_requests", "KV fetches that failed or were refused (the prompt was "
                 "computed instead)."))}

        # --- token throughput ---
        self._c_prompt_tokens = Counter(
            p + "prompt_tokens", "Number of prefill tokens processed.",
            labels, registry=reg).labels(model_name)
        self._c_generation_tokens = Counter(
            p + "generation_tokens", "Number of generation tokens processed.",
            labels, registry=reg).labels(model_name)

        # --- finished requests ---
        self._c_success = Counter(
            p + "request_success", "Count of successfully processed requests.",
            ["model_name", "finished_reason"], registry=reg)
        for reason in FINISH_REASONS:
            self._c_success.labels(model_name, reason)

        # --- pooling requests (embeddings, scores, classification), by task ---
        self._c_pooling = Counter(
            p + "pooling_requests", "Count of finished pooling requests (embed, classify, "
            "score, ...), by task.", ["model_name", "task"], registry=reg)

        # --- structured outputs: constraints not enforced by the first-choice backend ---
        self._c_so_fallbacks = Counter(
            p + "structured_outputs_fallbacks",
            "Structured-output requests whose constraint fell back from the first-choice "
            "backend, by reason.",
            ["model_name", "reason"], registry=reg)
        for reason in STRUCTURED_OUTPUT_FALLBACK_REASONS:
            self._c_so_fallbacks.labels(model_name, reason)

        # --- LoRA adapters (only when LoRA is on) ---
        self.max_lora = max_lora
        self._g_lora_info: Gauge | None = None
        self._c_lora: Counter | None = None
        self._lora_info_labels: tuple[str, str, str] | None = None
        self._lora_names: set[str] = set()
        if max_lora > 0:
            # vLLM's info gauge: the adapters live in the labels, the value is the time of
            # the update (dashboards take the latest series).
            self._g_lora_info = Gauge(
                p + "lora_requests_info", "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=reg)
            self._c_lora = Counter(
                p + "lora_requests", "Count of requests run with a LoRA adapter, by adapter "
                f"(at most {MAX_LORA_NAME_LABELS} names; later ones count as "
                f"\"{LORA_OTHER}\").", ["model_name", "lora_name"], registry=reg)
            self._set_lora_info([], [])

        # --- latencies ---
        def hist(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(p + name, doc, labels, buckets=buckets,
                             registry=reg).labels(model_name)

        self._h_ttft = hist("time_to_first_token_seconds",
                            "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self._h_itl = hist("inter_token_latency_seconds",
                           "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self._h_tpot = hist("request_time_per_output_token_seconds",
                            "Histogram of time_per_output_token_seconds per request.",
                            ITL_BUCKETS)
        self._h_e2e = hist("e2e_request_latency_seconds",
                           "Histogram of e2e request latency in seconds.",
                           REQUEST_LATENCY_BUCKETS)
        self._h_queue = hist("request_queue_time_seconds",
                             "Histogram of time spent in WAITING phase for request.",
                             REQUEST_LATENCY_BUCKETS)
        self._h_prefill = hist("request_prefill_time_seconds",
                               "Histogram of time spent in PREFILL phase for request.",
                               REQUEST_LATENCY_BUCKETS)
        self._h_decode = hist("request_decode_time_seconds",
                              "Histogram of time spent in DECODE phase for request.",
                              REQUEST_LATENCY_BUCKETS)
        self._h_inference = hist("request_inference_time_seconds",
                                 "Histogram of time spent in RUNNING phase for request.",
                                 REQUEST_LATENCY_BUCKETS)

        # --- request sizes ---
        length_buckets = build_1_2_5_buckets(max_model_len)
        self._h_prompt_len = hist("request_prompt_tokens",
                                  "Number of prefill tokens processed.", length_buckets)
        self._h_gen_len = hist("request_generation_tokens",
                               "Number of generation tokens processed.", length_buckets)

    # ------------------------------------------------------------------ scheduler stats

    def observe_scheduler_stats(self, stats: SchedulerStats, engine: int = 0) -> None:
        """Record one scheduler step's stats (of data-parallel replica `engine`): gauges are
        set, cumulative values become deltas."""
        label = (self.model_name, str(engine))
        self._g_running.labels(*label).set(stats.num_running)
        self._g_waiting.labels(*label).set(stats.num_waiting)
        self._g_kv_usage.labels(*label).set(stats.kv_cache_usage)
        self._engine_tracked[engine] = stats.num_tracked_requests
        self._g_tracked_engine.set(sum(self._engine_tracked.values()))

        self._inc_cumulative(f"{engine}:num_preemptions", stats.num_preemptions,
                             self._c_preemptions.labels(*label))
        self._inc_cumulative(f"{engine}:prefix_cache_queries", stats.prefix_cache_queries,
                             self._c_prefix_queries.labels(*label))
        self._inc_cumulative(f"{engine}:prefix_cache_hits", stats.prefix_cache_hits,
                             self._c_prefix_hits.labels(*label))
        for key, value, family in (
                ("spec_num_drafts", stats.spec_num_drafts, self._c_spec_drafts),
                ("spec_num_draft_tokens", stats.spec_num_draft_tokens, self._c_spec_draft_tokens),
                ("spec_num_accepted_tokens", stats.spec_num_accepted_tokens,
                 self._c_spec_accepted)):
            self._inc_cumulative(f"{engine}:{key}", value, family.labels(*label))
        for pos, count in enumerate(stats.spec_accepted_per_pos):
            self._inc_cumulative(f"{engine}:spec_accepted_pos_{pos}", count,
                                 self._c_spec_per_pos.labels(*label, str(pos)))
        self._g_offload_usage.set(stats.kv_offload_usage)
        for key, value, counter in (
                ("offload_hits", stats.kv_offload_hit_blocks, self._c_offload_hits),
                ("offload_misses", stats.kv_offload_miss_blocks, self._c_offload_misses),
                ("offload_saved", stats.kv_offload_saved_bytes, self._c_offload_saved),
                ("offload_loaded", stats.kv_offload_loaded_bytes, self._c_offload_loaded),
                ("swap_preemptions", stats.kv_swap_preemptions, self._c_swap_preemptions),
                ("recompute_preemptions", stats.kv_recompute_preemptions,
                 self._c_recompute_preemptions),
                ("disk_reads", stats.kv_disk_read_blocks, self._c_disk_reads),
                ("disk_bad", stats.kv_disk_bad_blocks, self._c_disk_bad)):
            self._inc_cumulative(f"{engine}:{key}", value, counter)
        for name, counter in self._c_transfer.items():
            self._inc_cumulative(f"{engine}:transfer_{name}", getattr(stats, f"kv_transfer_{name}"),
                                 counter)
        for rank, count in enumerate(stats.expert_load_per_rank):
            self._inc_cumulative(f"{engine}:expert_load_{rank}", count,
                                 self._c_expert_load.labels(*label, str(rank)))

        if self._g_lora_info is not None:
            self._set_lora_info(stats.running_lora_adapters, stats.waiting_lora_adapters)

        if stats.num_blocks and stats.num_blocks != self._cache_info_blocks:
            # Replace, not add: a stale label set would read as a second cache config.
            info = tuple(self._cache_info.values())
            if self._cache_info_blocks is not None:
                self._g_cache_info.remove(self.model_name, str(self._cache_info_blocks), *info)
            self._g_cache_info.labels(self.model_name, str(stats.num_blocks), *info).set(1)
            self._cache_info_blocks = stats.num_blocks

    def _set_lora_info(self, running: list[str], waiting: list[str]) -> None:
        assert self._g_lora_info is not None
        labels = (str(self.max_lora), ",".join(waiting), ",".join(running))
        if labels != self._lora_info_labels:
            # One series at a time (vLLM keeps every past one): each new mix of adapters
            # would otherwise stay exported for the life of the process.
            if self._lora_info_labels is not None:
                self._g_lora_info.remove(*self._lora_info_labels)
            self._lora_info_labels = labels
        self._g_lora_info.labels(*labels).set_to_current_time()

    def _inc_cumulative(self, key: str, value: int, counter: Counter) -> None:
        last = self._last_cumulative.get(key, 0)
        # A value below the last one means the source was reset (e.g. the prefix cache was
        # cleared); like Prometheus' own reset handling, everything since the reset is new.
        delta = value - last if value >= last else value
        if delta > 0:
            counter.inc(delta)
        self._last_cumulative[key] = value

    # ------------------------------------------------------------------ per request

    def request_added(self, request_id: str, arrival_time: float, num_prompt_tokens: int) -> None:
        self._requests[request_id] = _RequestState(arrival_time, num_prompt_tokens)

    def tokens_generated(self, request_id: str, num_new_tokens: int, now: float,
                         first_scheduled_time: float | None) -> None:
        """Record ``num_new_tokens`` produced for a request at ``now``.

        The first batch gives TTFT (and queue time when the schedule time is known); each later
        batch gives one inter-token latency sample. Calls with no tokens change nothing.
        """
        if num_new_tokens <= 0:
            return
        self._c_generation_tokens.inc(num_new_tokens)
        state = self._requests.get(request_id)
        if state is None:  # unknown (never added or already forgotten): count tokens only
            return

        if first_scheduled_time is not None and state.first_scheduled_time is None:
            state.first_scheduled_time = first_scheduled_time
        if state.first_scheduled_time is not None and not state.queue_time_observed:
            self._h_queue.observe(max(0.0, state.first_scheduled_time - state.arrival_time))
            state.queue_time_observed = True

        if state.first_token_time is None:
            state.first_token_time = now
            self._h_ttft.observe(max(0.0, now - state.arrival_time))
            # The prompt has been prefilled once the first token exists.
            self._c_prompt_tokens.inc(state.num_prompt_tokens)
        else:
            assert state.last_token_time is not None
            self._h_itl.observe(max(0.0, now - state.last_token_time))
        state.last_token_time = now
        state.num_generation_tokens += num_new_tokens

    def request_finished(self, request_id: str, finish_reason: str, now: float,
                         num_prompt_tokens: int, num_generation_tokens: int,
                         pooling_task: str | None = None) -> None:
        """Record a finished request (reason "stop", "length", "abort", ...) and forget it.
        A pooling request (`pooling_task`) also counts under pooling_requests_total."""
        state = self._requests.pop(request_id, None)
        self._c_success.labels(self.model_name, finish_reason).inc()
        if pooling_task is not None:
            self._c_pooling.labels(self.model_name, pooling_task).inc()
        self._h_prompt_len.observe(num_prompt_tokens)
        self._h_gen_len.observe(num_generation_tokens)
        if state is None:  # nothing timed for it; the sizes and the count are all we know
            return
        if state.first_token_time is None:
            # Finished before any token was reported: its prompt was never counted.
            self._c_prompt_tokens.inc(num_prompt_tokens)

        self._h_e2e.observe(max(0.0, now - state.arrival_time))
        first, last = state.first_token_time, state.last_token_time
        if first is not None and last is not None:
            self._h_decode.observe(max(0.0, last - first))
            if num_generation_tokens > 1:
                self._h_tpot.observe(max(0.0, (last - first) / (num_generation_tokens - 1)))
            if state.first_scheduled_time is not None:
                self._h_prefill.observe(max(0.0, first - state.first_scheduled_time))
                self._h_inference.observe(max(0.0, last - state.first_scheduled_time))

    def request_aborted(self, request_id: str, now: float) -> None:
        """Forget an aborted request and count it under ``finished_reason="abort"``.

        Only tracked requests count, so aborting one that already finished (a client that
        disconnects after the last token) is a no-op rather than a second count.
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        self._c_success.labels(self.model_name, ABORT_REASON).inc()

    def lora_request(self, lora_name: str) -> None:
        """Count one request run with adapter `lora_name` (no-op with LoRA off)."""
        if self._c_lora is None:
            return
        if lora_name not in self._lora_names:
            if len(self._lora_names) >= MAX_LORA_NAME_LABELS:
                lora_name = LORA_OTHER
            else:
                self._lora_names.add(lora_name)
        self._c_lora.labels(self.model_name, lora_name).inc()

    def track_api_requests(self, count) -> None:
        """Add a callable giving a count of per-request state held in the API process to
        folio:tracked_requests{process="api"}."""
        self._api_trackers.append(count)

    def track_dp_routing(self, routed: Any, prefix_routed: Any) -> None:
        """Data parallelism: `routed()` and `prefix_routed()` give, per replica, the requests
        routed to it and those routed there for a prefix it holds (read at each scrape)."""
        reg, p = self.registry, PREFIX
        if self._dp_routed is not None:
            return
        self._dp_routed = Gauge(p + "dp_requests_routed", "Requests routed to each "
                                "data-parallel replica.", ["model_name", "engine"], registry=reg)
        self._dp_prefix_routed = Gauge(p + "dp_prefix_routed", "Requests routed to a "
                                       "data-parallel replica because it held their prefix.",
                                       ["model_name", "engine"], registry=reg)
        for engine in range(len(routed())):
            for family in (self._g_running, self._g_waiting, self._g_kv_usage,
                           self._c_preemptions, self._c_prefix_queries, self._c_prefix_hits):
                family.labels(self.model_name, str(engine))   # every replica, from the start
            self._dp_routed.labels(self.model_name, str(engine)).set_function(
                lambda e=engine: routed()[e])
            self._dp_prefix_routed.labels(self.model_name, str(engine)).set_function(
                lambda e=engine: prefix_routed()[e])

    def structured_outputs_fallback(self, reason: str) -> None:
        """Count one request whose constraint fell back (reason: one of
        STRUCTURED_OUTPUT_FALLBACK_REASONS; anything else is refused, to keep the label set
        fixed)."""
        if reason not in STRUCTURED_OUTPUT_FALLBACK_REASONS:
            raise ValueError(f"unknown structured outputs fallback reason {reason!r}")
        self._c_so_fallbacks.labels(self.model_name, reason).inc()

    @property
    def num_tracked_requests(self) -> int:
        """In-flight requests with per-request state (bounded: dropped on finish/abort)."""
        return len(self._requests)

    # ------------------------------------------------------------------ exposition

    def render(self) -> bytes:
        """Prometheus text exposition of this engine's registry (serve with ``CONTENT_TYPE``)."""
        return generate_latest(self.registry)
