"""Command-line flags made from the settings declarations (services/common/settings.py).

Every field declared with `setting(...)` becomes a flag whose value comes from the command line, else its
environment variable, else the declared default; pydantic parses and checks it. A bad value from either
source becomes one `SettingsError` line naming the flag or the variable. `--help` shows each flag's
variable and default, and never reads the environment, so a bad variable cannot break it.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, is_dataclass
from typing import Any

from pydantic import ValidationError
from pydantic.fields import FieldInfo


class SettingsError(ValueError):
    """A bad flag or environment value, as one line for a person."""


@dataclass(frozen=True)
class Group:
    """One settings object a command builds: its class, and the dotted field paths it leaves unexposed."""

    cls: type
    skip: frozenset[str] = frozenset()


@dataclass
class _Flag:
    flag: str
    env: str
    info: FieldInfo
    targets: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)   # (group key, field path)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def boolean(self) -> bool:
        return self.info.annotation is bool


def _settings_fields(cls: type, skip: frozenset[str], prefix: tuple[str, ...] = ()
                     ) -> Iterator[tuple[tuple[str, ...], FieldInfo]]:
    for name, info in cls.__pydantic_fields__.items():
        path = (*prefix, name)
        if ".".join(path) in skip:
            continue
        if isinstance(info.annotation, type) and is_dataclass(info.annotation):
            yield from _settings_fields(info.annotation, skip, path)
        elif (info.json_schema_extra or {}).get("env"):
            yield path, info


def _flags(groups: Mapping[str, Group]) -> dict[str, _Flag]:
    """Flag name -> flag; a field that several groups share (the store in `serve`) is one flag."""
    flags: dict[str, _Flag] = {}
    for key, group in groups.items():
        for path, info in _settings_fields(group.cls, group.skip):
            extra = info.json_schema_extra
            name = extra.get("flag") or "--" + path[-1].replace("_", "-")
            known = flags.setdefault(name, _Flag(name, extra["env"], info))
            if (known.env, known.info.get_default(call_default_factory=True)) != \
                    (extra["env"], info.get_default(call_default_factory=True)):
                raise TypeError(f"{name} means two different settings in one command")
            known.targets.append((key, path))
    return flags


def _members(annotation: Any) -> tuple[Any, ...]:
    """The types a union is made of (the annotation itself when it is not a union)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return typing.get_args(annotation)
    return (annotation,)


def _choices(annotation: Any) -> tuple[str, ...]:
    for member in _members(annotation):
        if typing.get_origin(member) is tuple:
            member = typing.get_args(member)[0]
        if typing.get_origin(member) is typing.Literal:
            return typing.get_args(member)
    return ()


def _shown_default(info: FieldInfo) -> str:
    extra = info.json_schema_extra
    if "shown" in extra:
        return extra["shown"]
    value = info.get_default(call_default_factory=True)
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def _help(flag: _Flag) -> str:
    choices = _choices(flag.info.annotation)
    text = flag.info.description + (f" ({' | '.join(choices)})" if choices else "")
    return f"{text} [{flag.env}; default: {_shown_default(flag.info)}]".replace("%", "%%")


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, groups: Mapping[str, Group]) -> None:
    """One flag per exposed setting. Flags default to "not given", so the environment can fill them in."""
    for flag in _flags(groups).values():
        if flag.boolean:
            parser.add_argument(flag.flag, dest=flag.dest, action="store_const", const="true",
                                default=argparse.SUPPRESS, help=_help(flag))
        else:
            parser.add_argument(flag.flag, dest=flag.dest, default=argparse.SUPPRESS, help=_help(flag),
                                metavar=flag.dest.upper())


def _raw(flag: _Flag, args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(where it came from, the text given), or None when neither the flag nor its variable is set."""
    if hasattr(args, flag.dest):
        value = getattr(args, flag.dest)
        return (flag.flag if flag.boolean else f"{flag.flag} {value!r}"), value
    if flag.env in environ:
        return f"{flag.env}={environ[flag.env]!r}", environ[flag.env]
    return None


def _value(text: str, info: FieldInfo) -> Any:
    """The text as pydantic's input: lists split at commas; "" is None where None is allowed."""
    members = _members(info.annotation)
    if text == "" and type(None) in members:
        return None
    if any(typing.get_origin(m) is tuple for m in members):
        return [part.strip() for part in text.split(",") if part.strip()]
    return text


def _nest(values: dict, path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        values = values.setdefault(part, {})
    values[path[-1]] = value


def _one_line(error: ValidationError, sources: dict[tuple[str, ...], str]) -> str:
    lines = []
    for e in error.errors():
        loc = tuple(str(p) for p in e["loc"])
        source = next((sources[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in sources), None)
        message = e["msg"].removeprefix("Value error, ")
        lines.append(f"{source}: {message}" if source else message)
    return "; ".join(lines)


def build(groups: Mapping[str, Group], args: argparse.Namespace,
          environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Group key -> its settings object, from the parsed flags and the environment."""
    environ = os.environ if environ is None else environ
    given: dict[str, dict] = {key: {} for key in groups}
    sources: dict[str, dict[tuple[str, ...], str]] = {key: {} for key in groups}
    for flag in _flags(groups).values():
        raw = _raw(flag, args, environ)
        if raw is None:
            continue
        source, text = raw
        for key, path in flag.targets:
            _nest(given[key], path, _value(text, flag.info))
            sources[key][path] = source
    built = {}
    for key, group in groups.items():
        try:
            built[key] = group.cls(**given[key])
        except ValidationError as e:
            raise SettingsError(_one_line(e, sources[key])) from None
    return built
