"""The KV-event publisher moved to ``kvroute.indexer.publisher`` (the storage evictor
publishes with it too); this name stays for the simulator, tests and benchmarks."""

from kvroute.indexer.publisher import EventPublisher, vllm_binds

__all__ = ["EventPublisher", "vllm_binds"]
