"""``kvroute serve``: the router under uvicorn, with the indexer in-process.

``add_arguments(parser)`` and ``main(args) -> int`` follow the project's CLI convention (the
``kvroute`` command (deploy/cli.py) mounts them); ``python -m kvroute.router.cli ...`` runs
the same thing directly.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from pathlib import Path

from kvroute.router.common.admission_queue import AdmissionSettings
from kvroute.router.config import ConfigError, CostSettings, DisaggSettings, RouterSettings
from kvroute.router.fleet.discovery.flags import add_discovery_arguments, discovery_from_args
from kvroute.router.routing.policies import POLICIES
from kvroute.router.specs import (
    parse_model_tokenizer_flag,
    parse_replica_flag,
    parse_storage_domain_flag,
)

__all__ = ["add_arguments", "api_keys_from_args", "main", "settings_from_args"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = RouterSettings()
    c = CostSettings()
    fleet = parser.add_argument_group("replicas")
    fleet.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL[,events=EP,replay=EP,topic=T,name=N,aux=EP,dp=N|auto,storage_domain=D,"
        "layout=L]",
        help="a vLLM replica and where it publishes KV events (repeatable); dp=N: a "
        "data-parallel server, each rank routed to as <name>#dp<r> (auto: ask the server); "
        "storage_domain=D: it shares storage domain D (its chunks are hits for all of D); "
        "layout=L: only with the replicas of D that read layout L (its layout digest)",
    )
    fleet.add_argument(
        "--storage-domain",
        action="append",
        default=[],
        metavar="NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT]",
        help="a storage domain's evictor feed (kvroute storage gc, or llm-d's PVC evictor "
        "with topic=kv@SHARED_STORAGE@MODEL), repeatable: its removals of shared chunks "
        "reach the index",
    )
    fleet.add_argument(
        "--replicas-file",
        default=None,
        help="YAML file of replicas, watched: edits add and remove replicas without a restart",
    )
    fleet.add_argument("--watch-interval-s", type=float, default=d.watch_interval_s)
    add_discovery_arguments(parser)
    fleet.add_argument(
        "--replay-timeout-s",
        type=float,
        default=d.replay_timeout_s,
        help="how long to wait for a replica's replay socket after a gap",
    )
    fleet.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="URL",
        help="a running router (http://host:port) whose index snapshot seeds this one at "
        "start (repeatable, tried in order): only each replica's events since the snapshot "
        "are replayed (warm start); with none answering, the replicas' full replay",
    )
    fleet.add_argument(
        "--peer-timeout-s",
        type=float,
        default=d.peer_timeout_s,
        help="how long to wait for one peer's whole snapshot before trying the next",
    )
    fleet.add_argument(
        "--peer-snapshot-max-mib",
        type=int,
        default=d.peer_snapshot_max_mib,
        metavar="MIB",
        help="the largest index snapshot this router serves or reads (read as it streams, "
        "never buffered whole); a bigger one is refused and the replicas replay instead",
    )
    fleet.add_argument(
        "--peer-load-interval-s",
        type=float,
        default=d.peer_load_interval_s,
        help="share in-flight requests with the peer routers and count theirs in each "
        "replica's queue (several routers behind one Service): the staleness bound and, with "
        "--peer-load-mode poll, the poll interval; 0: off",
    )
    fleet.add_argument(
        "--peer-load-mode",
        choices=["follow", "poll"],
        default=d.peer_load_mode,
        help="follow: one stream per peer, a line as soon as its counts change; "
        "poll: ask every --peer-load-interval-s",
    )
    fleet.add_argument(
        "--stale-clear-after-s",
        type=float,
        default=d.stale_clear_after_s,
        help="drop a silent replica's index entries after this long",
    )
    fleet.add_argument(
        "--event-max-mib-per-s",
        type=float,
        default=d.event_max_mib_per_s,
        help="per event stream: a publisher sending more is cleared and its events dropped "
        "until it slows down (a real vLLM replica sends well under 1 MiB/s); 0: no limit",
    )
    fleet.add_argument(  # default: about 8 GiB's worth (134M native, 44.7M Python entries)
        "--index-max-entries", type=int, default=d.index_max_entries
    )
    fleet.add_argument(
        "--unconfirmed-ttl-s",
        type=float,
        default=d.unconfirmed_ttl_s,
        help="how long an entry of a tier whose publisher never announces removals (LMCache, "
        "llm-d's FS backend) is believed after its last store",
    )
    fleet.add_argument(
        "--unconfirmed-max-blocks",
        type=int,
        default=d.unconfirmed_max_blocks,
        help="per replica, the most blocks held in such tiers (oldest dropped first)",
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=d.host)
    server.add_argument("--port", type=int, default=d.port)
    server.add_argument(
        "--epp-port",
        type=int,
        default=None,
        metavar="PORT",
        help="also serve as a Gateway API Inference Extension endpoint picker: Envoy's "
        "ext_proc gRPC on this port of --host (TLS: --epp-tls-cert and --epp-tls-key, "
        "else a self-signed certificate made at start; --epp-plaintext for none), for an "
        "InferencePool's "
        "endpointPickerRef; the gateway forwards the traffic. Meant for the gateway only "
        "(restrict it with a NetworkPolicy); with --api-key each request's Authorization "
        "is checked like on HTTP. Needs the xds-protos package. Default: off",
    )
    server.add_argument(
        "--epp-tls-cert",
        metavar="PEM",
        help="serve the endpoint picker over TLS with this certificate (chain), as the "
        "Inference Extension's own picker does by default; with --epp-tls-key",
    )
    server.add_argument("--epp-tls-key", metavar="PEM", help="the --epp-tls-cert's private key")
    server.add_argument(
        "--epp-plaintext", action="store_true", help="serve the endpoint picker without TLS"
    )
    server.add_argument(
        "--epp-fallbacks",
        type=int,
        default=d.epp_fallbacks,
        metavar="N",
        help="list up to N further-ranked replicas after the pick, for the gateway to retry "
        "on (Endpoint Picker Protocol v0.4; Envoy's override_host policy reads the list). "
        "Default 0: the pick alone, the one address agentgateway and NGINX Gateway Fabric "
        "accept",
    )
    server.add_argument("--log-level", default="info")
    server.add_argument("--access-log", action="store_true", help="log every request")
    keys = parser.add_argument_group(
        "API keys (or $KVROUTE_API_KEY, $KVROUTE_REPLICA_API_KEY; a flag wins over a file, a "
        "file over the variable)"
    )
    keys.add_argument(
        "--api-key",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY",
        help="clients must send 'Authorization: Bearer KEY' (one of these keys); /health "
        "and /metrics stay open. Prefer --api-key-file or the variable: argv is visible to ps",
    )
    keys.add_argument("--api-key-file", metavar="PATH", help="the router's key: the first line")
    keys.add_argument(
        "--api-key-protects-metrics",
        action="store_true",
        help="/health and /metrics need the key too",
    )
    keys.add_argument(
        "--replica-api-key",
        metavar="KEY",
        help="the key the replicas were started with (vLLM --api-key), sent on every request "
        "the router makes to them",
    )
    keys.add_argument(
        "--replica-api-key-file", metavar="PATH", help="the replicas' key: the first line"
    )
    keys.add_argument(
        "--peer-key-file",
        metavar="PATH",
        help="the routers' shared secret to each other (or $KVROUTE_PEER_KEY): their "
        "/index/snapshot and /peer/load then take it and no client key, and this router "
        "sends it to its peers. Default: the client keys serve for both",
    )
    routing = parser.add_argument_group("routing")
    routing.add_argument("--policy", choices=tuple(POLICIES), default=d.policy)
    routing.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer path or model id (transformers); default: the replicas' /tokenize",
    )
    routing.add_argument("--tokenizer-mode", choices=("local", "remote"), default=d.tokenizer_mode)
    routing.add_argument(
        "--no-tokenizer-check",
        action="store_true",
        help="skip the startup comparison with a replica's /tokenize",
    )
    routing.add_argument(
        "--tokenizer-chat-template",
        default=None,
        metavar="FILE",
        help="the chat template file the replicas run (vLLM's --chat-template), for --tokenizer",
    )
    routing.add_argument(
        "--tokenizer-content-format",
        choices=("auto", "string", "openai"),
        default=d.tokenizer_content_format,
        help="the replicas' --chat-template-content-format",
    )
    routing.add_argument(
        "--model-tokenizer",
        action="append",
        default=[],
        metavar="MODEL=PATH[,chat_template=FILE][,content_format=F]",
        help="a model's own tokenizer (and its replicas' chat template); repeatable. "
        "Its LoRA adapters use it too; other models use --tokenizer, or the replicas",
    )
    routing.add_argument(
        "--tokenizer-check-every",
        type=int,
        default=d.tokenizer_check_every,
        help="compare every Nth request's local ids with a replica's, in the background "
        "(0: never); a mismatch switches that model to remote tokenization",
    )
    routing.add_argument(
        "--tokenizer-clean-checks",
        type=int,
        default=d.tokenizer_clean_checks,
        help="clean checks in a row that return a switched model to local tokenization",
    )
    routing.add_argument(
        "--no-tokenizer-render",
        action="store_true",
        help="remote tokenization: use /tokenize only, never vLLM's render endpoints",
    )
    routing.add_argument(
        "--hint-ttl-s",
        type=float,
        default=d.hint_ttl_s,
        help="burst-hint lifetime (0 disables hints)",
    )
    routing.add_argument(
        "--lmcache-controller",
        default=None,
        metavar="URL",
        help="LMCache's controller: asked (POST /lookup) what the replicas naming their "
        "LMCache instance (lmcache_instance=ID) hold of each prompt",
    )
    routing.add_argument(
        "--lmcache-lookup-timeout-s", type=float, default=d.lmcache_lookup_timeout_s
    )
    routing.add_argument("--session-header", default=d.session_header)
    cost = parser.add_argument_group("cost model (seconds; see docs/router.md)")
    cost.add_argument("--prefill-s-per-token", type=float, default=c.prefill_s_per_token)
    cost.add_argument("--load-s-per-token-cpu", type=float, default=c.load_s_per_token_cpu)
    cost.add_argument("--load-s-per-token-storage", type=float, default=c.load_s_per_token_storage)
    cost.add_argument("--queue-s-per-request", type=float, default=c.queue_s_per_request)
    cost.add_argument(
        "--no-learn-queue-delay",
        action="store_true",
        help="keep --queue-s-per-request fixed instead of learning it per replica",
    )
    cost.add_argument(
        "--no-learn-rates",
        action="store_true",
        help="keep the prefill and load rates fixed instead of learning them per replica",
    )
    cost.add_argument("--queue-knee", type=float, default=c.queue_knee)
    cost.add_argument("--waiting-s-per-request", type=float, default=c.waiting_s_per_request)
    cost.add_argument(
        "--unconfirmed-weight",
        type=float,
        default=c.unconfirmed_weight,
        help="how much of a match held only by publishers that never announce removals "
        "(LMCache, llm-d's FS backend) is believed (0..1)",
    )
    pd = parser.add_argument_group("prefill/decode disaggregation (replicas with role=)")
    p = DisaggSettings()
    pd.add_argument("--pd-mode", choices=("auto", "always", "never"), default=p.mode)
    pd.add_argument("--pd-skip-tokens", type=int, default=p.skip_tokens)
    pd.add_argument("--pd-skip-fraction", type=float, default=p.skip_fraction)
    pd.add_argument("--pd-transfer-s-per-token", type=float, default=p.transfer_s_per_token)
    pd.add_argument("--pd-split-overhead-s", type=float, default=p.split_overhead_s)
    pd.add_argument("--pd-zone-slack", type=float, default=p.zone_slack)
    pd.add_argument("--pd-prefill-attempts", type=int, default=p.prefill_attempts)
    pd.add_argument("--pd-prefill-timeout-s", type=float, default=p.prefill_timeout_s)
    pd.add_argument("--pd-decode-stall-weight", type=float, default=p.decode_stall_weight)
    pd.add_argument(
        "--pd-whole-on-prefill",
        action=argparse.BooleanOptionalAction,
        default=p.whole_on_prefill,
        help="let the decider serve a whole request on a prefill replica when it prices it "
        "cheapest (vLLM's P/D instances serve ordinary requests too)",
    )
    proxy = parser.add_argument_group("proxy")
    proxy.add_argument("--connect-timeout-s", type=float, default=d.connect_timeout_s)
    proxy.add_argument("--read-timeout-s", type=float, default=d.read_timeout_s)
    proxy.add_argument("--max-attempts", type=int, default=d.max_attempts)
    proxy.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    proxy.add_argument("--max-json-depth", type=int, default=d.max_json_depth)
    proxy.add_argument("--max-messages", type=int, default=d.max_messages)
    proxy.add_argument(
        "--max-n", type=int, default=d.max_n, help="most sequences (n) one request may ask for"
    )
    proxy.add_argument("--body-timeout-s", type=float, default=d.body_timeout_s)
    proxy.add_argument(
        "--header-timeout-s",
        type=float,
        default=d.header_timeout_s,
        help="close a connection that has not sent a request's complete headers this long "
        "after opening (or after its next request began)",
    )
    proxy.add_argument("--client-write-timeout-s", type=float, default=d.client_write_timeout_s)
    proxy.add_argument(
        "--gil-switch-interval-s",
        type=float,
        default=d.gil_switch_interval_s,
        help="the interpreter's GIL switch interval (sys.setswitchinterval): how long the "
        "event loop may wait for the GIL behind the event-feed threads (default: Python's 5 ms)",
    )
    proxy.add_argument(
        "--loop-slice-s",
        type=float,
        default=d.loop_slice_s,
        help="the event loop thread's CPU time slice (Linux 6.12+; 0 for the kernel's "
        "default): short, so a request that wakes the loop runs ahead of the event feeds",
    )
    proxy.add_argument("--max-in-flight", type=int, default=d.max_in_flight)
    proxy.add_argument(
        "--max-pending-per-replica",
        type=int,
        default=d.max_pending_per_replica,
        help="a replica with this many requests pending takes no more; when all have, "
        "requests queue (--admission) (0: no bound; a few times vLLM's --max-num-seqs)",
    )
    proxy.add_argument("--retry-after-s", type=int, default=d.retry_after_s)
    a = d.admission
    admit = parser.add_argument_group(
        "admission (when every replica is at --max-pending-per-replica; docs/router.md)"
    )
    admit.add_argument(
        "--admission",
        action=argparse.BooleanOptionalAction,
        default=a.enabled,
        help="queue requests in priority, tenant and cost order while every replica is "
        "saturated (--no-admission: refuse at once with 503)",
    )
    admit.add_argument("--admission-max-queued", type=int, default=a.max_queued)
    admit.add_argument(
        "--admission-max-wait-s",
        type=float,
        default=a.max_wait_s,
        help="the longest a request waits for a replica; past it, 429 with Retry-After "
        "(a client's x-kvroute-max-wait-s header may ask for less)",
    )
    admit.add_argument("--admission-order", choices=("cost", "priority", "fifo"), default=a.order)
    admit.add_argument(
        "--admission-aging",
        type=float,
        default=a.aging,
        help="estimated-cost seconds forgiven per second waited (cost order): nothing starves",
    )
    admit.add_argument(
        "--admission-reserve",
        type=int,
        default=a.reserve,
        help="slots of each replica's --max-pending-per-replica that only requests with "
        "priority < 0 may take (at most all but one)",
    )
    admit.add_argument("--priority-header", default=a.priority_header)
    admit.add_argument("--tenant-header", default=a.tenant_header)
    proxy.add_argument("--max-connections", type=int, default=d.max_connections)
    health = parser.add_argument_group("health")
    health.add_argument("--health-interval-s", type=float, default=d.health_interval_s)
    health.add_argument("--health-timeout-s", type=float, default=d.health_timeout_s)
    health.add_argument("--unhealthy-after", type=int, default=d.unhealthy_after)
    health.add_argument("--healthy-after", type=int, default=d.healthy_after)
    health.add_argument(
        "--ready-grace-s",
        type=float,
        default=d.ready_grace_s,
        help="GET /ready waits for every healthy replica's event feed to be live at most "
        "this long after start; then a healthy replica is enough",
    )


def _key_file(path: str, flag: str) -> str:
    """The key in a file's first line (stripped); ConfigError, without the key, otherwise."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{flag}: {path} is not UTF-8 text") from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise ConfigError(f"{flag}: the first line of {path} is empty")
    return key


