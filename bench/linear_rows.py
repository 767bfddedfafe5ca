"""What one more row costs a linear layer on this machine: the floor under a fused chunk's cost.

    python -m bench.linear_rows [--threads 1]

A decode step runs its linear layers over 1 row per session; a fused chunk adds c rows. On a GPU (and a
CPU whose matmul is memory-bound) extra rows are nearly free up to tens of rows; where the matmul is
compute-bound they cost in proportion. Times `F.linear` over M rows for the `bench` checkpoint's shapes
and for a 64 MiB weight (larger than any cache), in thread CPU time, best of 5.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = ((384, 1536), (1536, 384), (4096, 4096))
ROWS = (1, 2, 8, 16, 32, 64)


def cost_s(rows: int, weight: torch.Tensor, calls: int) -> float:
    x = torch.randn(rows, weight.shape[1])
    for _ in range(3):
        F.linear(x, weight)
    best = float("inf")
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(calls):
            F.linear(x, weight)
        best = min(best, (time.thread_time() - t0) / calls)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("| weight (in x out) | " + " | ".join(f"M = {m}" for m in ROWS) + " |")
    print("|---" * (len(ROWS) + 1) + "|")
    for n_in, n_out in SHAPES:
        weight = torch.randn(n_out, n_in)
        calls = max(2, int(2e8 / weight.numel()))
        times = [cost_s(m, weight, calls) for m in ROWS]
        cells = [f"{t * 1e6:.0f} us" if m == 1 else f"{t / times[0]:.1f}x" for m, t in zip(ROWS, times, strict=True)]
        print(f"| {n_in} x {n_out} ({weight.numel() * 4 / 2**20:.0f} MiB) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
