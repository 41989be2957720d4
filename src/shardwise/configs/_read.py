# Reading config sources and checking their values, with errors that name file, key and value.
"""Shared helpers of the config readers."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from shardwise.errors import ConfigError

log = logging.getLogger("shardwise.configs")


class Source:
    """A config mapping, where it came from, and the notices its reader gave."""

    def __init__(self, data: Mapping[str, Any], origin: str, base: Path | None = None) -> None:
        self.data, self.origin, self.base = dict(data), origin, base
        self.notices: list[str] = []

    def fail(self, key: str, value: Any, accepted: str) -> ConfigError:
        return ConfigError(f"{self.origin}: {key}={_short(value)} is not accepted; accepted: "
                           f"{accepted}")

    def notice(self, key: str, why: str) -> None:
        line = f"{self.origin}: {key} {why}"
        self.notices.append(line)
        log.warning(line)

    def check_keys(self, data: Mapping[str, Any], known: Iterable[str], where: str = "") -> None:
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"{self.origin}: unknown key(s) {unknown}{where}; accepted: "
                              f"{sorted(known)}")

    def boolean(self, key: str, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise self.fail(key, value, "true or false")

    def integer(self, key: str, value: Any, low: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise self.fail(key, value, f"an integer >= {low}")
        try:
            number = int(value)
        except ValueError:
            raise self.fail(key, value, f"an integer >= {low}") from None
        if number < low:
            raise self.fail(key, value, f"an integer >= {low}")
        return number

    def choice(self, key: str, value: Any, options: Iterable[str]) -> str:
        text = str(value).upper() if isinstance(value, str) else value
        options = list(options)
        if text not in options:
            raise self.fail(key, value, ", ".join(options))
        return str(text)


_MAX_BYTES = 4 * 2**20  # a config is a few kilobytes; this bounds a hostile one
_MAX_DEPTH = 16


class _Refused(ValueError):
    """Why a file's content is refused (turned into a ConfigError naming the file)."""


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"the key {key!r} appears twice (with {_short(out[key])} and "
                           f"{_short(value)}); keep one")
        out[key] = value
    return out


class _StrictLoader(yaml.SafeLoader):
    """YAML without aliases (no expansion bombs) and without repeated keys."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            anchor = self.peek_event().anchor
            raise _Refused(f"it uses the YAML alias *{anchor}; aliases are not accepted in "
                           "config files, write the value out")
        return super().compose_node(parent, index)


def _mapping(loader: _StrictLoader, node: Any, deep: bool = False) -> dict[Any, Any]:
    pairs = [(loader.construct_object(k, deep=deep), loader.construct_object(v, deep=deep))
             for k, v in node.value]
    return _unique_pairs(pairs)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _depth(value: Any, level: int = 0) -> int:
    if level > _MAX_DEPTH:
        return level
    children = value.values() if isinstance(value, Mapping) else \
        value if isinstance(value, list) else ()
    return max((_depth(v, level + 1) for v in children), default=level)


def load_source(source: str | Path | Mapping[str, Any]) -> Source:
    """Read a path (YAML or JSON) or take a mapping, within limits: at most 4 MiB, UTF-8,
    nested at most 16 deep, no repeated keys, no YAML aliases."""
    if isinstance(source, Mapping):
        return Source(source, "<mapping>")
    path = Path(source)
    kind = "JSON" if path.suffix == ".json" else "YAML"
    try:
        if path.stat().st_size > _MAX_BYTES:
            raise ConfigError(f"{path} is {path.stat().st_size} bytes; a config file may hold "
                              f"at most {_MAX_BYTES} bytes")
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    try:
        data = (json.loads(text, object_pairs_hook=_unique_pairs) if kind == "JSON"
                else yaml.load(text, Loader=_StrictLoader))  # noqa: S506 (a safe loader)
    except _Refused as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except (ValueError, yaml.YAMLError, RecursionError) as exc:
        raise ConfigError(f"{path} is not valid {kind}: {_short(str(exc))}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path} must hold a mapping of keys to values (got "
                          f"{type(data).__name__})")
    if _depth(data) > _MAX_DEPTH:
        raise ConfigError(f"{path} is nested more than {_MAX_DEPTH} levels deep")
    return Source(data, str(path), path.parent)
