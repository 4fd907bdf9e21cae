#!/usr/bin/env bash
# Regenerate every shipped policy in policies/ by tuning the example tasks on this machine.
# Each tune keeps its study beside the policy (policies/NAME.study.db, not committed), so an
# interrupted run resumes. Usage: bash scripts/regenerate_policies.sh [extra tune args]
set -euo pipefail
cd "$(dirname "$0")/.."
run() { echo "== autoprec tune $*" >&2; autoprec tune "$@"; }
run examples/gpt2_bytes.py:task -o policies/gpt2_bytes.yaml "$@"
# MiniLM and the CNN are tuned over fp32 and bf16 only on CPUs: profiling fp16 (no FP16 matmul
# units on AVX512-BF16-only CPUs: ~10 s per layer for MiniLM's attention) and emulated fp8
# costs tens of minutes for formats the GPT-2 profile already measured as 30x slower / emulated.
# On a GPU, drop the --formats flag.
run examples/minilm.py:task -o policies/minilm.yaml --formats fp32 bf16 --n-trials 20 "$@"
run examples/cnn.py:task -o policies/cnn.yaml --formats fp32 bf16 --n-trials 20 "$@"
# For a GPU: numerics measured here, layers priced by the H100 cost model at 8x1024 tokens.
run examples/gpt2_bytes.py:gpu_task -o policies/gpt2_bytes_h100.yaml --target h100 \
    --formats fp32 bf16 fp8 --validate-steps 60 "$@"
