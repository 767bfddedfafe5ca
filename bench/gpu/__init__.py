"""The device script: the accelerated backends on a GPU, in one command (`bash bench/gpu/run.sh` there,
which runs `python -m bench.gpu`; `python -m bench.gpu.report RESULT.json` turns its JSON into the tables
of docs/BENCHMARKS.md). Committed runs: bench/gpu/results/.

What it measures, in this order (by value: a lease is short, and `--budget-s` stops new parts), each part
recorded on its own as it ends (bench/gpu/parts.py: an exception is stored with its traceback and the run
goes on; `--resume` an earlier JSON to run only what is missing):
- fla's chunk kernel alone at the Qwen3.5-9B GDN layer shape, fp32 through the adapter and bf16 direct:
  error against the torch rule, first-call and warm time (bench/gpu/kernels.py);
- random-weight decoders at the Qwen3.5-9B and Qwen3-VL-8B text shapes in bf16, built on the device (no
  download), one image of 1,024 (then 4,096) visual tokens + 64 text tokens, retention 0.3, 64-token
  answers: per policy (full, hard, raincheck c = 31 guard 16 without and with the default TPOT objective,
  post_answer) TTFT, mean TPOT, fused-step TPOT, E2E, post-answer completion (medians of 3 turns after a
  warm-up turn as long) and ratios to full, with decode graphs on and off; the same prefill and decode
  through transformers; the decode TPOT over its physical floor (bf16 weight bytes a step reads / the
  device-to-device copy bandwidth measured here);
- exactness against transformers for both families (tiny random checkpoints, one image as precomputed
  embeddings): `full` (every answer token) and `raincheck` (guard 0, one chunk: the first token sees I0,
  the second I0 ‖ D ‖ y1) on each backend, max |logit error| in fp32 (<= 1e-3) and bf16 (reported); the
  reference's delta rule is torch (fla is hidden while transformers' Qwen3.5 module is imported);
- the GDN online map update (us/token) and the join (us) at the Qwen3.5-9B layer shape;
- the flex attention path's work and traffic (bench/attention.py `accounting_table`): score entries
  computed / visible and K/V bytes read / visible of decode, fused-chunk and prefill steps at B = 1, 16,
  64 and 1-4K contexts (B = 1 and 16 at 1K with `--tiny`), and the layout's host time;
- a profile of fused c = 31 decode steps (eager): top kernels, kernel and wall time per step;
- after the graphs-off timings, speculative decoding on both shapes (bench/spec.py's arms: off, n-gram and
  replayed drafts at k = 1-3, full and raincheck c = 7): TPOT, tokens/s, acceptance, tokens per step, with
  decode steps captured and verify steps eager.

`--device cpu --tiny` runs every part at tiny shapes on the CPU with backend flex through the padded
decode path (the test suite runs it: tests/engine/test_bench_gpu.py), writing the same keys."""
