"""Host cost of the engine core's Python per decode step, without a model: the scheduler,
the KV cache manager (the step message included) and update_from_output over N running requests (a fake runner samples
token 7 for every request). For measuring host overhead on any machine:
python tools/bench_core_host.py [NUM_REQUESTS] [STEPS]"""
from __future__ import annotations

import sys
import time

from folio.core.kv_cache_manager import KVCacheManager
from folio.core.request import Request
from folio.core.scheduler import Scheduler
from folio.core.step_messages import ModelRunnerOutput
from folio.sampling_params import SamplingParams

n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 300
kv = KVCacheManager(num_blocks=n * 80, block_size=16, enable_caching=True)
sched = Scheduler(kv_cache_manager=kv, max_num_seqs=n, max_num_batched_tokens=1 << 20,
                  max_model_len=4096)
params = SamplingParams(temperature=1.0, max_tokens=steps + 10, ignore_eos=True)
for i in range(n):
    sched.add_request(Request(f"r{i}", [i % 1000 + j for j in range(500)], params, (2,),
                              block_size=16, max_model_len=4096))
t_sched = t_update = 0.0
for step in range(steps + 1):
    t0 = time.perf_counter()
    out = sched.schedule()
    t1 = time.perf_counter()
    sampling = out.message.sampling_req_ids
    runner = ModelRunnerOutput(req_ids=sampling, sampled_token_ids=[[7]] * len(sampling))
    sched.update_from_output(out, runner)
    t2 = time.perf_counter()
    if step:  # step 0 is the prefill
        t_sched += t1 - t0
        t_update += t2 - t1
print(f"{n} requests: schedule {1e3 * t_sched / steps:.3f} ms/step, "
      f"update {1e3 * t_update / steps:.3f} ms/step "
      f"({1e6 * (t_sched + t_update) / steps / n:.1f} µs per request per step)")
