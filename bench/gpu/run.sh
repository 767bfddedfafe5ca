#!/usr/bin/env bash
# The device run (issue 40) as one command on the GPU machine: env.txt, gpu.json (written part by part),
# gpu.log, run.log (stdout and stderr) and compile-cache.tgz into $OUT.
# That machine has torch, triton and transformers but neither fla-core nor llguidance: carry them as wheels
# in .whl/ (ignored by git), downloaded on a machine with pip access by
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl fla-core==0.6.0 llguidance==1.9.1
# (llguidance's wheel is manylinux_2_31: without that platform pip finds none). Call `bash bench/gpu/run.sh`
# with carry [".whl"] and a timeout_s above LIMIT_S. For a rerun, copy $OUT's compile-cache.tgz and gpu.json
# into .gpucache/ (ignored) and carry that too: Inductor's and Triton's compiled kernels are then warm, and
# only the parts that failed or were not reached run (bench/gpu/parts.py). On a machine of the same kind as a
# committed result's, `mkdir -p .gpucache && cp bench/gpu/results/DATE-DEVICE.json .gpucache/gpu.json` starts
# from that run's successful parts (on another kind its timings would mix two devices: start clean).
# Commit gpu.json and the log under bench/gpu/results/ with the date and the device name.
set -uo pipefail
OUT=${OUT:-bench/out}
BUDGET_S=${BUDGET_S:-240}    # no part starts after this many seconds
LIMIT_S=${LIMIT_S:-300}      # the run is stopped here, whatever it is doing (what it wrote stays)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/rc-cache/inductor TRITON_CACHE_DIR=/tmp/rc-cache/triton
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 3
fi
export PYTHONPATH=$PWD:/tmp/site
if [ -f .gpucache/compile-cache.tgz ]; then
    tar xzf .gpucache/compile-cache.tgz -C / && echo "compile caches restored"
fi
# fail fast, seconds in: the machine, the versions, and every import the run needs
{
    nvidia-smi
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv
    python3 - <<'PY' || exit 4
import importlib.metadata as m, torch, raincheck_core, bench.gpu.__main__
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
for d in ("triton", "transformers", "tokenizers", "huggingface_hub", "fla-core", "llguidance", "einops", "numpy"):
    try:
        print(d, m.version(d))
    except m.PackageNotFoundError:
        print(d, "missing")
try:
    import fla.ops.gated_delta_rule
    print("fla kernels import")
except Exception as e:
    print("fla kernels do not import:", repr(e))
PY
} 2>&1 | tee "$OUT/env.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "environment check failed"; exit 4; }
RESUME=(); [ -f .gpucache/gpu.json ] && RESUME=(--resume .gpucache/gpu.json)   # a rerun: what is missing
timeout -k 10 "$LIMIT_S" python3 -m bench.gpu --device cuda --json "$OUT/gpu.json" --budget-s "$BUDGET_S" "${RESUME[@]}" 2>&1 \
    | tee "$OUT/run.log"
rc=${PIPESTATUS[0]}
tar czf "$OUT/compile-cache.tgz" -C / tmp/rc-cache 2> /dev/null
if [ "$(stat -c %s "$OUT/compile-cache.tgz" 2> /dev/null || echo 0)" -gt 16000000 ]; then
    rm -f "$OUT/compile-cache.tgz"; echo "compile caches over 16 MB: not kept"
fi
echo "bench.gpu exit status $rc"
exit "$rc"
