"""Host cost of the front end's output processing per decode step, without a model: N
final-only requests (detokenize off, as in `folio bench throughput`) each getting one token per
step. python tools/bench_output_host.py"""
import time
from transformers import AutoTokenizer
from folio.model.default_model import default_model_path
from folio.engine.output_processor import OutputProcessor
from folio.core.engine_core_outputs import EngineCoreOutput
from folio.sampling_params import SamplingParams, RequestOutputKind
tok = AutoTokenizer.from_pretrained(default_model_path())
op = OutputProcessor(tok)
n, steps = 256, 300
p = SamplingParams(max_tokens=steps, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
for i in range(n):
    op.add_request(f"p{i}", [f"c{i}"], None, [1, 2, 3], [p], 0.0)
t = time.perf_counter()
for s in range(steps - 1):
    op.process([EngineCoreOutput(f"c{i}", [7], [], None, None, None, 0, 1.0) for i in range(n)])
el = time.perf_counter() - t
print(f"output processing: {1e3 * el / (steps - 1):.3f} ms/step at {n} requests")
