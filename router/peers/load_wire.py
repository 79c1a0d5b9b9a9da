"""The ``GET /peer/load`` answer on the wire: building one (``load_body``, ``load_version``)
and checking a peer's (``parse_load``). A forged or broken answer is refused whole
(``PeerLoadError``), never applied in part: every count, sample, home and free is checked
against the bounds below. What the fields mean and how a router follows its peers:
router/peers/load.py.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvroute.router.fleet.replicas import Replica

__all__ = [
    "KV_FREES_SENT",
    "MAX_FREES",
    "MAX_REPLICAS",
    "MAX_SAMPLES",
    "PeerAnswer",
    "PeerLoadError",
    "load_body",
    "load_version",
    "parse_load",
]

# Bounds on what one peer may report: a forged or broken answer cannot make a replica look
# busier than this many requests per peer, nor name more replicas than a fleet has.
MAX_IN_FLIGHT = 1_000_000
MAX_UNSTORED_BLOCKS = 1_000_000_000
MAX_REPLICAS = 100_000
MAX_SAMPLES = 4096  # queue samples in one answer (a peer keeps far fewer: SAMPLE_LOG_MAX)
MAX_FREES = 64  # entries of one replica's ``kv_frees`` (a router sends at most KV_FREES_SENT)
KV_FREES_SENT = 16
MAX_FREE_S = 3600.0  # how far ahead a ``kv_frees`` entry may be
_MAX_VERSION_CHARS = 64
_MAX_AFFINITY_HEX = 128  # a home's affinity: a block key's bytes, or a short prompt's


class PeerLoadError(ValueError):
    """Why a peer's answer was not used."""


def load_version(replicas: Iterable[Replica], next_sample: int = 0) -> str:
    """A digest of the in-flight counts and of the number of queue samples taken: it changes
    whenever a count does, a replica comes or goes, or a sample is taken. Unstored blocks
    are not in it: they change with the requests sent, and settle on the next answer."""
    counts = ",".join(f"{r.name}={r.in_flight}" for r in replicas)
    return hashlib.blake2b(f"{counts};{next_sample}".encode(), digest_size=8).hexdigest()


def load_body(
    router_id: str,
    replicas: Iterable[Replica],
    unstored: Mapping[str, int] | None = None,
    *,
    next_sample: int = 0,
    samples: list[tuple[str, float | None, tuple[float, ...] | bytes | None]] | None = None,
    kv_held: Mapping[str, int] | None = None,
    kv_frees: Mapping[str, list[tuple[int, float]]] | None = None,
) -> dict[str, Any]:
    """This router's ``GET /peer/load`` answer: ``samples`` are its samples from the
    asker's ``samples_from`` up to ``next_sample`` (None: the asker gave none): queue samples
    in ``values``, samples of the replicas' rates (router/routing/calibration.py) in
    ``rates_q`` (with the queue delay priced for the request; an older router's samples,
    without it and net of that delay, in ``rates``). A router that does not know a key
    ignores it."""
    replicas = list(replicas)
    body: dict[str, Any] = {
        "router": router_id,
        "version": load_version(replicas, next_sample),
        "replicas": {r.name: r.in_flight for r in replicas},
        "samples": {
            "next": next_sample,
            "values": [[name, round(v, 6)] for name, v, _ in samples or () if v is not None],
        },
    }
    rates = [[name, *r] for name, _, r in samples or () if isinstance(r, tuple)]
    for key, size in (("rates", 6), ("rates_q", 7)):
        if rows := [row for row in rates if len(row) == size]:
            body["samples"][key] = rows
    if homes := [[name, r.hex()] for name, _, r in samples or () if isinstance(r, bytes)]:
        body["samples"]["homes"] = homes
    if unstored is not None:
        body["unstored_blocks"] = {name: n for name, n in unstored.items() if n}
    if kv_held is not None:
        body["kv_held_blocks"] = {name: n for name, n in kv_held.items() if n}
    if kv_frees is not None:
        body["kv_frees"] = {
            name: [[n, round(s, 4)] for n, s in frees] for name, frees in kv_frees.items() if frees
        }
    return body


@dataclass(frozen=True, slots=True)
class PeerAnswer:
    """A peer's ``GET /peer/load`` answer, checked."""

    router: str
    in_flight: dict[str, int]
    unstored_blocks: dict[str, int] = field(default_factory=dict)
    version: str | None = None  # None: a peer that cannot hold a request (poll it)
    # Its queue samples: the number of the next one, and those asked for (None: an older
    # router that shares none).
    next_sample: int | None = None
    samples: list[tuple[str, float]] = field(default_factory=list)
    # Its samples of the replicas' rates: (replica, (uncached, cpu, storage, seconds, weight[,
    # queue_s])), as router/routing/calibration.py's CalibrationSample takes them
    rate_samples: list[tuple[str, tuple[float, ...]]] = field(default_factory=list)
    # The device blocks its requests hold on each replica (router/routing/kv_room.py), and
    # when they should free them: [(blocks, seconds from its answer)], soonest first
    kv_held_blocks: dict[str, int] = field(default_factory=dict)
    kv_frees: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # The homes it gave new prefixes: (replica, affinity), router/routing/router.py
    homes: list[tuple[str, bytes]] = field(default_factory=list)


def _counts(value: object, what: str, limit: int) -> dict[str, int]:
    if not isinstance(value, dict):
        raise PeerLoadError(f"'{what}' is not an object")
    if len(value) > MAX_REPLICAS:
        raise PeerLoadError(f"more than {MAX_REPLICAS} replicas")
    out: dict[str, int] = {}
    for name, n in value.items():
        if isinstance(n, bool) or not isinstance(n, int | float) or not math.isfinite(n):
            raise PeerLoadError(f"replica {name!r}: {what} count is not a number")
        if n < 0 or n > limit:
            raise PeerLoadError(f"replica {name!r}: {what} count {n} out of range")
        out[str(name)] = int(n)
    return out


