"""Why does speculation cost at batch 64 on the GPU (issue 17)? Runs `folio bench latency`
(the arguments after --) with every step's (tokens, seconds, verify) as the adaptive draft
length saw it, each draft-length decision, and the host time of the proposals recorded;
prints where the time went: plain vs verify steps by size, k decisions, proposal time.

    python tools/gpu_spec_probe.py -- --model M --dataset editing --batch-size 64 ...
"""
from __future__ import annotations

import collections
import statistics
import sys
import time

from folio.bench import latency
from folio.core.scheduler import Scheduler
from folio.core.spec import drafter as drafters
from folio.core.spec.policy import AdaptiveDraftLength

steps: list[tuple[int, float, bool]] = []
choices: collections.Counter = collections.Counter()
propose_s = [0.0, 0]

_observe = Scheduler.observe_step_time


def observe(self, num_tokens, seconds, verify, *rest):
    steps.append((num_tokens, seconds, verify))
    return _observe(self, num_tokens, seconds, verify, *rest)


_choose = AdaptiveDraftLength.choose


def choose(self, drafting, other_tokens):
    k = _choose(self, drafting, other_tokens)
    choices[(len(drafting) + other_tokens, k, self._resting)] += 1
    return k


def timed(cls):
    original = cls.propose

    def propose(self, request):
        start = time.perf_counter()
        try:
            return original(self, request)
        finally:
            propose_s[0] += time.perf_counter() - start
            propose_s[1] += 1
    cls.propose = propose


Scheduler.observe_step_time = observe
AdaptiveDraftLength.choose = choose
timed(drafters.NgramDrafter)
timed(drafters.SuffixDrafter)

argv = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else sys.argv[1:]
latency.main(argv)

print(f"\nsteps timed: {len(steps)}")
by = collections.defaultdict(list)
for n, s, v in steps:
    by[(v, 1 << (max(n, 1).bit_length() - 1))].append(s * 1e3)
for (v, b), times in sorted(by.items()):
    print(f"  {'verify' if v else 'plain '} tokens>={b:5d}: {len(times):5d} steps, median "
          f"{statistics.median(times):7.2f} ms, mean {statistics.fmean(times):7.2f} ms, max "
          f"{max(times):7.2f} ms")
print("the last 140 steps (v = verify, p = plain; tokens:ms):")
print("  " + " ".join(f"{'v' if v else 'p'}{n}:{sec * 1e3:.1f}" for n, sec, v in steps[-140:]))
print("draft length decisions (batch, k, resting): count")
for key, count in sorted(choices.items()):
    print(f"  {key}: {count}")
print(f"proposals: {propose_s[1]} calls, {propose_s[0] * 1e3:.1f} ms host time "
      f"({propose_s[0] * 1e6 / max(propose_s[1], 1):.1f} us each)")
