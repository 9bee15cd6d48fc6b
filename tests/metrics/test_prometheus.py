"""EngineMetrics driven with synthetic calls and fake times; checked through render()."""
from __future__ import annotations

import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from folio.core.engine_core_outputs import SchedulerStats
from folio.metrics import EngineMetrics, build_1_2_5_buckets

MODEL = "tiny-model"


def scrape(m: EngineMetrics) -> dict[tuple[str, frozenset], float]:
    """All samples of one render(), keyed by (sample name, label items)."""
    out: dict[tuple[str, frozenset], float] = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


# Scheduler metrics carry the data-parallel replica too (engine="0" with one engine).
_ENGINE_LABELLED = ("folio:num_requests_running", "folio:num_requests_waiting",
                    "folio:kv_cache_usage_perc", "folio:num_preemptions_total",
                    "folio:prefix_cache_queries_total", "folio:prefix_cache_hits_total",
                    "folio:expert_load_tokens_total", "folio:spec_decode_num_drafts_total",
                    "folio:spec_decode_num_draft_tokens_total",
                    "folio:spec_decode_num_accepted_tokens_total",
                    "folio:spec_decode_num_accepted_tokens_per_pos_total")


def val(m: EngineMetrics, name: str, **labels: str) -> float:
    labels = {"model_name": MODEL, **labels}
    if name in _ENGINE_LABELLED:
        labels.setdefault("engine", "0")
    return scrape(m)[(name, frozenset(labels.items()))]


