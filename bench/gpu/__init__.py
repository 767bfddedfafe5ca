"""The device script: the accelerated backends on a GPU, in one command (`python -m bench.gpu`).

What it measures (JSON and a log into `$OUT`, or `--json PATH`):
- exactness against transformers for both families (random tiny checkpoints, one image as precomputed
  embeddings): `full` (every answer token) and `raincheck` (guard 0, one chunk: the first token sees I0,
  the second I0 ‖ D ‖ y1) on each backend, max |logit error| in fp32 (<= 1e-3) and bf16 (reported);
- random-weight decoders at the Qwen3-VL-8B and Qwen3.5-9B text shapes in bf16, built on the device (no
  download), one image of 1,024 and of 4,096 visual tokens + 64 text tokens, retention 0.3, 128-token
  answers: per policy (full, hard, raincheck c = 31 guard 16 without and with the default TPOT
  objective, post_answer) TTFT, mean TPOT, E2E, post-answer completion and ratios to full, with decode
  graphs on and off; the same prefill and decode through transformers; the decode TPOT over its physical
  floor (bf16 weight bytes a step reads / the device-to-device copy bandwidth measured here);
- the GDN online map update (us/token) and the join (us) at the Qwen3.5-9B layer shape;
- a profile of one fused c = 31 step (the top kernels).

`--device cpu --tiny` runs every part at tiny shapes on the CPU (the test suite runs it:
tests/engine/test_bench_gpu.py), writing the same keys."""