def api_keys_from_args(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """(the router's keys, the replicas' key) from the flags, the files or the environment."""
    keys: list[str] = list(args.api_key)
    if not keys and args.api_key_file:
        keys = [_key_file(args.api_key_file, "--api-key-file")]
    if not keys and "KVROUTE_API_KEY" in os.environ:
        keys = [os.environ["KVROUTE_API_KEY"]]
    replica_key: str | None = args.replica_api_key
    if replica_key is None and args.replica_api_key_file:
        replica_key = _key_file(args.replica_api_key_file, "--replica-api-key-file")
    if replica_key is None:
        replica_key = os.environ.get("KVROUTE_REPLICA_API_KEY")
    return keys, replica_key


def peer_key_from_args(args: argparse.Namespace) -> str | None:
    """The routers' shared secret: ``--peer-key-file``, else ``$KVROUTE_PEER_KEY``."""
    if args.peer_key_file:
        return _key_file(args.peer_key_file, "--peer-key-file")
    return os.environ.get("KVROUTE_PEER_KEY")


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    cost = CostSettings(
        prefill_s_per_token=args.prefill_s_per_token,
        load_s_per_token_cpu=args.load_s_per_token_cpu,
        load_s_per_token_storage=args.load_s_per_token_storage,
        queue_s_per_request=args.queue_s_per_request,
        learn_queue_delay=not args.no_learn_queue_delay,
        learn_rates=not args.no_learn_rates,
        queue_knee=args.queue_knee,
        waiting_s_per_request=args.waiting_s_per_request,
        unconfirmed_weight=args.unconfirmed_weight,
    )
    api_keys, replica_api_key = api_keys_from_args(args)
    return RouterSettings(
        api_keys=api_keys,
        api_key_protects_metrics=args.api_key_protects_metrics,
        replica_api_key=replica_api_key,
        peer_key=peer_key_from_args(args),
        replicas=[parse_replica_flag(r) for r in args.replica],
        replicas_file=args.replicas_file,
        k8s_discovery=discovery_from_args(args),
        storage_domains=[parse_storage_domain_flag(v) for v in args.storage_domain],
        watch_interval_s=args.watch_interval_s,
        replay_timeout_s=args.replay_timeout_s,
        peers=list(args.peer),
        peer_timeout_s=args.peer_timeout_s,
        peer_snapshot_max_mib=args.peer_snapshot_max_mib,
        peer_load_interval_s=args.peer_load_interval_s,
        peer_load_mode=args.peer_load_mode,
        stale_clear_after_s=args.stale_clear_after_s,
        event_max_mib_per_s=args.event_max_mib_per_s,
        index_max_entries=args.index_max_entries,
        unconfirmed_ttl_s=args.unconfirmed_ttl_s,
        unconfirmed_max_blocks=args.unconfirmed_max_blocks,
        policy=args.policy,
        tokenizer=args.tokenizer,
        tokenizer_mode=args.tokenizer_mode,
        tokenizer_check_on_start=not args.no_tokenizer_check,
        tokenizer_chat_template=args.tokenizer_chat_template,
        tokenizer_content_format=args.tokenizer_content_format,
        model_tokenizers=dict(parse_model_tokenizer_flag(v) for v in args.model_tokenizer),
        tokenizer_check_every=args.tokenizer_check_every,
        tokenizer_clean_checks=args.tokenizer_clean_checks,
        tokenizer_render=not args.no_tokenizer_render,
        host=args.host,
        port=args.port,
        epp_port=args.epp_port,
        epp_tls_cert=args.epp_tls_cert,
        epp_tls_key=args.epp_tls_key,
        epp_plaintext=args.epp_plaintext,
        epp_fallbacks=args.epp_fallbacks,
        connect_timeout_s=args.connect_timeout_s,
        read_timeout_s=args.read_timeout_s,
        max_attempts=args.max_attempts,
        max_body_bytes=args.max_body_bytes,
        max_json_depth=args.max_json_depth,
        max_messages=args.max_messages,
        max_n=args.max_n,
        body_timeout_s=args.body_timeout_s,
        header_timeout_s=args.header_timeout_s,
        client_write_timeout_s=args.client_write_timeout_s,
        gil_switch_interval_s=args.gil_switch_interval_s,
        loop_slice_s=args.loop_slice_s or None,
        max_in_flight=args.max_in_flight,
        max_pending_per_replica=args.max_pending_per_replica,
        retry_after_s=args.retry_after_s,
        admission=AdmissionSettings(
            enabled=args.admission,
            max_queued=args.admission_max_queued,
            max_wait_s=args.admission_max_wait_s,
            order=args.admission_order,
            aging=args.admission_aging,
            reserve=args.admission_reserve,
            priority_header=args.priority_header.lower(),
            tenant_header=args.tenant_header.lower(),
        ),
        max_connections=args.max_connections,
        health_interval_s=args.health_interval_s,
        health_timeout_s=args.health_timeout_s,
        unhealthy_after=args.unhealthy_after,
        healthy_after=args.healthy_after,
        ready_grace_s=args.ready_grace_s,
        hint_ttl_s=args.hint_ttl_s,
        lmcache_controller=args.lmcache_controller,
        lmcache_lookup_timeout_s=args.lmcache_lookup_timeout_s,
        session_header=args.session_header,
        cost=cost,
        disagg=DisaggSettings(
            mode=args.pd_mode,
            skip_tokens=args.pd_skip_tokens,
            skip_fraction=args.pd_skip_fraction,
            transfer_s_per_token=args.pd_transfer_s_per_token,
            split_overhead_s=args.pd_split_overhead_s,
            zone_slack=args.pd_zone_slack,
            prefill_attempts=args.pd_prefill_attempts,
            prefill_timeout_s=args.pd_prefill_timeout_s,
            decode_stall_weight=args.pd_decode_stall_weight,
            whole_on_prefill=args.pd_whole_on_prefill,
        ),
    )


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from kvroute.router.app import create_app
    from kvroute.router.serving.http_protocol import header_deadline_protocol

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = settings_from_args(args).replace(gc_freeze=True)
    except ConfigError as exc:
        print(f"kvroute serve: {exc}", file=sys.stderr)
        return 2
    if not settings.replicas and not settings.replicas_file and not settings.k8s_discovery:
        print(
            "kvroute serve: give --replica (repeatable), --replicas-file or --discover k8s",
            file=sys.stderr,
        )
        return 2
    has = importlib.util.find_spec
    if settings.epp_port is not None and (has("grpc") is None or has("envoy") is None):
        print(
            "kvroute serve: --epp-port needs grpcio and xds-protos (pip install xds-protos)",
            file=sys.stderr,
        )
        return 2
    if settings.k8s_discovery is not None:
        from kvroute.router.fleet.discovery.k8s import load_kube_config

        try:  # a missing config is the operator's to fix: say so before starting
            load_kube_config(settings.k8s_discovery.kubeconfig)
        except ConfigError as exc:
            print(f"kvroute serve: {exc}", file=sys.stderr)
            return 2
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        workers=1,  # the index and the in-flight counts live in this process
        loop="uvloop" if has("uvloop") else "asyncio",
        http=header_deadline_protocol(settings.header_timeout_s),
        log_level=args.log_level,
        access_log=args.access_log,
        timeout_graceful_shutdown=5,
    )
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="kvroute serve", description=__doc__)
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
