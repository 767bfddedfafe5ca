"""Engine vs transformers on the same checkpoint: 1,024-token prefill, then 64 greedy decode tokens.

    python -m bench.engine [--prompt 1024] [--decode 64] [--repeats 3] [--json PATH]

Both run on this CPU with the same thread count, interleaved run by run so that machine noise hits
both alike; the table reports the best of the repeats (the least disturbed run: this machine is
shared) and the ratio ours / transformers (lower is better).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.models.random_init import build_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def time_transformers(model: PreTrainedModel, ids: torch.Tensor, decode: int) -> tuple[float, float]:
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config.get_text_config())
        t0 = time.perf_counter()
        out = model(input_ids=ids[None], past_key_values=cache, use_cache=True)
        token = out.logits[0, -1].argmax()
        ttft = time.perf_counter() - t0
        t1 = time.perf_counter()
        for _ in range(decode):
            out = model(input_ids=token.view(1, 1), past_key_values=cache, use_cache=True)
            token = out.logits[0, -1].argmax()
        return ttft, (time.perf_counter() - t1) / decode


def time_engine(engine: Engine, ids: torch.Tensor, decode: int) -> tuple[float, float]:
    session = engine.open_session()
    end = session.turn(Prompt(ids.tolist()), SamplingParams(max_new_tokens=decode + 1, ignore_eos=True)).result()
    session.close()
    return end.metrics.ttft_s, end.metrics.tpot_s


def run(family: str, prompt: int, decode: int, repeats: int, workdir: Path) -> dict:
    hf = build_model(family, "bench", seed=0)
    folder = workdir / family
    hf.save_pretrained(folder, safe_serialization=True)
    # the prompt runs again at every repeat: without the prefix cache, which would serve it
    engine = Engine.from_pretrained(folder, max_rows_per_step=max(prompt, 2048), prefix_cache=False)
    ids = torch.randint(0, hf.config.get_text_config().vocab_size - 16, (prompt,),
                        generator=torch.Generator().manual_seed(0))
    time_transformers(hf, ids[:64], 2)      # warm-up both
    time_engine(engine, ids[:64], 2)
    ours, theirs = [], []
    for _ in tqdm(range(repeats), desc=f"{family}", leave=False):
        theirs.append(time_transformers(hf, ids, decode))
        ours.append(time_engine(engine, ids, decode))
    best = lambda xs, i: min(x[i] for x in xs)  # noqa: E731
    result = {
        "family": family, "params_m": sum(p.numel() for p in hf.model.language_model.parameters()) / 1e6,
        "prompt": prompt, "decode": decode,
        "ttft_ms_ours": 1e3 * best(ours, 0), "ttft_ms_hf": 1e3 * best(theirs, 0),
        "tpot_ms_ours": 1e3 * best(ours, 1), "tpot_ms_hf": 1e3 * best(theirs, 1),
    }
    result["ttft_ratio"] = result["ttft_ms_ours"] / result["ttft_ms_hf"]
    result["tpot_ratio"] = result["tpot_ms_ours"] / result["tpot_ms_hf"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--families", default="qwen3_5,qwen3_vl")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(f, args.prompt, args.decode, args.repeats, Path(tmp)) for f in args.families.split(",")]
    print(f"\nprefill {args.prompt} tokens, {args.decode} decode tokens, {args.threads} threads, "
          f"best of {args.repeats}")
    print("| model | decoder params | TTFT ours / HF (ms) | TTFT ratio | TPOT ours / HF (ms) | TPOT ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['params_m']:.1f} M | {r['ttft_ms_ours']:.1f} / {r['ttft_ms_hf']:.1f} | "
              f"{r['ttft_ratio']:.2f} | {r['tpot_ms_ours']:.2f} / {r['tpot_ms_hf']:.2f} | {r['tpot_ratio']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
