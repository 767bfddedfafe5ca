"""The `raincheck` command: serve, frontend, decode-worker, deferred-worker, chat, demo."""

from __future__ import annotations

import argparse
import logging

from .common.settings import (
    add_frontend_flags,
    add_model_flags,
    add_ray_flags,
    add_store_flags,
    add_worker_flags,
    deferred_settings,
    frontend_settings,
    model_spec,
    worker_settings,
)


def _logging_flags(parser: argparse.ArgumentParser, *, after_command: bool) -> None:
    # after the subcommand they default to "not given", so they do not override the ones before it
    suppress = {"default": argparse.SUPPRESS} if after_command else {}
    parser.add_argument("--log-level", **(suppress or {"default": "INFO"}))
    parser.add_argument("--plain-logs", action="store_true", help="human-readable logs instead of JSON lines",
                        **suppress)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raincheck", description="Raincheck Serve")
    _logging_flags(parser, after_command=False)
    common = argparse.ArgumentParser(add_help=False)
    _logging_flags(common, after_command=True)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, parents=[common])

    serve = add("serve", "frontend + decode worker in one process (the embedded default)")
    add_frontend_flags(serve)
    add_worker_flags(serve, network=False)
    add_store_flags(serve)

    frontend = add("frontend", "the public ChatService (workers found through Redis)")
    add_frontend_flags(frontend)
    add_store_flags(frontend)

    worker = add("decode-worker", "a decode worker: one Engine, registered in Redis")
    add_worker_flags(worker)
    add_store_flags(worker)

    deferred = add("deferred-worker", "keep N named Ray actors that prefill decode workers' residuals "
                                      "(disaggregated recovery)")
    add_model_flags(deferred)
    add_ray_flags(deferred, 1, "named actors to keep alive")

    chat = add("chat", "interactive chat with a server, showing recovery progress")
    chat.add_argument("--address", default="127.0.0.1:50051")
    chat.add_argument("--api-key", default=None)
    chat.add_argument("--session", default=None, help="continue this session instead of opening one")
    chat.add_argument("--policy", default=None, help="deferral policy of the new session")
    chat.add_argument("--max-new-tokens", type=int, default=64)

    demo = add("demo", "scripted multi-turn image chat on the embedded default")
    demo.add_argument("--model", default=None,
                      help="checkpoint folder (default: the demo model, models/demo; without it a random model)")
    demo.add_argument("--max-new-tokens", type=int, default=48, help="room for a 36-token list answer")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command in ("demo", "chat"):
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    else:
        from .common.logs import setup_logging

        setup_logging(args.log_level, json_lines=not args.plain_logs)
    if args.command == "demo":
        from .demo import run_demo

        run_demo(args.model, args.max_new_tokens)
    elif args.command == "chat":
        from .chat_cli import run_chat

        run_chat(args.address, args.api_key, args.session, args.policy, args.max_new_tokens)
    elif args.command == "serve":
        from .launch import serve

        serve(frontend_settings(args), worker_settings(args))
    elif args.command == "frontend":
        from .launch import run_frontend

        run_frontend(frontend_settings(args))
    elif args.command == "deferred-worker":
        from .launch import run_deferred_workers

        run_deferred_workers(deferred_settings(args), model_spec(args))
    else:
        from .launch import run_decode_worker

        run_decode_worker(worker_settings(args))


if __name__ == "__main__":
    main()