def parse_load(body: object) -> PeerAnswer:
    """A peer's answer; PeerLoadError if it is not one."""
    if not isinstance(body, dict):
        raise PeerLoadError("not a JSON object")
    router, replicas = body.get("router"), body.get("replicas")
    if not isinstance(router, str) or not router or not isinstance(replicas, dict):
        raise PeerLoadError("needs 'router' (a string) and 'replicas' (an object)")
    unstored = body.get("unstored_blocks")
    version = body.get("version")
    if version is not None and (
        not isinstance(version, str) or not 0 < len(version) <= _MAX_VERSION_CHARS
    ):
        raise PeerLoadError(f"'version' must be a string of 1-{_MAX_VERSION_CHARS} characters")
    next_sample, samples = _samples(body.get("samples"))
    rate_samples = _rate_samples(body.get("samples"))
    held = body.get("kv_held_blocks")
    return PeerAnswer(
        router,
        _counts(replicas, "in-flight", MAX_IN_FLIGHT),
        {} if unstored is None else _counts(unstored, "unstored_blocks", MAX_UNSTORED_BLOCKS),
        version,
        next_sample,
        samples,
        rate_samples,
        {} if held is None else _counts(held, "kv_held_blocks", MAX_UNSTORED_BLOCKS),
        _frees(body.get("kv_frees")),
        _homes(body.get("samples")),
    )


def _sample_rows(samples: object, key: str) -> list[Any]:
    """``samples[key]``: a list of at most ``MAX_SAMPLES`` rows (none when absent)."""
    rows = samples.get(key, []) if isinstance(samples, dict) else []
    if not isinstance(rows, list) or len(rows) > MAX_SAMPLES:
        raise PeerLoadError(f"'samples.{key}' must be a list of at most {MAX_SAMPLES}")
    return rows


def _homes(value: object) -> list[tuple[str, bytes]]:
    """``samples.homes``: at most ``MAX_SAMPLES`` ``[replica, affinity as hex]`` pairs."""
    out: list[tuple[str, bytes]] = []
    for row in _sample_rows(value, "homes"):
        if (
            not isinstance(row, list)
            or len(row) != 2
            or not isinstance(row[0], str)
            or not isinstance(row[1], str)
            or not 0 < len(row[1]) <= _MAX_AFFINITY_HEX
        ):
            raise PeerLoadError("a home must be [replica, affinity as hex]")
        try:
            out.append((row[0], bytes.fromhex(row[1])))
        except ValueError:
            raise PeerLoadError("a home's affinity is not hex") from None
    return out


def _frees(value: object) -> dict[str, list[tuple[int, float]]]:
    """``kv_frees``: per replica, at most ``MAX_FREES`` ``[blocks, seconds]`` pairs."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_REPLICAS:
        raise PeerLoadError(f"'kv_frees' must be an object of at most {MAX_REPLICAS} replicas")
    out: dict[str, list[tuple[int, float]]] = {}
    for name, rows in value.items():
        if not isinstance(rows, list) or len(rows) > MAX_FREES:
            raise PeerLoadError(f"replica {name!r}: 'kv_frees' must be a list of {MAX_FREES}")
        frees: list[tuple[int, float]] = []
        for row in rows:
            if (
                not isinstance(row, list)
                or len(row) != 2
                or any(isinstance(v, bool) or not isinstance(v, int | float) for v in row)
                or not all(math.isfinite(v) for v in row)
                or not 0 <= row[0] <= MAX_UNSTORED_BLOCKS
                or not 0 <= row[1] <= MAX_FREE_S
            ):
                raise PeerLoadError(
                    f"replica {name!r}: a 'kv_frees' entry must be [blocks, seconds] in range"
                )
            frees.append((int(row[0]), float(row[1])))
        out[str(name)] = sorted(frees, key=lambda f: f[1])
    return out


def _rate_samples(value: object) -> list[tuple[str, tuple[float, ...]]]:
    out: list[tuple[str, tuple[float, ...]]] = []
    for key, size in (("rates", 6), ("rates_q", 7)):
        for row in _sample_rows(value, key):
            if (
                not isinstance(row, list)
                or len(row) != size
                or not isinstance(row[0], str)
                or not all(
                    isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                    for v in row[1:]
                )
                or min(row[1:4]) < 0
                or not 0 < row[5] <= 1
                or (size == 7 and row[6] < 0)
            ):
                raise PeerLoadError(
                    "a rate sample must be [replica, uncached, cpu, storage, seconds, weight]"
                    " (in 'rates_q', then the priced queue delay)"
                )
            out.append((row[0], tuple(float(v) for v in row[1:])))
    return out


def _samples(value: object) -> tuple[int | None, list[tuple[str, float]]]:
    if value is None:
        return None, []
    if not isinstance(value, dict):
        raise PeerLoadError("'samples' is not an object")
    next_sample = value.get("next")
    if isinstance(next_sample, bool) or not isinstance(next_sample, int) or next_sample < 0:
        raise PeerLoadError("'samples.next' must be an integer >= 0")
    out: list[tuple[str, float]] = []
    for item in _sample_rows(value, "values"):
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], str)
            or isinstance(item[1], bool)
            or not isinstance(item[1], int | float)
            or not math.isfinite(item[1])
            or item[1] < 0
        ):
            raise PeerLoadError("a queue sample must be [replica, seconds >= 0]")
        out.append((item[0], float(item[1])))
    return next_sample, out
