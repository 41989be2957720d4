# Reading config files and mappings, checking their values, with errors naming file, key and value.
"""Shared helpers of the config readers.

Every value a reader takes from a config goes through a :class:`Source` method that checks
its type and range, so a wrong shape is a :class:`~shardwise.errors.ConfigError` naming the
file, the key (a dotted path), a short excerpt of the value and what is accepted.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from shardwise._text import short as _short
from shardwise.env import launch_rank
from shardwise.errors import ArgumentError, ConfigError

log = logging.getLogger("shardwise.configs")

T = TypeVar("T")
Shape = Literal["bool", "size", "count", "text", "mapping"]

#: The largest integer a config may hold (anything larger is a typo, and would not print).
MAX_INT = 2**63 - 1


def say(notices: Iterable[str]) -> None:
    """Log ``notices`` once (from the first rank of a launch): what a reading kept."""
    for line in notices if launch_rank() == 0 else ():
        log.warning(line)


class Source:
    """A config mapping, where it came from, and the notices its reader gave."""

    def __init__(self, data: Mapping[str, Any], origin: str, base: Path | None = None, *,
                 written: Mapping[str, str] | None = None) -> None:
        self.data, self.origin, self.base = dict(data), origin, base
        self.written = dict(written or {})
        self.notices: list[str] = []
        self.logs = True  # False: the caller logs the notices it keeps (say)

    def key(self, path: str) -> str:
        """How the setting at dotted ``path`` was written where it came from: the path
        itself, or what gave it (``accelerate launch``'s variable for a key it was read
        into, carried in ``written``), so every message names what the user wrote."""
        return self.written.get(path, path)

    def fail(self, key: str, value: Any, accepted: str) -> ConfigError:
        """The error for ``key=value``, naming what is accepted."""
        return ConfigError.at(self.origin, f"{self.key(key)}={short(value)} is not accepted; "
                              f"accepted: {accepted}")

    def notice(self, key: str, why: str, origin: str | None = None) -> None:
        """Log (and keep, for ``explain()``) one line about ``key`` (of the file ``origin``,
        by default this one)."""
        line = f"{origin or self.origin}: {self.key(key)} {why}"
        self.notices.append(line)
        if self.logs and launch_rank() == 0:  # every rank reads the config: one says so
            log.warning(line)

    def check_keys(self, data: Mapping[str, Any], known: Iterable[str], where: str = "") -> None:
        """Refuse keys of ``data`` (the block at dotted path ``where``) not in ``known``."""
        unknown = sorted(set(data) - set(known))
        if unknown:
            shown = ", ".join(short(k) for k in unknown[:5]) + (", ..." if unknown[5:] else "")
            place = f" in {where}" if where else ""
            raise ConfigError.at(self.origin, f"unknown key(s) [{shown}]{place}; accepted: "
                              f"{sorted(known)}")

    def mapping(self, key: str, value: Any,
                accepted: str = "a mapping of keys to values") -> dict[str, Any]:
        """A block: a mapping (absent or null is an empty one)."""
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise self.fail(key, value, accepted)
        return dict(value)

    def boolean(self, key: str, value: Any) -> bool:
        """True or false (also as the strings ``"true"``/``"false"``)."""
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise self.fail(key, value, "true or false")

    def integer(self, key: str, value: Any, low: int = 0, high: int = MAX_INT) -> int:
        """An integer in ``[low, high]`` (also written as a string, or a float like 2.0)."""
        accepted = f"an integer >= {low}" if high == MAX_INT else f"an integer from {low} to {high}"
        number: int | None = None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, float) and value.is_integer():
            number = int(value)
        elif isinstance(value, str) and len(value) < 30:
            try:
                number = int(value)
            except ValueError:
                pass
        if number is None or not low <= number <= high:
            raise self.fail(key, value, accepted)
        return number

    def number(self, key: str, value: Any, low: float = 0.0) -> float:
        """A finite number ``>= low`` (NaN, infinities and strings are refused)."""
        finite = isinstance(value, (int, float)) and not isinstance(value, bool) and \
            abs(value) <= 1e300 and math.isfinite(value)
        if not finite or value < low:
            raise self.fail(key, value, f"a finite number >= {low:g}")
        return float(value)

    def text(self, key: str, value: Any) -> str:
        """A non-empty string of at most 4096 characters."""
        if not isinstance(value, str) or not value.strip() or len(value) > 4096 or "\0" in value:
            raise self.fail(key, value, "a non-empty string")
        return value

    def choice(self, key: str, value: Any, options: Iterable[str]) -> str:
        """One of ``options`` (upper case; a string given in any case)."""
        options = list(options)
        text = value.upper() if isinstance(value, str) else None
        if text not in options:
            raise self.fail(key, value, ", ".join(options))
        return str(text)

    def check_shape(self, key: str, value: Any, shape: Shape) -> None:
        """Check the shape of a value that is not applied (its key gives a notice): a
        ``"bool"``, a ``"size"`` (a finite number >= 0), a ``"count"`` (an integer >= 1), a
        ``"text"`` (a string, or null) or a ``"mapping"`` (or null)."""
        if shape == "bool":
            self.boolean(key, value)
        elif shape == "size":
            self.number(key, value)
        elif shape == "count":
            self.integer(key, value, 1)
        elif shape == "text" and value is not None:
            self.text(key, value)
        elif shape == "mapping":
            self.mapping(key, value)

    def build(self, key: str, value: Any, factory: Callable[..., T], *args: Any,
              **kwargs: Any) -> T:
        """``factory(*args, **kwargs)``, its refusal of an argument named as ``key=value``."""
        try:
            return factory(*args, **kwargs)
        except ArgumentError as exc:
            raise ConfigError.at(self.origin, f"{key}={short(value)} is not accepted: {exc}") \
                from None


_MAX_BYTES = 4 * 2**20  # a config is a few kilobytes; this bounds a hostile one
_MAX_DEPTH = 16

def short(value: Any) -> str:
    """A short excerpt (at most 60 characters) of ``repr(value)``."""
    return _short(value, 60)


class _Refused(ValueError):
    """Why a file's content is refused (turned into a ConfigError naming the file)."""


