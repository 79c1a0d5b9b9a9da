"""``kvroute up``: start a local fleet (``LocalFleet``) and keep it running until Ctrl-C.

The fleet itself is deploy/local_fleet.py, its settings and shared flags deploy/fleet_config.py.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from types import FrameType

from kvroute.deploy.fleet_config import (
    POLICIES,
    add_fleet_arguments,
    add_key_arguments,
    config_from_args,
)
from kvroute.deploy.local_fleet import FleetError, LocalFleet

__all__ = ["add_arguments", "main", "print_fleet"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_fleet_arguments(parser)
    add_key_arguments(parser)
    parser.add_argument("--policy", choices=POLICIES, default="kvroute", help="routing policy")
    parser.add_argument("--port", type=int, default=8000, help="router port (0: a free one)")
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument passed to `kvroute serve` (repeatable)",
    )


class _Terminated(Exception):
    """SIGINT/SIGTERM turned into an exception so the fleet's teardown runs."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    # Later signals are ignored: a second Ctrl-C must not cut the teardown short and
    # leave replicas behind (the teardown itself is bounded by SIGKILL timeouts).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Terminated(signal.Signals(signum).name)


def print_fleet(fleet: LocalFleet) -> None:
    info = fleet.describe()
    roles = {e.name: e.role for e in fleet.endpoints()}
    print(f"kvroute fleet ready ({info['engine']}, model {info['served_model_name']})")
    for name, r in info["routers"].items():
        print(f"  {name:<12} {r['url']}  (policy {r['policy']}, OpenAI API at {r['url']}/v1)")
        print(f"  {'':<12} {r['url']}/index/stats   {r['url']}/metrics")
    for r in info["replicas"]:
        role = roles.get(r["name"], "both")
        shown = "" if role == "both" else f"  ({role})"
        print(f"  {r['name']:<12} {r['url']}  events {r['events']}{shown}")
    print(f"  state        {info['state_dir']} (fleet.json, logs/)")
    print("Ctrl-C stops everything.", flush=True)


def main(args: argparse.Namespace) -> int:
    previous = {
        sig: signal.signal(sig, _raise_terminated) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        config = config_from_args(
            args, policy=args.policy, port=args.port, router_args=list(args.router_arg)
        )
        config.validate()  # --prefill/--decode set the replica count
        print(
            f"starting {config.replicas} {config.engine} replica(s) and the router...", flush=True
        )
        with LocalFleet(config) as fleet:
            print_fleet(fleet)
            while True:
                dead = list(fleet.check_processes())
                if dead:
                    print(
                        f"kvroute up: {', '.join(dead)} exited; stopping the fleet", file=sys.stderr
                    )
                    return 1
                time.sleep(1.0)
    except (KeyboardInterrupt, _Terminated):
        print("\nkvroute up: stopped", flush=True)
        return 0
    except (FleetError, ValueError) as exc:
        print(f"kvroute up: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
