#!/usr/bin/env bash
# Regenerate every shipped policy in policies/ by tuning the example tasks on this machine.
# Each tune keeps its study beside the policy (policies/NAME.study.db, not committed), so an
# interrupted run resumes. Usage: bash scripts/regenerate_policies.sh [extra tune args]
set -euo pipefail
cd "$(dirname "$0")/.."
run() { echo "== autoprec tune $*" >&2; autoprec tune "$@"; }
run examples/gpt2_bytes.py:task -o policies/gpt2_bytes.yaml "$@"
run examples/minilm.py:task -o policies/minilm.yaml "$@"
run examples/cnn.py:task -o policies/cnn.yaml "$@"
# For a GPU: numerics measured here, layers priced by the H100 cost model at 8x1024 tokens.
run examples/gpt2_bytes.py:gpu_task -o policies/gpt2_bytes_h100.yaml --target h100 \
    --formats fp32 bf16 fp8 --validate-steps 60 "$@"
