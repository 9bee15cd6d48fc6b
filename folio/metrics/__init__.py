"""Engine observability: Prometheus metrics with vLLM's names under a ``folio:`` prefix."""
from folio.metrics.prometheus import EngineMetrics, build_1_2_5_buckets

__all__ = ["EngineMetrics", "build_1_2_5_buckets"]