def _unique_pairs(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if not isinstance(key, str):
            raise _Refused(f"the key {short(key)} is not a string; config keys are names")
        if key in out:
            raise _Refused(f"the key {short(key)} appears twice (with {short(out[key])} and "
                           f"{short(value)}); keep one")
        out[key] = value
    return out


class _StrictLoader(yaml.SafeLoader):
    """YAML without aliases (no expansion bombs), without repeated keys, with string keys."""

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


def _depth(value: Any, level: int = 0) -> int:
    if level > _MAX_DEPTH:
        return level
    children = value.values() if isinstance(value, Mapping) else \
        value if isinstance(value, (list, tuple, set, frozenset)) else ()
    return max((_depth(v, level + 1) for v in children), default=level)


def _check_names(value: Any, origin: str) -> None:
    """Refuse a mapping (at any depth) with a key that is not a string."""
    if isinstance(value, Mapping):
        for key, child in value.items():
            if not isinstance(key, str):
                raise ConfigError.at(origin, f"the key {short(key)} is not a string; config "
                                  "keys are names")
            _check_names(child, origin)
    elif isinstance(value, (list, tuple)):
        for child in value:
            _check_names(child, origin)


def _checked(data: Any, origin: str) -> Mapping[str, Any]:
    """``data`` if it is a mapping within the depth limit whose keys are strings."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{origin} must hold a mapping of keys to values (got "
                          f"{type(data).__name__})")
    if _depth(data) > _MAX_DEPTH:
        raise ConfigError(f"{origin} is nested more than {_MAX_DEPTH} levels deep")
    _check_names(data, origin)
    return data


def _shown(path: Path) -> str:
    """A path as written, unless it is too long to be a real one (then an excerpt)."""
    text = str(path)
    return text if len(text) <= 1024 else short(text)


def _read_text(path: Path) -> str:
    """The UTF-8 text of a regular file of at most 4 MiB."""
    try:
        if not path.is_file():
            raise ConfigError(f"cannot read config file {_shown(path)}: "
                              + ("not a regular file" if path.exists() else "no such file"))
        with path.open("rb") as file:
            raw = file.read(_MAX_BYTES + 1)
    except ConfigError:
        raise
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        why = getattr(exc, "strerror", None) or short(str(exc))  # never the whole path again
        raise ConfigError(f"cannot read config file {_shown(path)}: {why}") from None
    if len(raw) > _MAX_BYTES:
        raise ConfigError(f"{path} is more than {_MAX_BYTES} bytes; a config file may hold "
                          f"at most {_MAX_BYTES} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") \
            from None


def load_source(source: str | os.PathLike[str] | Mapping[str, Any]) -> Source:
    """Read a path (YAML or JSON) or take a mapping, within limits: at most 4 MiB, UTF-8,
    nested at most 16 deep, string keys, no repeated keys, no YAML aliases."""
    if isinstance(source, Mapping):
        return Source(_checked(source, "<mapping>"), "<mapping>")
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"a config source is a path or a mapping (got "
                          f"{type(source).__name__})")
    path = Path(source)
    kind = "JSON" if path.suffix == ".json" else "YAML"
    text = _read_text(path)
    try:
        data = (json.loads(text, object_pairs_hook=_unique_pairs) if kind == "JSON"
                else yaml.load(text, Loader=_StrictLoader))  # noqa: S506 (a safe loader)
    except _Refused as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except Exception as exc:  # the parsers raise many types for bad input; each means the same
        raise ConfigError(f"{path} is not valid {kind}: {short(str(exc))}") from None
    return Source(_checked(data, str(path)), str(path), path.parent)


def named_source(src: Source, key: str, value: Any) -> Source:
    """The config file ``src`` names at ``key`` (a path relative to ``src``'s folder), read
    like any other.

    Raises:
        ConfigError: naming ``src``'s file and ``key``, and what is wrong with the file.
    """
    path = Path(src.text(key, value))
    if not path.is_absolute() and src.base is not None:
        path = src.base / path
    try:
        return load_source(path)
    except ConfigError as exc:
        raise ConfigError.at(src.origin, f"{key}: {exc}") from None
