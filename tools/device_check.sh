#!/usr/bin/env bash
# The device checks: one prepared script for a session lent a GPU machine (the `device` tool's
# `run`, /work/.library/device/README.md), sized to fit its 15 minutes of device time with room to
# run it twice. What it runs, in order (each step bounded; a step that fails does not stop the next):
#
#   1. the tests that take the GPU paths (tests/test_device.py: snapshots copied off the device,
#      deltas of device gradients, restores into device tensors, the replay of a chain trained
#      on CUDA; the CUDA RNG test), on the machine's own torch;
#   2. exact and topk deltas every iteration on the GPU beside plain training (bench_delta
#      --device cuda): step-time ratios, the persister's CPU, restore of base + k and whether the
#      replay is exact;
#   3. a snapshot every 4 steps on the GPU beside the PCcheck- and CheckFreq-style baselines
#      (bench_snapshot --device cuda): stall, per-snapshot cost, background CPU per MB;
#   4. the default test suite with what time is left (the CPU paths on this machine's torch,
#      with CUDA present: pinned host memory, the CUDA RNG states in every record).
#
# Before the call, here, once (the packages ckptstore needs that the machine's image lacks, as
# wheels for its Python 3.12; .git/info/exclude ignores /.whl/):
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl lmdb lz4
#
# The call: run(command="bash tools/device_check.sh", carry=[".whl"], timeout_s=420). The log
# and the benchmarks' JSON come back under $OUT. A dry run of the same steps on the CPU (no
# GPU; the CUDA cases skip; --quick: the benchmarks' smoke settings):
#   DEVICE=cpu BENCH_FLAGS=--quick OUT=/tmp/dc bash tools/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
BENCH_FLAGS=${BENCH_FLAGS:-}
OUT=${OUT:-/tmp/device-check}
mkdir -p "$OUT"
exec > >(tee "$OUT/device_check.log") 2>&1
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/ckptstore-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/ckptstore-site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "
import os, torch, ckptstore
print('python', os.sys.version.split()[0], 'torch', torch.__version__, 'cores', os.cpu_count(),
      'cuda', torch.cuda.get_device_name() if torch.cuda.is_available() else None)" || exit 1
if [ "$DEVICE" = cuda ]; then
    python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 1
fi

echo "== 1. the GPU paths' tests (at $(elapsed) s)"
timeout 120 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_device.py \
    tests/test_checkpointer.py::test_cuda_rng_state_is_logged_and_restored

echo "== 2. deltas every iteration on $DEVICE (at $(elapsed) s)"
timeout 150 python3 tools/bench_delta.py --device "$DEVICE" --codecs exact,topk:0.01 \
    --rounds 3 --block 15 --k 20 --threads 4 --dir /tmp/bench_delta \
    --json "$OUT/bench_delta_$DEVICE.json" $BENCH_FLAGS

echo "== 3. a snapshot every 4 steps on $DEVICE (at $(elapsed) s)"
timeout 120 python3 tools/bench_snapshot.py --device "$DEVICE" --threads 4 --rounds 3 \
    --json "$OUT/bench_snapshot_$DEVICE.json" $BENCH_FLAGS

budget=$(( 390 - $(elapsed) ))
echo "== 4. the default suite, ${budget} s left of the script's 390 s"
if [ "$budget" -gt 30 ]; then
    timeout "$budget" python3 -m pytest -q -p no:cacheprovider -n 12 --maxfail=10 --timeout 120
    echo "suite exit $? (124: out of time, not a failure)"
fi
echo "== done in $(elapsed) s"
