"""Host time of incremental detokenization per streamed token: 256 requests of 128 tokens
each, one token per request per step, as the output processor feeds them (best of 5).

    python tools/bench_detokenizer.py [TOKENIZER_DIR]   (default: the default model's)
"""
import sys
import time, random
from transformers import AutoTokenizer
from folio.engine.detokenizer import IncrementalDetokenizer
if len(sys.argv) > 1:
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
else:
    from folio.model import default_model
    tok = AutoTokenizer.from_pretrained(
        default_model.ensure_hf_dir_from_gguf(default_model.default_gguf_path()))
text = open(__import__("folio.engine.detokenizer", fromlist=["x"]).__file__).read()
ids = tok(text, add_special_tokens=False)["input_ids"]
best = 1e9
for rep in range(5):
    dets = [IncrementalDetokenizer(tok, ids[i*7:i*7+20]) for i in range(256)]
    t = time.perf_counter()
    for step in range(128):
        for i, d in enumerate(dets):
            d.update([ids[(i * 13 + step) % len(ids)]])
    best = min(best, time.perf_counter() - t)
print(f"{best / (256*128) * 1e6:.2f} us per token")
