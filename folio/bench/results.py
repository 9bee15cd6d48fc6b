"""Results of one engine's benchmark run, shared by `bench throughput` and its peers.

`EngineResult` is what one engine did on the workload; the RSS helpers measure the memory of
the process that ran it. Peers run in spawned children and send an `EngineResult` back as a
dict (`asdict`), so everything here must stay importable without heavy dependencies.
"""
from __future__ import annotations

import os
import resource
import sys
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class EngineResult:
    """What one engine did on the workload. Rates are over `elapsed_s` (generation only)."""

    engine: str
    num_requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0            # useful tokens: what the requests asked for
    generated_tokens: int = 0         # tokens actually computed (includes padding waste)
    elapsed_s: float = 0.0
    load_s: float = 0.0               # engine/model start-up, not in elapsed_s
    peak_rss_bytes: int = 0           # peak RSS (VmHWM) of the process that ran this engine
    baseline_rss_bytes: int = 0       # RSS of that process before the model was loaded
    memory_note: str = ""
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and self.elapsed_s > 0

    def rates(self) -> dict[str, float]:
        if not self.ok:
            return {}
        return {
            "requests_per_s": self.num_requests / self.elapsed_s,
            "output_tokens_per_s": self.output_tokens / self.elapsed_s,
            "total_tokens_per_s": (self.prompt_tokens + self.output_tokens) / self.elapsed_s,
        }

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), **self.rates()}



def peak_rss_bytes() -> int:
    """Peak RSS of this process's own address space.

    VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork (a child starts at its parent's
    current RSS) and across exec, so a peer spawned after folio ran would report folio's
    memory as its own. VmHWM belongs to the address space that exec created."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    # Elsewhere: ru_maxrss is in KiB on Linux, bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()

