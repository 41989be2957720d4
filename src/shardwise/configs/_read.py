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
        return ConfigError(f"{self.origin}: {key}={value!r} is not accepted; accepted: {accepted}")

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


def load_source(source: str | Path | Mapping[str, Any]) -> Source:
    """Read a path (YAML or JSON) or take a mapping."""
    if isinstance(source, Mapping):
        return Source(source, "<mapping>")
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}:"
                          f" {exc}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path} must hold a mapping of keys to values (got "
                          f"{type(data).__name__})")
    return Source(data, str(path), path.parent)