def hist(m: EngineMetrics, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram."""
    return val(m, f"folio:{name}_count"), val(m, f"folio:{name}_sum")


@pytest.fixture
def m() -> EngineMetrics:
    return EngineMetrics(MODEL, max_model_len=2048)


def test_gauges_reflect_last_stats(m: EngineMetrics) -> None:
    m.observe_scheduler_stats(SchedulerStats(num_running=3, num_waiting=5, kv_cache_usage=0.5,
                                             num_blocks=100, num_free_blocks=50))
    m.observe_scheduler_stats(SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.25,
                                             num_blocks=100, num_free_blocks=75))
    assert val(m, "folio:num_requests_running") == 2
    assert val(m, "folio:num_requests_waiting") == 1
    assert val(m, "folio:kv_cache_usage_perc") == 0.25
    assert val(m, "folio:cache_config_info", num_gpu_blocks="100") == 1


def test_cache_config_info_carries_the_cache_settings() -> None:
    """As vLLM's: the KV cache's settings are labels of cache_config_info (an FP8 cache shows
    as cache_dtype="fp8"), beside the block count, which replaces its old label set."""
    from folio.config import CacheConfig
    m = EngineMetrics(MODEL, max_model_len=2048, cache_info=CacheConfig(
        cache_dtype="fp8", calculate_kv_scales=True, block_size=32).metrics_info())
    for blocks in (100, 200):
        m.observe_scheduler_stats(SchedulerStats(num_blocks=blocks, num_free_blocks=blocks))
    info = dict(model_name=MODEL, block_size="32", cache_dtype="fp8",
                calculate_kv_scales="True", enable_prefix_caching="True",
                gpu_memory_utilization="0.9")
    assert val(m, "folio:cache_config_info", num_gpu_blocks="200", **info) == 1
    assert m.registry.get_sample_value("folio:cache_config_info",
                                       {**info, "num_gpu_blocks": "100"}) is None


def test_cumulative_stats_become_counter_deltas(m: EngineMetrics) -> None:
    m.observe_scheduler_stats(SchedulerStats(num_preemptions=2, prefix_cache_queries=100,
                                             prefix_cache_hits=40))
    m.observe_scheduler_stats(SchedulerStats(num_preemptions=5, prefix_cache_queries=150,
                                             prefix_cache_hits=40))
    assert val(m, "folio:num_preemptions_total") == 5
    assert val(m, "folio:prefix_cache_queries_total") == 150
    assert val(m, "folio:prefix_cache_hits_total") == 40

    # Source reset to lower values: never decreases; counts since the reset are added.
    m.observe_scheduler_stats(SchedulerStats(num_preemptions=1, prefix_cache_queries=10,
                                             prefix_cache_hits=0))
    assert val(m, "folio:num_preemptions_total") == 6
    assert val(m, "folio:prefix_cache_queries_total") == 160
    assert val(m, "folio:prefix_cache_hits_total") == 40
    # And deltas resume from the post-reset baseline.
    m.observe_scheduler_stats(SchedulerStats(num_preemptions=3, prefix_cache_queries=30,
                                             prefix_cache_hits=4))
    assert val(m, "folio:num_preemptions_total") == 8
    assert val(m, "folio:prefix_cache_queries_total") == 180
    assert val(m, "folio:prefix_cache_hits_total") == 44


def test_request_lifecycle_latencies(m: EngineMetrics) -> None:
    m.request_added("r1", arrival_time=100.0, num_prompt_tokens=7)
    m.tokens_generated("r1", 1, now=100.5, first_scheduled_time=100.2)  # TTFT .5, queue .2
    m.tokens_generated("r1", 1, now=100.6, first_scheduled_time=100.2)  # ITL .1
    m.tokens_generated("r1", 2, now=100.9, first_scheduled_time=100.2)  # ITL .3 (one per batch)
    m.request_finished("r1", "stop", now=101.0, num_prompt_tokens=7, num_generation_tokens=4)

    assert hist(m, "time_to_first_token_seconds") == (1, pytest.approx(0.5))
    assert hist(m, "request_queue_time_seconds") == (1, pytest.approx(0.2))
    assert hist(m, "inter_token_latency_seconds") == (2, pytest.approx(0.4))
    # TPOT = (last token − first token) / (gen − 1) = 0.4 / 3
    assert hist(m, "request_time_per_output_token_seconds") == (1, pytest.approx(0.4 / 3))
    assert hist(m, "e2e_request_latency_seconds") == (1, pytest.approx(1.0))
    assert hist(m, "request_prefill_time_seconds") == (1, pytest.approx(0.3))
    assert hist(m, "request_decode_time_seconds") == (1, pytest.approx(0.4))
    assert hist(m, "request_inference_time_seconds") == (1, pytest.approx(0.7))
    assert hist(m, "request_prompt_tokens") == (1, 7)
    assert hist(m, "request_generation_tokens") == (1, 4)
    assert val(m, "folio:prompt_tokens_total") == 7
    assert val(m, "folio:generation_tokens_total") == 4
    assert val(m, "folio:request_success_total", finished_reason="stop") == 1
    assert val(m, "folio:request_success_total", finished_reason="length") == 0
    assert m.num_tracked_requests == 0


def test_single_token_request_has_no_tpot_and_unknown_schedule_no_queue(m: EngineMetrics) -> None:
    m.request_added("r", arrival_time=10.0, num_prompt_tokens=3)
    m.tokens_generated("r", 0, now=10.1, first_scheduled_time=None)  # no tokens: ignored
    m.tokens_generated("r", 1, now=10.25, first_scheduled_time=None)
    m.request_finished("r", "length", now=10.3, num_prompt_tokens=3, num_generation_tokens=1)
    assert hist(m, "time_to_first_token_seconds") == (1, pytest.approx(0.25))
    assert hist(m, "request_time_per_output_token_seconds")[0] == 0
    assert hist(m, "inter_token_latency_seconds")[0] == 0
    assert hist(m, "request_queue_time_seconds")[0] == 0
    assert val(m, "folio:request_success_total", finished_reason="length") == 1


def test_abort_counts_and_forgets(m: EngineMetrics) -> None:
    m.request_added("a", arrival_time=0.0, num_prompt_tokens=5)
    m.tokens_generated("a", 1, now=1.0, first_scheduled_time=0.5)
    m.request_added("b", arrival_time=0.0, num_prompt_tokens=5)
    assert m.num_tracked_requests == 2
    m.request_aborted("a", now=2.0)
    m.request_aborted("b", now=2.0)
    assert m.num_tracked_requests == 0
    assert val(m, "folio:request_success_total", finished_reason="abort") == 2
    # Aborting again (already forgotten) is a no-op, and later tokens don't resurrect state.
    m.request_aborted("a", now=3.0)
    m.tokens_generated("a", 1, now=3.0, first_scheduled_time=0.5)
    assert m.num_tracked_requests == 0
    assert val(m, "folio:request_success_total", finished_reason="abort") == 2
    assert hist(m, "e2e_request_latency_seconds")[0] == 0


def test_many_requests_state_is_bounded(m: EngineMetrics) -> None:
    for i in range(200):
        rid = f"r{i}"
        m.request_added(rid, arrival_time=float(i), num_prompt_tokens=2)
        m.tokens_generated(rid, 1, now=i + 0.1, first_scheduled_time=float(i))
        m.request_finished(rid, "stop", now=i + 0.2, num_prompt_tokens=2, num_generation_tokens=1)
    assert m.num_tracked_requests == 0
    assert val(m, "folio:request_success_total", finished_reason="stop") == 200
    assert val(m, "folio:prompt_tokens_total") == 400


def test_labels_and_exposition(m: EngineMetrics) -> None:
    m.request_added("r", arrival_time=0.0, num_prompt_tokens=1)
    m.tokens_generated("r", 1, now=0.1, first_scheduled_time=0.0)
    m.request_finished("r", "stop", now=0.2, num_prompt_tokens=1, num_generation_tokens=1)
    samples = scrape(m)
    assert samples
    for (name, labels) in samples:
        assert name.startswith("folio:")
        assert dict(labels).get("model_name") == MODEL
        if name.startswith("folio:request_success"):
            assert "finished_reason" in dict(labels)
    assert m.CONTENT_TYPE == CONTENT_TYPE_LATEST


def test_length_buckets_scale_with_max_model_len() -> None:
    assert build_1_2_5_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    small = EngineMetrics(MODEL, max_model_len=50)
    les = {dict(lbl)["le"] for (name, lbl) in scrape(small)
           if name == "folio:request_prompt_tokens_bucket"}
    assert les == {"1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "+Inf"}


def test_instances_do_not_share_a_registry() -> None:
    a = EngineMetrics(MODEL, max_model_len=128)
    b = EngineMetrics(MODEL, max_model_len=128)  # same names: would raise on a shared registry
    assert a.registry is not b.registry
    a.observe_scheduler_stats(SchedulerStats(num_running=4, num_preemptions=3))
    assert val(a, "folio:num_requests_running") == 4
    assert val(b, "folio:num_requests_running") == 0
    assert val(b, "folio:num_preemptions_total") == 0


def test_spec_decode_counters_use_vllm_names(m: EngineMetrics) -> None:
    m.observe_scheduler_stats(SchedulerStats(spec_num_drafts=3, spec_num_draft_tokens=12,
                                             spec_num_accepted_tokens=7,
                                             spec_accepted_per_pos=[3, 2, 1, 1]))
    m.observe_scheduler_stats(SchedulerStats(spec_num_drafts=4, spec_num_draft_tokens=16,
                                             spec_num_accepted_tokens=9,
                                             spec_accepted_per_pos=[4, 3, 1, 1]))
    assert val(m, "folio:spec_decode_num_drafts_total") == 4
    assert val(m, "folio:spec_decode_num_draft_tokens_total") == 16
    assert val(m, "folio:spec_decode_num_accepted_tokens_total") == 9
    assert val(m, "folio:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 3
    assert val(m, "folio:spec_decode_num_accepted_tokens_per_pos_total", position="3") == 1


def test_spec_decode_counters_per_data_parallel_engine(m: EngineMetrics) -> None:
    """Replicas' cumulative counts arrive in turn: each is its own series (vLLM's engine
    label), and neither's running total disturbs the other's deltas."""
    for drafts in (10, 20, 30):
        m.observe_scheduler_stats(SchedulerStats(spec_num_drafts=drafts,
                                                 spec_accepted_per_pos=[drafts]), engine=0)
        m.observe_scheduler_stats(SchedulerStats(spec_num_drafts=drafts // 10,
                                                 spec_accepted_per_pos=[drafts // 10]),
                                  engine=1)
    assert val(m, "folio:spec_decode_num_drafts_total") == 30
    assert val(m, "folio:spec_decode_num_drafts_total", engine="1") == 3
    assert val(m, "folio:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 30
    assert val(m, "folio:spec_decode_num_accepted_tokens_per_pos_total", position="0",
               engine="1") == 3


def test_expert_load_per_rank(m: EngineMetrics) -> None:
    m.observe_scheduler_stats(SchedulerStats(expert_load_per_rank=[10, 6]))
    m.observe_scheduler_stats(SchedulerStats(expert_load_per_rank=[25, 9]))
    assert val(m, "folio:expert_load_tokens_total", rank="0") == 25
    assert val(m, "folio:expert_load_tokens_total", rank="1") == 9


def test_kv_tier_metrics(m: EngineMetrics) -> None:
    m.observe_scheduler_stats(SchedulerStats(kv_offload_usage=0.25, kv_offload_hit_blocks=8,
                                             kv_offload_miss_blocks=2,
                                             kv_offload_saved_bytes=4096,
                                             kv_offload_loaded_bytes=2048,
                                             kv_disk_read_blocks=3, kv_disk_bad_blocks=1,
                                             kv_swap_preemptions=5,
                                             kv_recompute_preemptions=2))
    assert val(m, "folio:kv_swap_preemptions_total") == 5
    assert val(m, "folio:kv_recompute_preemptions_total") == 2
    assert val(m, "folio:kv_offload_usage_perc") == 0.25
    assert val(m, "folio:kv_offload_hit_blocks_total") == 8
    assert val(m, "folio:kv_offload_miss_blocks_total") == 2
    assert val(m, "folio:kv_offload_saved_bytes_total") == 4096
    assert val(m, "folio:kv_offload_loaded_bytes_total") == 2048
    assert val(m, "folio:kv_disk_read_blocks_total") == 3
    assert val(m, "folio:kv_disk_bad_blocks_total") == 1


def test_scheduler_metrics_per_data_parallel_replica(m: EngineMetrics) -> None:
    m.observe_scheduler_stats(SchedulerStats(num_running=3, prefix_cache_hits=10), engine=0)
    m.observe_scheduler_stats(SchedulerStats(num_running=5, prefix_cache_hits=4), engine=1)
    m.observe_scheduler_stats(SchedulerStats(num_running=1, prefix_cache_hits=12), engine=0)
    assert val(m, "folio:num_requests_running", engine="0") == 1
    assert val(m, "folio:num_requests_running", engine="1") == 5
    # each replica's cumulative counts become deltas of their own
    assert val(m, "folio:prefix_cache_hits_total", engine="0") == 12
    assert val(m, "folio:prefix_cache_hits_total", engine="1") == 4
    routed, prefix = [4, 2], [1, 0]
    m.track_dp_routing(lambda: routed, lambda: prefix)
    routed[0] += 1
    assert val(m, "folio:dp_requests_routed", engine="0") == 5
    assert val(m, "folio:dp_prefix_routed", engine="1") == 0
