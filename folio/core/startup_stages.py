"""The worker's start-up stages: the keys of `Worker.timings` (seconds each) and their names in
the engine core's start-up timeline and the benchmarks' start-to-ready split. Here, below
both, so neither imports the other (nor torch) for a table of names."""
from __future__ import annotations

STARTUP_STAGES = {"load_s": "model load", "profile_s": "KV profiling",
                  "kv_alloc_s": "KV allocation", "warm_up_s": "kernel warm-up",
                  "graph_capture_s": "CUDA graph capture"}
