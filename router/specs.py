"""The text forms of the fleet's parts, parsed into config objects: ``--replica`` and replicas-file
entries (``ReplicaConfig``), ``--storage-domain`` (``StorageDomainConfig``) and
``--model-tokenizer`` (``ModelTokenizerConfig``). Each refuses a bad spelling with a
``ConfigError`` that quotes it; a replicas file is read whole or not at all.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from kvroute.router.config import (
    ConfigError,
    ModelTokenizerConfig,
    ReplicaConfig,
    StorageDomainConfig,
)

__all__ = [
    "load_replicas_file",
    "parse_model_tokenizer_flag",
    "parse_replica",
    "parse_replica_flag",
    "parse_replicas_text",
    "parse_storage_domain_flag",
    "read_replicas_file",
]


def parse_storage_domain_flag(value: str) -> StorageDomainConfig:
    """``NAME=tcp://h:5600[,replay=tcp://h:5601][,topic=T]`` -> StorageDomainConfig."""
    head, *options = [part.strip() for part in value.split(",")]
    name, sep, events = head.partition("=")
    if not sep or not name or not events:
        raise ConfigError(
            f"--storage-domain wants NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT]: {value!r}"
        )
    fields: dict[str, str] = {}
    for option in options:
        if not option:
            continue
        key, sep, val = option.partition("=")
        if not sep or key not in ("replay", "topic"):
            raise ConfigError(f"bad --storage-domain option {option!r}: use replay=, topic=")
        fields[key] = val
    return StorageDomainConfig(name=name, events=events, **fields)


def _parse_dp(value: object) -> int | str | None:
    """``dp``: a rank count (``2``, ``"2"``) or ``"auto"``; anything else is refused."""
    if value is None or value == "auto":
        return value  # type: ignore[return-value]
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConfigError(f"replica dp must be an integer >= 1 or 'auto', got {value!r}")


def parse_replica_flag(value: str) -> ReplicaConfig:
    """``http://h:p,events=tcp://h:5557,replay=tcp://h:5558,topic=kv,name=r1[,dp=2]
    [,role=prefill|decode|both][,zone=Z][,speculative=METHOD]``."""
    url, *options = [part.strip() for part in value.split(",")]
    fields: dict[str, str] = {}
    aux: list[str] = []
    for option in options:
        if not option:
            continue
        name, sep, val = option.partition("=")
        if not sep or name not in (
            "events",
            "replay",
            "topic",
            "name",
            "aux",
            "dp",
            "storage_domain",
            "layout",
            "lmcache_instance",
            "role",
            "zone",
            "speculative",
        ):
            raise ConfigError(
                f"bad replica option {option!r} in {value!r}: use events=, replay=, topic=, "
                "name=, aux=, dp=, storage_domain=, layout=, lmcache_instance=, role=, zone=, "
                "speculative="
            )
        if name == "aux":
            aux.append(val)
        else:
            fields[name] = val
    dp = _parse_dp(fields.pop("dp", None))
    return ReplicaConfig(url=url, aux=tuple(aux), dp=dp, **fields)


def parse_model_tokenizer_flag(value: str) -> tuple[str, ModelTokenizerConfig]:
    """``MODEL=PATH[,chat_template=FILE][,content_format=F]`` -> (model, config)."""
    head, *options = [part.strip() for part in value.split(",")]
    model, sep, path = head.partition("=")
    if not sep or not model or not path:
        raise ConfigError(f"--model-tokenizer wants MODEL=PATH[,chat_template=FILE]: {value!r}")
    fields: dict[str, str] = {}
    for option in options:
        name, sep, val = option.partition("=")
        if not sep or name not in ("chat_template", "content_format"):
            raise ConfigError(
                f"bad --model-tokenizer option {option!r}: use chat_template=, content_format="
            )
        fields[name] = val
    return model, ModelTokenizerConfig(path, **fields)


def parse_replica(item: object) -> ReplicaConfig:
    """One entry of a replicas file: a URL string or a mapping of ReplicaConfig's fields."""
    if isinstance(item, str):
        return parse_replica_flag(item)
    if not isinstance(item, dict):
        raise ConfigError(f"replica entry must be a URL or a mapping, got {item!r}")
    unknown = set(item) - {
        "url",
        "events",
        "replay",
        "topic",
        "name",
        "aux",
        "dp",
        "storage_domain",
        "layout",
        "lmcache_instance",
        "role",
        "zone",
        "speculative",
    }
    if unknown:
        raise ConfigError(f"unknown replica fields {sorted(unknown)} in {item!r}")
    if not isinstance(item.get("url"), str):
        raise ConfigError(f"replica entry needs a url: {item!r}")
    for key in (
        "events",
        "replay",
        "topic",
        "name",
        "storage_domain",
        "layout",
        "lmcache_instance",
        "role",
        "zone",
        "speculative",
    ):
        if item.get(key) is not None and not isinstance(item[key], str):
            raise ConfigError(f"replica field {key!r} must be a string in {item!r}")
    aux = item.get("aux") or []
    if isinstance(aux, str):
        aux = [aux]
    if not isinstance(aux, list) or not all(isinstance(a, str) and a for a in aux):
        raise ConfigError(f"replica field 'aux' must be a list of endpoints in {item!r}")
    return ReplicaConfig(
        url=item["url"],
        events=item.get("events"),
        replay=item.get("replay"),
        topic=item.get("topic") or "",
        name=item.get("name"),
        aux=tuple(aux),
        dp=_parse_dp(item.get("dp")),
        storage_domain=item.get("storage_domain"),
        layout=item.get("layout"),
        lmcache_instance=item.get("lmcache_instance"),
        role=item.get("role") or "both",
        zone=item.get("zone") or None,
        speculative=item.get("speculative") or None,
    )


def load_replicas_file(path: str | Path) -> list[ReplicaConfig]:
    """Parse a replicas file; raises ConfigError (never a half-read list) when it is invalid."""
    return parse_replicas_text(read_replicas_file(path), path)


def read_replicas_file(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read replicas file {path}: {exc}") from exc


def parse_replicas_text(text: str, path: str | Path) -> list[ReplicaConfig]:
    """The replicas in a replicas file's ``text`` (``path`` names it in errors)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot read replicas file {path}: {exc}") from exc
    if data is None:
        return []
    if isinstance(data, dict):
        data = data.get("replicas") or []
    if not isinstance(data, list):
        raise ConfigError(f"replicas file {path} must hold a list under 'replicas'")
    replicas = [parse_replica(item) for item in data]
    names = [r.key for r in replicas]
    if len(names) != len(set(names)):
        raise ConfigError(f"replica names in {path} must be unique: {names}")
    return replicas
