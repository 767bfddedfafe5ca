"""The `raincheck` command: serve, frontend, http, decode-worker, deferred-worker, chat, demo.

Each command builds its settings objects (services/common/settings.py) from flags and environment
variables. A bad value ends the command before anything starts, with one line and exit code 2; an error
while running ends it with one line and exit code 1 (`--debug` shows the traceback instead).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable
from typing import Any

from .common.flags import Group, SettingsError, add_flags, build
from .common.ports import check_ports
from .common.settings import (
    ChatSettings,
    DeferredSettings,
    DemoSettings,
    FrontendSettings,
    LogSettings,
    ModelSpec,
    ServeSettings,
    WorkerSettings,
)
from .http.settings import HttpSettings, ServeHttpSettings

# What `serve` does not expose of its decode worker: it listens on loopback next to the frontend, and the
# process-wide flags (metrics, drain) are the frontend's.
_IN_PROCESS_WORKER = frozenset({"host", "port", "advertise", "worker_id", "metrics_port", "metrics_host", "drain_s",
                                "deferred.workers"})


@dataclasses.dataclass(frozen=True)
class Command:
    help: str
    groups: dict[str, Group]


COMMANDS = {
    "serve": Command("frontend + decode worker in one process (the embedded default)",
                     {"frontend": Group(FrontendSettings), "worker": Group(WorkerSettings, _IN_PROCESS_WORKER),
                      "serve": Group(ServeSettings), "http": Group(ServeHttpSettings)}),
    "frontend": Command("the public ChatService (workers found through Redis)", {"frontend": Group(FrontendSettings)}),
    "http": Command("the HTTP API (OpenAI chat completions, SGLang /generate; workers found through Redis)",
                    {"frontend": Group(FrontendSettings, frozenset({"host", "port"})), "http": Group(HttpSettings)}),
    "decode-worker": Command("a decode worker: one Engine, registered in Redis", {"worker": Group(WorkerSettings)}),
    "deferred-worker": Command("keep N named Ray actors that prefill decode workers' residuals (disaggregated "
                               "recovery)", {"spec": Group(ModelSpec),
                                             "deferred": Group(DeferredSettings, frozenset({"timeout_s"}))}),
    "chat": Command("interactive chat with a server, showing recovery progress", {"chat": Group(ChatSettings)}),
    "demo": Command("scripted multi-turn image chat on the embedded default", {"demo": Group(DemoSettings)}),
}
_LOG = {"log": Group(LogSettings)}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:       # one line, not argparse's usage + message
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="raincheck", description="Raincheck Serve. Every flag can also be set by the "
                     "environment variable shown in [brackets]; a flag wins over its variable.")
    add_flags(parser, _LOG)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help, usage="%(prog)s [options]")
        add_flags(p, command.groups)
        add_flags(p.add_argument_group("every command"), _LOG)
    return parser


def settings(argv: list[str] | None = None) -> tuple[str, dict[str, Any]]:
    """The command and its settings objects (plus "log"). Raises SettingsError for a bad value, and
    SystemExit(2) for what argparse rejects."""
    args = _parser().parse_args(argv)
    try:
        built = build({**COMMANDS[args.command].groups, **_LOG}, args)
    except SettingsError as e:
        raise SettingsError(f"raincheck {args.command}: error: {e}") from None
    if args.command == "serve":
        built["worker"] = _serve_worker(built["frontend"], built["worker"], built["serve"])
    return args.command, built


def _serve_worker(front: FrontendSettings, worker: WorkerSettings, serve: ServeSettings) -> WorkerSettings:
    """`serve`'s decode worker: on loopback beside the frontend, sharing its store; with
    `--deferred-workers N`, N actors on a local Ray and disaggregated recovery offered too."""
    worker = dataclasses.replace(worker, host="127.0.0.1", port=0, advertise=None, metrics_port=None,
                                 store=front.store)
    if serve.deferred_workers:
        worker.deferred = dataclasses.replace(worker.deferred, workers=serve.deferred_workers)
        worker.recovery_modes = tuple(dict.fromkeys((*worker.recovery_modes, "disaggregated")))
    return worker


def _listens(command: str, s: dict[str, Any]) -> list[tuple[str, str, int | None]]:
    """(flag, host, port) of every port `command` will listen on (None: off)."""
    ports: list[tuple[str, str, int | None]] = []
    if command in ("serve", "frontend", "http"):
        f = s["frontend"]
        ports.append(("--metrics-port", f.metrics_host, f.metrics_port))
        if command != "http":
            ports.append(("--port", f.host, f.port))
    if command in ("serve", "http"):
        ports.append(("--http-port", s["http"].host, s["http"].port))
    if command == "decode-worker":
        w = s["worker"]
        ports += [("--port", w.host, w.port), ("--metrics-port", w.metrics_host, w.metrics_port)]
    return ports


def _run(command: str, s: dict[str, Any]) -> None:
    if command == "demo":
        from .demo import run_demo

        run_demo(s["demo"].model, s["demo"].max_new_tokens)
    elif command == "chat":
        from .chat_cli import run_chat

        run_chat(s["chat"])
    else:
        from . import launch

        runs: dict[str, Callable[[], None]] = {
            "serve": lambda: launch.serve(s["frontend"], s["worker"], s["http"]),
            "frontend": lambda: launch.run_frontend(s["frontend"]),
            "http": lambda: launch.run_http(s["frontend"], s["http"]),
            "decode-worker": lambda: launch.run_decode_worker(s["worker"]),
            "deferred-worker": lambda: launch.run_deferred_workers(s["deferred"], s["spec"]),
        }
        runs[command]()


def _setup_logging(command: str, log: LogSettings) -> None:
    if command in ("demo", "chat"):     # a person reads these: plain lines
        logging.basicConfig(level=log.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    else:
        from .common.logs import setup_logging

        setup_logging(log.log_level, json_lines=not log.plain_logs)


def describe(error: BaseException) -> str:
    """An error as a person reads it: the message, and the kind when the message alone is unclear."""
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror}: {error.filename}" if error.filename else error.strerror
    text = str(error).strip() or type(error).__name__
    module = type(error).__module__.split(".")[0]
    return text if module in ("raincheck_core", "raincheck_client") else f"{type(error).__name__}: {text}"


def main(argv: list[str] | None = None) -> None:
    try:
        command, built = settings(argv)
        check_ports(_listens(command, built))
    except SettingsError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    except ValueError as e:      # a taken port: before anything loads, like a bad value
        print(f"raincheck {command}: error: {e}", file=sys.stderr)
        sys.exit(2)
    log: LogSettings = built["log"]
    _setup_logging(command, log)
    try:
        _run(command, built)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:
        if log.debug:
            raise
        sys.exit(f"raincheck {command}: error: {describe(e)} (--debug shows the traceback)")


if __name__ == "__main__":
    main()
