"""Router settings and the replica list, from command-line flags or a YAML file.

A replica is an OpenAI-compatible vLLM server (``url``) plus, optionally, where it publishes KV
events (``events``: the ZMQ PUB endpoint to connect to; ``replay``: its replay ROUTER). A replica
without events is still routed to, by load only: the index simply knows nothing about it.
Some cache engines publish on a socket of their own beside vLLM's (llm-d's FS backend):
``aux`` endpoints, any number, subscribed to with every topic and no replay.

A server started with vLLM's data parallelism runs N engines behind one URL: ``dp=N`` (or
``dp=auto``: ask its ``/kv_event_sources``) makes each engine a routing target of its own
(router/fleet/dp.py).

``storage_domain=D``: the shared storage directory it mounts; a chunk stored there is a hit
for all of D's replicas of the same ``layout=L`` (docs/indexer.md, storage domains).
``speculative=M``: vLLM's ``speculative_config.method`` (EAGLE-style ones drop a block of every
hit, which the events do not say: docs/indexer.md; ``none`` with ``disable_eagle_block_drop``).

Flag syntax: ``--replica URL[,events=EP][,replay=EP][,topic=T][,name=N][,aux=EP][,dp=N|auto]
[,storage_domain=D][,layout=L][,role=prefill|decode|both][,zone=Z][,speculative=M]``.
File syntax (YAML): ``replicas: [{url, events, replay, topic, name, aux: [EP, ...], dp,
storage_domain, layout, role, zone, speculative}, ...]``
or a bare list of the same mappings or URL strings. The file is re-read while the router runs
(kvroute.router.fleet.discovery.file).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

from kvroute.router.common.admission_queue import AdmissionSettings
from kvroute.router.config_error import ConfigError
from kvroute.router.cost_settings import CostSettings, DisaggSettings

__all__ = [
    "REPLICA_ROLES",
    "ConfigError",
    "CostSettings",
    "DisaggSettings",
    "K8sDiscoverySettings",
    "ModelTokenizerConfig",
    "ReplicaConfig",
    "RouterSettings",
    "StorageDomainConfig",
    "check_api_key",
]


# What a replica serves under prefill/decode disaggregation: both legs (aggregated), the
# prefill leg only, or the decode leg only.
REPLICA_ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    url: str
    events: str | None = None
    replay: str | None = None
    topic: str = ""
    name: str | None = None
    aux: tuple[str, ...] = ()
    # Data parallelism (router/fleet/dp.py). On a configured server: its number of engine ranks
    # (one routing target each) or "auto" (ask its /kv_event_sources). On a rank's target,
    # made by the router: the rank (sent as X-data-parallel-rank) and its server's name.
    dp: int | str | None = None
    dp_rank: int | None = None
    server: str | None = None
    # The shared storage (a directory all its replicas mount) this replica loads and stores
    # KV chunks in: every STORAGE block written into the domain is a hit for all of them.
    storage_domain: str | None = None
    # Which chunks of the domain it can read: its layout (kvroute's connector: the layout
    # digest naming its directory; llm-d's FS backend: its FileMapper folder). Replicas of
    # one domain share chunks only within a layout; None: every replica that names none.
    layout: str | None = None
    # Its LMCache instance id, as LMCache's controller names it (RouterSettings.
    # lmcache_controller): the controller's answer is then its LMCache tier.
    lmcache_instance: str | None = None
    # Which process is behind the URL, when a discovery source knows (a Kubernetes pod's
    # UID): a new value is a new replica, so its index entries are cleared, never inherited.
    incarnation: str | None = None
    # Prefill/decode disaggregation (router/routing/disagg.py): which leg it serves,
    # ``prefill``, ``decode`` or ``both`` (an aggregated replica, the default); and where it
    # runs (a node or zone name), so a prefill replica near the decode one can be preferred.
    role: str = "both"
    zone: str | None = None
    # vLLM's speculative_config.method (None: none); indexer/index/drafts.py
    speculative: str | None = None

    def __post_init__(self) -> None:
        if self.role not in REPLICA_ROLES:
            raise ConfigError(
                f"replica role must be one of {', '.join(REPLICA_ROLES)}, got {self.role!r}"
            )
        if self.storage_domain is not None:
            check_storage_domain_name(self.storage_domain)
        if self.layout is not None:
            if self.storage_domain is None:
                raise ConfigError("replica layout= needs storage_domain= (it keys the domain)")
            check_storage_domain_name(self.layout, "layout")
        if self.speculative is not None:
            check_storage_domain_name(self.speculative, "replica speculative= (vLLM's method)")
            method = self.speculative.lower()
            object.__setattr__(self, "speculative", None if method == "none" else method)
        if self.lmcache_instance is not None and not self.lmcache_instance.strip():
            raise ConfigError("replica lmcache_instance= needs LMCache's instance id")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"replica url must be http(s)://host:port, got {self.url!r}")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if self.dp is not None:
            if self.dp != "auto" and (
                isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 1
            ):
                raise ConfigError(f"replica dp must be an integer >= 1 or 'auto', got {self.dp!r}")
            if self.aux and self.dp != 1:
                raise ConfigError("aux= streams cannot be combined with dp= (which rank's?)")
            if self.dp_rank is None:
                from kvroute.router.fleet.dp import (
                    static_targets,  # kvroute.router.fleet.dp builds on this module
                )

                static_targets(self)  # each rank's endpoints can be derived (ConfigError)
        if self.dp_rank is None and self.name and "#" in self.name:
            raise ConfigError(f"replica name {self.name!r}: '#' is kept for data-parallel ranks")

    @property
    def key(self) -> str:
        """The replica's name everywhere (index, metrics, stats): ``name`` or ``host:port``."""
        return self.name or urlsplit(self.url).netloc


