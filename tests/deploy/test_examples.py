"""The examples in deploy/examples stay true: their replica lists load in the router, and
the JSON they hand to vLLM parses and is accepted by the connector's config. (The Kubernetes
manifests are in deploy/kubernetes: tests/deploy/test_kubernetes_manifests.py.)"""

from __future__ import annotations

import json
import re

from kvroute.connector.config import ConnectorConfig
from kvroute.deploy.vllm_server import CONNECTOR_CLASS, CONNECTOR_MODULE
from kvroute.router.specs import load_replicas_file
from tests.paths import REPO_ROOT

EXAMPLES = REPO_ROOT / "deploy" / "examples"
EVENTS_KEYS = {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "topic"}


def check_vllm_configs(events: dict, transfer: dict) -> None:
    assert set(events) <= EVENTS_KEYS
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    assert "*" in events["endpoint"] and "*" in events["replay_endpoint"]  # vLLM binds
    assert transfer["kv_connector"] == CONNECTOR_CLASS
    assert transfer["kv_connector_module_path"] == CONNECTOR_MODULE
    assert transfer["kv_role"] == "kv_both"
    assert transfer["kv_load_failure_policy"] == "recompute"
    ConnectorConfig.from_extra_config(transfer["kv_connector_extra_config"])  # no typo'd key


def test_replicas_file_loads_in_the_router() -> None:
    replicas = load_replicas_file(EXAMPLES / "replicas.yaml")
    assert [r.key for r in replicas] == ["vllm-0", "vllm-1"]
    assert all(r.events and r.replay and r.topic for r in replicas)


def test_systemd_replica_unit_flags_parse() -> None:
    text = (EXAMPLES / "systemd" / "kvroute-vllm@.service").read_text()
    # Instance 3 as systemd would expand it.
    configs = re.findall(r"'(\{.*?\})'", text.replace("%i", "3"))
    events, transfer = (json.loads(c) for c in configs)
    assert events["endpoint"] == "tcp://*:5553"
    assert events["replay_endpoint"] == "tcp://*:5563"
    assert transfer["kv_connector_extra_config"]["disk_dir"] == "/var/cache/kvroute/3"
    check_vllm_configs(events, transfer)
    assert "--enable-prefix-caching" in text and "--enable-prompt-tokens-details" in text


def test_systemd_router_unit_uses_real_serve_flags() -> None:
    import argparse

    from kvroute.router.cli import add_arguments

    text = (EXAMPLES / "systemd" / "kvroute-router.service").read_text()
    line = re.search(r"ExecStart=\S+ serve (.*?)\n(?=\S)", text, re.S)
    assert line is not None
    argv = line.group(1).replace("\\\n", " ").replace("${MODEL}", "/models/m").split()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    assert args.replicas_file == "/etc/kvroute/replicas.yaml"
