"""The periodic stats line: rates over the interval, idle intervals silent."""
from folio.core.engine_core_outputs import SchedulerStats
from folio.metrics.stats_logger import StatsLogger


def test_line_reports_rates_queue_and_cache_use():
    logger = StatsLogger(now=0.0)
    logger.record(prompt_tokens=500, generation_tokens=100)
    logger.record(prompt_tokens=500, generation_tokens=100)
    stats = SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.25,
                           prefix_cache_queries=400, prefix_cache_hits=100)
    line = logger.line(10.0, stats)
    assert line == ("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 20.0 "
                    "tokens/s, Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, "
                    "Prefix cache hit rate: 25.0%")
    # The next interval starts from zero and the hit rate is over that interval only.
    logger.record(prompt_tokens=0, generation_tokens=50)
    stats = SchedulerStats(num_running=1, prefix_cache_queries=500, prefix_cache_hits=200)
    assert logger.line(20.0, stats).startswith(
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 5.0 tokens/s")
    assert "Prefix cache hit rate: 100.0%" in logger.line(30.0, SchedulerStats(
        num_running=1, prefix_cache_queries=600, prefix_cache_hits=300))


def test_idle_interval_logs_nothing():
    logger = StatsLogger(now=0.0)
    assert logger.line(10.0, SchedulerStats()) is None
    logger.record(0, 1)
    assert logger.line(20.0, SchedulerStats()) is not None
    assert logger.line(30.0, SchedulerStats()) is None


def test_line_reports_speculative_decoding_over_the_interval():
    logger = StatsLogger(now=0.0)
    logger.record(0, 10)
    stats = SchedulerStats(num_running=1, spec_num_drafts=4, spec_num_draft_tokens=16,
                           spec_num_accepted_tokens=8, spec_accepted_per_pos=[4, 2, 1, 1])
    assert logger.line(10.0, stats).endswith(
        "SpecDecoding metrics: Mean acceptance length: 3.00, Accepted throughput: 0.80 "
        "tokens/s, Drafted throughput: 1.60 tokens/s, Accepted: 8 tokens, Drafted: 16 tokens, "
        "Per-position acceptance rate: 1.000, 0.500, 0.250, 0.250, Draft acceptance rate: "
        "50.0%")
    logger.record(0, 10)
    stats = SchedulerStats(num_running=1, spec_num_drafts=6, spec_num_draft_tokens=24,
                           spec_num_accepted_tokens=8, spec_accepted_per_pos=[4, 2, 1, 1])
    line = logger.line(20.0, stats)
    assert "Mean acceptance length: 1.00" in line
    assert "Per-position acceptance rate: 0.000, 0.000, 0.000, 0.000" in line   # the interval's
    logger.record(0, 10)
    assert "SpecDecoding" not in logger.line(30.0, stats)   # no drafts in this interval
