"""The offline metrics reader (LLM.get_metrics): an engine registry's series as objects."""
from folio.core.engine_core_outputs import SchedulerStats
from folio.metrics import EngineMetrics
from folio.metrics.reader import Counter, Gauge, Histogram, Vector, read_metrics


def test_registry_series_become_counters_gauges_vectors_and_histograms() -> None:
    m = EngineMetrics("m", max_model_len=64)
    m.observe_scheduler_stats(SchedulerStats(num_running=2, num_preemptions=5,
                                             spec_num_drafts=7, spec_accepted_per_pos=[6, 3]))
    got = {(x.name, tuple(sorted(x.labels.items()))): x for x in read_metrics(m.registry)}
    engine0 = (("engine", "0"), ("model_name", "m"))
    running = got[("folio:num_requests_running", engine0)]
    assert isinstance(running, Gauge) and running.value == 2
    preemptions = got[("folio:num_preemptions", engine0)]
    assert isinstance(preemptions, Counter) and preemptions.value == 5
    assert got[("folio:spec_decode_num_drafts", engine0)].value == 7
    per_pos = got[("folio:spec_decode_num_accepted_tokens_per_pos", engine0)]
    assert isinstance(per_pos, Vector) and per_pos.values == [6, 3]
    ttft = got[("folio:time_to_first_token_seconds", (("model_name", "m"),))]
    assert isinstance(ttft, Histogram) and ttft.count == 0 and "+Inf" in ttft.buckets
