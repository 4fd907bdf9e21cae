#!/usr/bin/env bash
# Issue 40's one prepared GPU run, as the device tool runs it from the repository root with
# the wheels the machine lacks in .whl/ (optuna and its needs, torchao 0.17.0 for torch 2.11):
#   tests/test_cuda.py, then benchmarks/gpu_check.py with every section; all output under $OUT.
set -o pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
if ! python3 -c "import optuna, torchao" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
  > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  >> "$OUT/nvidia-smi.txt" 2>&1
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py \
  2>&1 | tee "$OUT/test_cuda.txt"
timeout "${CHECK_TIMEOUT:-420}" python3 benchmarks/gpu_check.py --output-dir "$OUT" "$@" \
  2> "$OUT/gpu_check.stderr"
echo "gpu_check exit $?"
