#!/usr/bin/env bash
# The device run of issue 32, as one command on the GPU machine (<= 8 minutes): JSON + log into $OUT.
# That machine has torch and triton; carry what else it lacks as wheels in .whl/ (ignored by git):
#   pip download --no-deps -d .whl fla-core==0.6.0 einops==0.8.2   (+ any of requirements/runtime.txt missing there)
# and run `bash bench/gpu/run.sh` with carry [".whl"]. Then commit $OUT/gpu.json as bench/gpu/results/<date>.json.
set -euo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python -m pip install -q --no-deps --no-index .whl/*.whl
fi
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/env.txt"
PYTHONPATH=$PWD timeout 470 python -m bench.gpu --device cuda --json "$OUT/gpu.json"
