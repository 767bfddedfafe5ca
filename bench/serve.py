"""Serving latency as a load generator sees it: guidellm drives `raincheck serve` (the demo model) with
multi-turn image chats at 1, 4 and 16 concurrent conversations through the OpenAI chat API, and reports TTFT
and inter-token latency (ITL) percentiles per concurrency.

    python -m bench.serve [--quick] [--url URL] [--guidellm .venv-clients/bin/guidellm] [--json bench/out/serve.json]

guidellm is the field's load generator (vLLM's project); it lives in the clients' venv (requirements/clients.txt:
`make test-clients` makes it), where it installs with the project's CPU torch. Each conversation is a scene of
the demo's world with its first question, then two more; each asks for a row's objects, the demo's longest
answers (about 36 tokens), so that each answer has inter-token gaps to time. guidellm resends the conversation each
turn with the answers it received, as a chat app does, so the server continues one session per conversation
(how each request matched a session is read from the server's /metrics, per concurrency). Answers end where
the model ends them, at most `--max-new-tokens`: with guidellm's fixed lengths (end of sequence ignored) the
demo model goes on past its answer in special tokens, which stream no text, and ITL would time nothing. Each
level gets scenes of its own, so no level is served from an earlier one's prefix or encoder cache. A server is
started on free loopback ports unless --url names one. Exits non-zero on any failed request.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import urllib.request
from contextlib import nullcontext
from pathlib import Path

from tqdm import tqdm

from bench.local_server import ROOT, local_server
from raincheck_demo.world import make_dialogue

LEVELS = (1, 4, 16)
TURNS = 3
PERCENTILES = ("p50", "p90", "p99")


def conversations(folder: Path, count: int, first_seed: int) -> Path:
    """`count` conversations as guidellm reads them, one row each: image_0 (a PNG path) and prompt_<turn>."""
    rows = []
    for seed in range(first_seed, first_seed + count):
        d = make_dialogue(random.Random(seed), turns=TURNS, kinds=("list",))
        image = folder / f"scene-{seed}.png"
        image.write_bytes(d.scene.png())
        rows.append({"image_0": str(image), **{f"prompt_{t}": q.text for t, q in enumerate(d.questions[:TURNS])}})
    path = folder / f"chats-{first_seed}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def session_matches(url: str) -> dict[str, int]:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return {m.group(1): int(float(m.group(2))) for m in
            re.finditer(r'^raincheck:http_session_matches_total\{result="(\w+)"\} (\S+)$', text, re.M)}


def run_level(guidellm: str, url: str, data: Path, streams: int, requests: int, max_new_tokens: int,
              out: Path, deadline_s: int) -> dict:
    """One guidellm benchmark: `streams` concurrent conversations until `requests` requests (turns) ended."""
    before = session_matches(url)
    command = [guidellm, "run", "--backend", f"kind=openai_http,target={url},model=demo,max_tokens={max_new_tokens}",
               "--profile", f"kind=concurrent,streams={streams}",
               "--data", f"kind=json_file,path={data}",
               "--tokenizer", f"kind=huggingface_auto,model={ROOT / 'models' / 'demo-v2'}",
               "--constraint", f"kind=max_requests,count={requests}",
               "--constraint", f"kind=max_duration,seconds={deadline_s}",
               "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    log = out.with_suffix(".log")
    with log.open("w") as f:
        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    if done.returncode:
        raise RuntimeError(f"guidellm exited {done.returncode}; its output: {log}")
    after = session_matches(url)
    metrics = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    totals = metrics["request_totals"]

    def percentiles(name: str) -> dict[str, float]:
        found = metrics[name]["successful"]["percentiles"]
        return {p: round(found[p], 1) for p in PERCENTILES}

    return {"concurrency": streams, "requests": totals["successful"], "errored": totals["errored"],
            "incomplete": totals["incomplete"], "max_new_tokens": max_new_tokens,
            "ttft_ms": percentiles("time_to_first_token_ms"), "itl_ms": percentiles("inter_token_latency_ms"),
            "answer_tokens_mean": round(metrics["output_token_count"]["successful"]["mean"], 1),
            "output_tokens_per_s": round(metrics["output_tokens_per_second"]["successful"]["mean"], 1),
            "session_matches": {k: after.get(k, 0) - before.get(k, 0) for k in after}}


def table(levels: list[dict]) -> str:
    head = ("| concurrent chats | requests (errors) | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | "
            "answer tokens (mean) | output tok/s | continued / forked / new |")
    rows = [head, "|---|---|---|---|---|---|---|"]
    for r in levels:
        m = r["session_matches"]
        rows.append(f"| {r['concurrency']} | {r['requests']} ({r['errored']}) | "
                    + " / ".join(str(r["ttft_ms"][p]) for p in PERCENTILES) + " | "
                    + " / ".join(str(r["itl_ms"][p]) for p in PERCENTILES)
                    + f" | {r['answer_tokens_mean']} | {r['output_tokens_per_s']} | "
                    f"{m.get('continued', 0)} / {m.get('forked', 0)} / {m.get('new', 0)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one conversation per concurrent stream (else four)")
    ap.add_argument("--url", help="a server already running (its HTTP API's root); default: start one")
    ap.add_argument("--guidellm", default=str(ROOT / ".venv-clients" / "bin" / "guidellm"))
    ap.add_argument("--max-new-tokens", type=int, default=64, help="the longest answer")
    ap.add_argument("--deadline-s", type=int, default=600, help="each level's bound")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "serve.json")
    args = ap.parse_args(argv)
    if not Path(args.guidellm).exists():
        sys.exit(f"{args.guidellm} is missing: `make test-clients` installs it (requirements/clients.txt)")
    per_stream = 1 if args.quick else 4
    levels = []
    with tempfile.TemporaryDirectory() as tmp, (nullcontext(args.url) if args.url else
                                                local_server(sys.executable)) as url:
        folder = Path(tmp)
        for streams in tqdm(LEVELS, desc="concurrency levels"):
            count = streams * per_stream
            data = conversations(folder, count, 1000 * streams)
            levels.append(run_level(args.guidellm, url.rstrip("/"), data, streams, count * TURNS, args.max_new_tokens,
                                    folder / f"guidellm-{streams}.json", args.deadline_s))
            tqdm.write(json.dumps(levels[-1]))
    print(table(levels))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"quick": args.quick, "turns": TURNS, "levels": levels}, indent=1))
    return 1 if any(r["errored"] or r["incomplete"] for r in levels) else 0


if __name__ == "__main__":
    sys.exit(main())
