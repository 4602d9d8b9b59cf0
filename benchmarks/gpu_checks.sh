#!/usr/bin/env bash
# The GPU checks in one run, on whatever TransformerLens release is installed: safelens-tl verify
# on CUDA in float16 and bfloat16 (patched, then stock for comparison) and the benchmark's quick
# run on CUDA; with FULL_SECONDS set, also the benchmark's full sizes for the sections that need
# no fresh processes (the peak-memory section starts 30 of them), stopped after that many seconds.
#
#   bash benchmarks/gpu_checks.sh OUT_FOLDER
#   FULL_SECONDS=240 bash benchmarks/gpu_checks.sh OUT_FOLDER
#
# Writes the JSON reports to OUT_FOLDER; the tables go to stdout. Each step has its own time limit
# so one that hangs cannot take the others' time; a failing step is reported and the next runs.
set -u
out=${1:?usage: gpu_checks.sh OUT_FOLDER}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
release=$(python3 -c 'import importlib.metadata as m; print(m.version("transformer_lens"))')
tag="tl${release//./}"

step() {
    local seconds=$1
    shift
    echo "## TransformerLens $release: $* (limit ${seconds} s)"
    local start=$SECONDS
    timeout "$seconds" "$@"
    echo "## exit $? after $((SECONDS - start)) s"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, transformers, safelens_tl; print("torch", torch.__version__,
"transformers", transformers.__version__, "safelens_tl", safelens_tl.__version__)'
step 150 safelens-tl verify --device cuda --dtype float16,bfloat16 --json "$out/verify-$tag.json"
step 150 safelens-tl verify --device cuda --dtype float16,bfloat16 --no-patch --quiet
step 240 python3 benchmarks/kv_cache.py --quick --device cuda --json "$out/kv-quick-$tag.json"
step 240 python3 benchmarks/forward_in_place.py --section crossover --device cuda --rounds 3
if [ -n "${FULL_SECONDS:-}" ]; then
    step "$FULL_SECONDS" python3 benchmarks/kv_cache.py --device cuda \
        --only append,step,generate,trace,autocast,bridge --json "$out/kv-full-$tag.json"
fi
