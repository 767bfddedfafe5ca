"""The grammar libraries side by side on what a server pays per structured-output request: compiling a
JSON schema against the vocabulary, then masking each decode step's logits, for a batch of rows each held
to its own schema instance (as the batched sampler applies masks, row by row).

    python -m bench.grammar_mask [--vocab 32768] [--batch 8] [--repeats 5] [--json PATH]

The vocabulary is a byte-level BPE trained here on the installed Python sources (about 33k tokens, as a
small production tokenizer has; no download). Both libraries walk the same valid JSON instance, token by
token: llguidance through Raincheck's own mask (raincheck_core/grammar.py) and outlines-core (`Index` + `Guide`) when it
is installed; without it, llguidance alone is measured and the output says so. Times are medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from raincheck_core.grammar import Grammars, json_schema_grammar

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "colour": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
    "required": ["name", "age", "colour", "tags"], "additionalProperties": False}
INSTANCE = '{"name":"Ada Lovelace","age":36,"colour":"green","tags":["maths","engines"]}'


def train_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A fast byte-level BPE tokenizer of about `vocab` tokens, trained on this interpreter's stdlib."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:1500]
    texts = [p.read_bytes().decode("utf-8", errors="replace") for p in files]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab, min_frequency=2, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


def bench_llguidance(hf: PreTrainedTokenizerFast, tokens: list[int], batch: int, repeats: int) -> dict:
    """Through Raincheck's own path (raincheck_core/grammar.py), as the sampler runs it."""
    vocab = len(hf)
    grammars = Grammars(hf, vocab)
    grammar = json_schema_grammar(SCHEMA)
    grammars.constraint(grammar, hf.eos_token_id)          # the tokenizer is built once per engine
    builds, steps = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        rows = [grammars.constraint(grammar, hf.eos_token_id) for _ in range(batch)]
        builds.append((time.perf_counter() - t0) / batch)
        logits = torch.randn(batch, vocab)
        for token in tokens:
            t0 = time.perf_counter()
            for i, row in enumerate(rows):                  # the sampler's rows, each with its own matcher
                row.apply(logits[i])
            steps.append(time.perf_counter() - t0)
            for row in rows:
                row.consume(token)
    return {"compile_ms": _median_ms(builds), "mask_step_ms": _median_ms(steps),
            "mask_per_row_us": round(statistics.median(steps) / batch * 1e6, 1)}


def bench_outlines(hf: PreTrainedTokenizerFast, tokens: list[int], batch: int, repeats: int) -> dict | None:
    try:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
        from outlines_core.kernels.torch import allocate_token_bitmask, apply_token_bitmask_inplace
        from outlines_core.kernels.torch import fill_next_token_bitmask as fill
    except ImportError:
        return None
    vocab = len(hf)
    eos = hf.eos_token_id
    pieces: dict[str, list[int]] = {}
    for token, i in hf.get_vocab().items():
        if i != eos:
            pieces.setdefault(hf.convert_tokens_to_string([token]), []).append(i)
    vocabulary = outlines_core.Vocabulary(eos, pieces)
    regex = build_regex_from_schema(json.dumps(SCHEMA))
    builds, steps = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        index = outlines_core.Index(regex, vocabulary)       # one per schema, shared by the rows
        builds.append(time.perf_counter() - t0)
        guides = [outlines_core.Guide(index) for _ in range(batch)]
        mask = allocate_token_bitmask(vocab)
        logits = torch.randn(batch, vocab)
        for token in tokens:
            t0 = time.perf_counter()
            for i, g in enumerate(guides):
                fill(g, mask)
                apply_token_bitmask_inplace(logits[i:i + 1], mask)
            steps.append(time.perf_counter() - t0)
            if token != eos:     # outlines-core ends at a final state; it takes no eos step
                for g in guides:
                    g.advance(token)
        assert all(g.is_finished() for g in guides), "the instance did not complete the regex"
    return {"compile_ms": _median_ms(builds), "mask_step_ms": _median_ms(steps),
            "mask_per_row_us": round(statistics.median(steps) / batch * 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hf = train_tokenizer(args.vocab)
    tokens = hf.encode(INSTANCE, add_special_tokens=False) + [hf.eos_token_id]
    out = {"vocab": len(hf), "batch": args.batch, "instance_tokens": len(tokens),
           "llguidance": bench_llguidance(hf, tokens, args.batch, args.repeats),
           "outlines_core": bench_outlines(hf, tokens, args.batch, args.repeats)}
    if out["outlines_core"] is None:
        out["note"] = "outlines-core is not installed: llguidance alone was measured"
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
