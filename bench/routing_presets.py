"""The routing benchmark's fleets and workloads (``kvroute bench routing --preset``): the
simulated hardware every preset runs on, each preset's fleet and workload sizes, and the
workloads the targets are judged on (docs/benchmarks.md has the arithmetic)."""

from __future__ import annotations

from typing import Any

from kvroute.bench.workloads import tenants

__all__ = ["BENCH_LATENCY", "PRESETS", "TARGET_WORKLOADS"]

# The simulated hardware: a 70B-class model on one H100-class GPU (FP8): prefill ~4k tokens/s,
# KV loads from host memory 12.5x and from local NVMe 2.5x faster than recomputing, 30 ms
# decode steps. Heavier per-token work than the simulator's 8B default lets a few hundred
# requests load a fleet, which a 2-core machine can drive through a Python router.
BENCH_LATENCY = dict(
    prefill_s_per_token=2.5e-4,
    load_cpu_s_per_token=2e-5,
    load_storage_s_per_token=1e-4,
    decode_s_per_step=0.03,
    decode_s_per_seq=2e-4,
)

# Sizes per preset (docs/benchmarks.md has the arithmetic). In every workload the working set
# exceeds the fleet's device cache, and the offered prefill load is 1.2-1.5x what the fleet
# could serve with no prefix reuse at all: affordable with good reuse, not without. The
# numbers follow from the fleet and the workload, never from any policy's results.
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {
        "replicas": 4,
        "gpu_blocks": 150,
        "cpu_blocks": 150,
        "storage_blocks": 0,
        "time_scale": 0.5,
        "workloads": ["shared_prefix", "chat"],
        "deadline_s": 40.0,
        "sizes": {
            "shared_prefix": dict(
                groups=16,
                questions=4,
                prefix_tokens=1500,
                question_tokens=60,
                answer_tokens=16,
                rate=13.0,
            ),
            "chat": dict(
                users=32,
                rounds=3,
                system_tokens=300,
                question_tokens=80,
                answer_tokens=40,
                user_rate=8.0,
                think_s=1.0,
            ),
            "doc_qa": dict(
                documents=8,
                questions=3,
                document_tokens=3000,
                question_tokens=40,
                answer_tokens=16,
                rate=6.0,
            ),
            "agentic": dict(
                agents=12,
                steps=4,
                system_tokens=600,
                task_tokens=100,
                tool_output_tokens=(100, 300),
                call_tokens=32,
                agent_rate=4.0,
                tool_latency_s=0.5,
            ),
        },
    },
    "full": {
        "replicas": 8,
        "gpu_blocks": 800,
        "cpu_blocks": 800,
        "storage_blocks": 0,
        "time_scale": 0.5,
        "workloads": ["chat", "shared_prefix", "doc_qa", "agentic"],
        "deadline_s": 150.0,
        "sizes": {
            "shared_prefix": dict(
                groups=32,
                questions=16,
                prefix_tokens=4000,
                question_tokens=100,
                answer_tokens=32,
                rate=11.0,
            ),
            "chat": dict(
                users=100,
                rounds=12,
                system_tokens=1000,
                history_tokens=3000,
                question_tokens=100,
                answer_tokens=32,
                user_rate=1.25,
                think_s=1.0,
            ),
            "doc_qa": dict(
                documents=24,
                questions=4,
                document_tokens=6000,
                question_tokens=60,
                answer_tokens=32,
                rate=7.5,
            ),
            "agentic": dict(
                agents=48,
                steps=8,
                system_tokens=1500,
                task_tokens=200,
                tool_output_tokens=(200, 800),
                call_tokens=64,
                agent_rate=4.0,
                tool_latency_s=1.0,
            ),
        },
    },
}

# Small device caches: each replica's device tier holds about two of the longest
# conversations (160 blocks of 16 tokens; a user's context grows to about 1,300 tokens over
# eight turns), a CPU tier holds every history, and the fleet is not overloaded (the
# cache-blind policies' p90 stays under 0.3 s). Here a request sent to the replica that
# holds its history may wait for room in its device cache behind the conversations
# decoding there, which no queue length shows: the preset where affinity pays in the tail
# (docs/benchmarks.md, "Small device caches").
PRESETS["small_device"] = {
    "replicas": 4,
    "gpu_blocks": 160,
    "cpu_blocks": 2000,
    "storage_blocks": 0,
    "time_scale": 0.5,
    "workloads": ["chat"],
    "deadline_s": 90.0,
    "sizes": {
        "chat": dict(
            users=24,
            rounds=8,
            system_tokens=300,
            question_tokens=80,
            answer_tokens=40,
            user_rate=2.0,
            think_s=3.0,
        ),
    },
}

# llm-d's precise-routing benchmark shape: many tenants' prefixes, a ramping rate.
PRESETS["llmd"] = tenants.LLMD_PRESET

TARGET_WORKLOADS = ("chat", "shared_prefix")
