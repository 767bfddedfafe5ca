"""The `raincheck` command."""

from __future__ import annotations

import argparse
import logging


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="raincheck", description="Raincheck Serve")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="scripted multi-turn image chat on the embedded default")
    demo.add_argument("--model", default=None, help="checkpoint folder (default: a random model)")
    demo.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.command == "demo":
        from .demo import run_demo

        run_demo(args.model, args.max_new_tokens)


if __name__ == "__main__":
    main()
