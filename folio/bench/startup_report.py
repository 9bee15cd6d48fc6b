"""Start-to-ready reporting shared by the benches: the seconds from constructing `LLM(...)` to
its return, split into the worker's start-up stages."""
from __future__ import annotations

from folio.core.startup_stages import STARTUP_STAGES


def startup_breakdown(total_s: float, timings: dict[str, float] | None) -> dict[str, float]:
    """Start-to-ready (seconds from constructing `LLM(...)` to its return) split into the worker's
    stages (model load, KV profiling, KV allocation, CUDA graph capture: 0.0 when a stage did not
    run) and "other_s" (config, tokenizer, scheduler: the rest)."""
    stages = {key: float((timings or {}).get(key, 0.0)) for key in STARTUP_STAGES}
    return {"total_s": total_s, **stages, "other_s": max(0.0, total_s - sum(stages.values()))}


def format_startup(startup: dict[str, float]) -> str:
    parts = [f"{label} {startup[key]:.1f} s" for key, label in STARTUP_STAGES.items()
             if startup.get(key, 0.0) >= 0.05 or key == "load_s"]
    parts.append(f"other {startup.get('other_s', 0.0):.1f} s")
    return f"start-to-ready: {startup['total_s']:.1f} s ({', '.join(parts)})"
