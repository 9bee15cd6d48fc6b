"""The benches' speculative-decoding report: counts over the timed part only."""
from types import SimpleNamespace

from folio.bench.spec_report import format_spec_report, spec_counts, spec_report
from folio.core.engine_core_outputs import SchedulerStats


def _engine(speculative, stats):
    core = SimpleNamespace(config=SimpleNamespace(speculative=speculative),
                           scheduler=SimpleNamespace(stats=lambda: stats))
    return SimpleNamespace(engine_core=core)


def test_spec_report_counts_between_snapshots() -> None:
    assert spec_counts(_engine(None, SchedulerStats())) is None
    before = spec_counts(_engine("ngram", SchedulerStats(spec_num_drafts=2, spec_num_draft_tokens=8,
                                                        spec_num_accepted_tokens=3)))
    after = spec_counts(_engine("ngram", SchedulerStats(spec_num_drafts=6, spec_num_draft_tokens=24,
                                                       spec_num_accepted_tokens=11)))
    report = spec_report(before, after)
    assert report == {"num_drafts": 4, "num_draft_tokens": 16, "num_accepted_tokens": 8,
                      "mean_acceptance_length": 3.0, "draft_acceptance_rate": 0.5}
    assert format_spec_report(report) == ("speculative decoding: mean acceptance length 3.00 "
                                          "(8 of 16 draft tokens accepted over 4 verify steps)")
    assert spec_report(None, after) is None
    # nothing drafted in the timed part (the adaptive length rested at k = 0): each step
    # still gave its one token
    idle = spec_report(after, after)
    assert idle["mean_acceptance_length"] == 1.0 and idle["draft_acceptance_rate"] == 0.0