@dataclass(frozen=True, slots=True)
class StorageDomainConfig:
    """A storage domain's own event feed: its evictor (``kvroute storage gc``) publishes
    BlockRemoved(STORAGE) there, in vLLM's wire format with replay
    (``--storage-domain NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=T]``)."""

    name: str
    events: str
    replay: str | None = None
    topic: str = ""

    def __post_init__(self) -> None:
        check_storage_domain_name(self.name)
        if not self.events:
            raise ConfigError(f"storage domain {self.name!r} needs an events endpoint")


@dataclass(frozen=True, slots=True)
class K8sDiscoverySettings:
    """``--discover k8s``: replicas are the Ready pods matching ``selector`` (or the
    InferencePool ``inference_pool``'s selector) in ``namespace`` (router/fleet/discovery/k8s.py);
    ``peer_selector``: this router's peers (other router pods) for warm start."""

    selector: dict[str, str] = field(default_factory=dict)
    inference_pool: str | None = None
    namespace: str | None = None  # None: the kubeconfig's (in a pod: the pod's own)
    kubeconfig: str | None = None  # None: in-cluster service account, else $KUBECONFIG
    relist_interval_s: float = 60.0
    watch_timeout_s: int = 300
    peer_selector: dict[str, str] = field(default_factory=dict)
    # Where pods without port annotations publish (k8s_pods.PodPorts): vLLM's defaults; an
    # llm-d pool's pods publish on 5556 with no replay socket. None: no feed / no replay.
    pod_events_port: int | None = 5557
    pod_replay_port: int | None = 5558
    # Scale-in that keeps the cache (router/fleet/discovery/deletion_cost.py): every this
    # many seconds, set controller.kubernetes.io/pod-deletion-cost on the replica pods.
    # None: off (the routers then need no write access to pods).
    deletion_cost_interval_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("pod_events_port", "pod_replay_port"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535
            ):
                raise ConfigError(f"{name} must be a port in [1, 65535] or None")
        if self.deletion_cost_interval_s is not None and not self.deletion_cost_interval_s >= 1:
            raise ConfigError("deletion_cost_interval_s must be >= 1 (--deletion-cost-interval-s)")
        if bool(self.selector) == bool(self.inference_pool):
            raise ConfigError("--discover k8s needs exactly one of --selector, --inference-pool")
        if self.relist_interval_s <= 0 or self.watch_timeout_s < 1:
            raise ConfigError("relist_interval_s must be > 0, watch_timeout_s >= 1")


@dataclass(frozen=True, slots=True)
class ModelTokenizerConfig:
    """One model's local tokenizer (``--model-tokenizer MODEL=PATH[,chat_template=FILE]
    [,content_format=auto|string|openai]``): ``chat_template`` is the file the replicas
    serving the model were started with (vLLM's ``--chat-template``)."""

    path: str
    chat_template: str | None = None
    content_format: str = "auto"

    def __post_init__(self) -> None:
        if self.content_format not in ("auto", "string", "openai"):
            raise ConfigError("content_format must be auto, string or openai")


@dataclass(slots=True)
class RouterSettings:
    replicas: list[ReplicaConfig] = field(default_factory=list)
    replicas_file: str | None = None
    # Replicas from Kubernetes pods (router/fleet/discovery/k8s.py), applied like the file's
    k8s_discovery: K8sDiscoverySettings | None = None
    # Feeds of the storage domains' evictors (replicas attach by ReplicaConfig.storage_domain)
    storage_domains: list[StorageDomainConfig] = field(default_factory=list)
    # LMCache's controller (router/routing/lmcache.py): asked per prompt for the replicas
    # that name their LMCache instance (ReplicaConfig.lmcache_instance)
    lmcache_controller: str | None = None
    lmcache_lookup_timeout_s: float = 0.05
    policy: str = "kvroute"
    tokenizer: str | None = None
    tokenizer_mode: Literal["local", "remote"] = "local"
    host: str = "127.0.0.1"
    port: int = 8000
    # The Gateway API Inference Extension endpoint picker (router/epp/): Envoy's ext_proc
    # gRPC protocol on this port of ``host``, in the HTTP app's process and loop (None: off).
    epp_port: int | None = None
    # Serve it over TLS with this certificate chain and key (PEM files); None: a self-signed
    # certificate made at start (the gateways' generated picker clusters dial TLS without
    # verifying, as they do for the Inference Extension's own picker).
    epp_tls_cert: str | None = None
    epp_tls_key: str | None = None
    # Plaintext gRPC instead, only when asked (a hand-written Envoy with a plain cluster).
    epp_plaintext: bool = False
    # Fallback endpoints after the primary in the destination (protocol v0.4): the gateway
    # retries down the list. 0: the primary only (what a hand-written ORIGINAL_DST expects).
    epp_fallbacks: int = 0
    # Proxying
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0
    write_timeout_s: float = 30.0
    pool_timeout_s: float = 10.0
    max_connections: int = 1024
    max_attempts: int = 3
    max_body_bytes: int = 32 * 1024 * 1024
    max_json_depth: int = 128
    max_messages: int = 10_000
    max_n: int = 128  # sequences per request (400 past it)
    body_timeout_s: float = 30.0  # the whole body must arrive within this (408 otherwise)
    # A connection must send a request's complete headers within this (slowloris), or it is
    # closed (router/serving/http_protocol.py).
    header_timeout_s: float = 10.0
    # A streaming client that reads nothing for this long is given up (its request cancelled)
    client_write_timeout_s: float = 60.0
    # Requests this router proxies at once; past it, 429 with Retry-After instead of queueing
    max_in_flight: int = 4096
    # A replica with this many requests pending (vLLM's running + waiting, or this router's
    # in flight to it) takes no more; when every candidate has, 503 with Retry-After.
    # 0: no bound (vLLM's own queue is unbounded). Set it to a few times --max-num-seqs.
    max_pending_per_replica: int = 0
    retry_after_s: int = 2
    # Replica health and load signals
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    unhealthy_after: int = 2
    healthy_after: int = 1
    # GET /ready (router/ops/readiness.py) waits for live event feeds at most this long after
    # start; then a healthy replica is enough.
    ready_grace_s: float = 60.0
    models_refresh_s: float = 30.0
    watch_interval_s: float = 1.0
    # Index feed
    replay_timeout_s: float = 5.0
    # Warm start (router/peers/warm_start.py): peer routers (http(s)://host:port) whose index
    # snapshot seeds this one before its feeds start; tried in order, replay when none answers.
    peers: list[str] = field(default_factory=list)
    peer_timeout_s: float = 5.0
    # A bigger snapshot is refused (and not served); read streamed, never buffered whole.
    peer_snapshot_max_mib: int = 1024
    # Shared load (router/peers/load.py): how often the peers' in-flight counts are polled;
    # 0 turns it off (each router then sees only its own requests between scrapes).
    peer_load_interval_s: float = 0.1
    # "follow": one stream per peer, a line each time its counts change (a peer's request
    # seen within 10 ms); "poll": ask every peer_load_interval_s (router/peers/load.py).
    peer_load_mode: str = "follow"
    stale_clear_after_s: float = 30.0
    # Per event stream: a publisher past this many MiB/s of events is cleared and dropped
    # until it slows down (indexer/subscriber/budget.py); 0 turns the budget off.
    event_max_mib_per_s: float = 8.0
    # None: what fits in about 8 GiB on the index core that runs (indexer/index/memory.py)
    index_max_entries: int | None = None
    # Tiers whose publisher never announces removals (LMCache, llm-d's FS backend): how long
    # an entry is believed after its last store, and how many blocks a replica may hold so.
    unconfirmed_ttl_s: float = 600.0
    unconfirmed_max_blocks: int = 262_144
    # Routing
    cost: CostSettings = field(default_factory=CostSettings)
    disagg: DisaggSettings = field(default_factory=DisaggSettings)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    hint_ttl_s: float = 5.0
    hint_max_keys: int = 500_000
    default_block_size: int = 16
    session_header: str = "x-session-id"
    approx_block_size: int = 16
    approx_max_keys: int = 1_000_000
    home_max_keys: int = 200_000  # remembered homes (prefix -> replica), least recent dropped
    approx_match_threshold: float = 0.5
    approx_balance_abs: int = 32
    approx_balance_rel: float = 1.5
    # Tokenization
    tokenizer_cache_entries: int = 4096
    tokenizer_segment_cache_entries: int = 65536
    tokenizer_check_on_start: bool = True
    # The replicas' --chat-template (a file) and --chat-template-content-format, for the
    # default tokenizer; per model (and its LoRA adapters): model_tokenizers.
    tokenizer_chat_template: str | None = None
    tokenizer_content_format: str = "auto"
    model_tokenizers: dict[str, ModelTokenizerConfig] = field(default_factory=dict)
    # Live check (router/tokens/token_check.py): every Nth request of a model is also tokenized by
    # a replica, in the background (0: off); after a mismatch the model is tokenized
    # remotely until this many clean checks in a row.
    tokenizer_check_every: int = 100
    tokenizer_clean_checks: int = 3
    # Remote tokenization asks vLLM's render endpoints first (exact; multimodal hashes).
    tokenizer_render: bool = True
    # Process-wide GC tuning; for the server process only (kvroute serve sets it).
    gc_freeze: bool = False
    # Process-wide: the interpreter's GIL switch interval (sys.setswitchinterval) in the
    # server process, so the event loop waits less for the GIL behind the event-feed
    # threads; None keeps Python's 5 ms.
    gil_switch_interval_s: float | None = None
    # The event loop thread's time slice (indexer/cpu_priority.py): short, so the loop gets
    # the CPU ahead of background work (the event feeds, other processes) when a request
    # wakes it; Linux 6.12+, ignored elsewhere. None leaves the kernel's default.
    loop_slice_s: float | None = 0.0001
    # API keys (router/serving/auth.py): what clients must send (any of them; none: the router is
    # open), whether /health and /metrics need one too, and the key the replicas were
    # started with (vLLM's --api-key), sent on every request the router makes to them.
    # repr=False: settings are printed and logged, keys never.
    api_keys: list[str] = field(default_factory=list, repr=False)
    api_key_protects_metrics: bool = False
    replica_api_key: str | None = field(default=None, repr=False)
    # Routers' own credential to each other (GET /index/snapshot, GET /peer/load): a shared
    # secret. When set, those paths take it and only it, and this router sends it to its
    # peers; unset, they take the clients' keys as before (and are open without any).
    peer_key: str | None = field(default=None, repr=False)

    @property
    def peer_credential(self) -> str | None:
        """What this router sends its peers: the peer key, else the first client key."""
        return self.peer_key or (self.api_keys[0] if self.api_keys else None)

    def __post_init__(self) -> None:
        # Imported here: the policies import this module's types, and config sits below them.
        from kvroute.router.routing.policies import POLICIES

        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        if self.tokenizer_mode not in ("local", "remote"):
            raise ConfigError("tokenizer_mode must be 'local' or 'remote'")
        if self.tokenizer_check_every < 0 or self.tokenizer_clean_checks < 1:
            raise ConfigError("tokenizer_check_every must be >= 0, tokenizer_clean_checks >= 1")
        if self.tokenizer_content_format not in ("auto", "string", "openai"):
            raise ConfigError("tokenizer_content_format must be auto, string or openai")
        if self.max_attempts < 1:
            raise ConfigError("max_attempts must be >= 1")
        names = [r.key for r in self.replicas]
        if len(names) != len(set(names)):
            raise ConfigError(f"replica names must be unique: {names}")
        domains = [d.name for d in self.storage_domains]
        if len(domains) != len(set(domains)):
            raise ConfigError(f"storage domain names must be unique: {domains}")
        if self.lmcache_lookup_timeout_s <= 0:
            raise ConfigError("lmcache_lookup_timeout_s must be > 0")
        if self.unconfirmed_ttl_s <= 0 or self.unconfirmed_max_blocks < 0:
            raise ConfigError("unconfirmed_ttl_s must be > 0, unconfirmed_max_blocks >= 0")
        if (
            self.max_body_bytes < 1
            or self.max_json_depth < 2
            or self.max_messages < 1
            or self.max_n < 1
        ):
            raise ConfigError(
                "max_body_bytes >= 1, max_json_depth >= 2, max_messages >= 1, max_n >= 1"
            )
        if min(self.body_timeout_s, self.client_write_timeout_s, self.header_timeout_s) <= 0:
            raise ConfigError(
                "body_timeout_s, client_write_timeout_s and header_timeout_s must be > 0"
            )
        if self.event_max_mib_per_s < 0:
            raise ConfigError("event_max_mib_per_s must be >= 0 (0: no budget)")
        if self.gil_switch_interval_s is not None and not 0 < self.gil_switch_interval_s <= 1:
            raise ConfigError("gil_switch_interval_s must be in (0, 1] seconds")
        if self.loop_slice_s is not None and not 0 < self.loop_slice_s <= 0.1:
            raise ConfigError("loop_slice_s must be in (0, 0.1] seconds (None: the kernel's)")
        if self.max_pending_per_replica < 0:
            raise ConfigError("max_pending_per_replica must be >= 0 (0: no bound)")
        if self.max_in_flight < 1:
            raise ConfigError("max_in_flight must be >= 1")
        if self.epp_port is not None and (
            isinstance(self.epp_port, bool)
            or not isinstance(self.epp_port, int)
            or not 1 <= self.epp_port <= 65535
            or self.epp_port == self.port
        ):
            raise ConfigError("epp_port must be a port in [1, 65535] other than the HTTP port")
        if (self.epp_tls_cert is None) != (self.epp_tls_key is None):
            raise ConfigError("epp_tls_cert and epp_tls_key go together (--epp-tls-cert/-key)")
        if self.epp_tls_cert is not None and self.epp_port is None:
            raise ConfigError("epp_tls_cert needs epp_port (--epp-port)")
        if self.epp_tls_cert is not None and self.epp_plaintext:
            raise ConfigError(
                "epp_plaintext and epp_tls_cert contradict each other (--epp-plaintext, "
                "--epp-tls-cert): choose one"
            )
        if (
            isinstance(self.epp_fallbacks, bool)
            or not isinstance(self.epp_fallbacks, int)
            or not 0 <= self.epp_fallbacks <= 8
        ):
            raise ConfigError("epp_fallbacks must be an integer in [0, 8] (--epp-fallbacks)")
        for peer in self.peers:
            parts = urlsplit(peer)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError(f"peer must be http(s)://host:port, got {peer!r}")
        if self.peer_timeout_s <= 0 or self.peer_snapshot_max_mib < 1:
            raise ConfigError("peer_timeout_s must be > 0, peer_snapshot_max_mib >= 1")
        if not 0 <= self.peer_load_interval_s <= 60:
            raise ConfigError("peer_load_interval_s must be in [0, 60] (0: off)")
        if self.peer_load_mode not in ("follow", "poll"):
            raise ConfigError(f"peer_load_mode must be follow or poll, got {self.peer_load_mode!r}")
        for key in self.api_keys:
            check_api_key(key, "api key")
        if self.replica_api_key is not None:
            check_api_key(self.replica_api_key, "replica api key")
        if self.peer_key is not None:
            check_api_key(self.peer_key, "peer key")
            if self.peer_key in self.api_keys:
                raise ConfigError("the peer key must differ from every client key (--api-key)")
        if self.api_key_protects_metrics and not self.api_keys:
            raise ConfigError("api_key_protects_metrics needs an api key (--api-key)")

    def replace(self, **changes: Any) -> RouterSettings:
        return dataclasses.replace(self, **changes)


def check_api_key(key: object, what: str) -> None:
    """Refuse a key that cannot work: empty, or not an HTTP header token (never quoted)."""
    if not isinstance(key, str) or not key.strip():
        raise ConfigError(f"{what} is empty: give a non-empty key, or none at all")
    if not all("!" <= c <= "~" for c in key):
        raise ConfigError(f"{what} must be printable ASCII without spaces")


def check_storage_domain_name(name: object, what: str = "storage domain name") -> None:
    """A domain name, a replica's layout or speculative method is a label (it keys the index,
    shows in stats): letters, digits, ``-_.``; no ``:`` or ``#`` (the index's pseudo-keys)."""
    label = isinstance(name, str) and 0 < len(name) <= 128
    if not label or not all(c.isalnum() or c in "-_." for c in name):  # type: ignore[union-attr]
        raise ConfigError(f"{what} must be 1-128 letters, digits, '-', '_' or '.', got {name!r}")
