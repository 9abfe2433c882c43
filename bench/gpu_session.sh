#!/usr/bin/env bash
# Everything bench/README.md lists as "not measured on a GPU yet", in one device call (<= 570 s of steps: fits one 600 s device call).
# Usage on the device machine, from the repository root:  bash bench/gpu_session.sh
# Each step has its own time limit and log under $OUT; the last lines printed are the summary tables.
ln -sfn ../kernels localmoe/kernels
ln -sfn ../tui localmoe/tui
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/localmoe-gpu}
mkdir -p "$OUT"
step() {  # name, seconds, command...
    local name=$1 secs=$2
    shift 2
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? ($(wc -l < "$OUT/$name.log") lines)"
}
step tests 70 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider tests/test_kernel_sparse_fused.py \
    tests/test_kernel_delta_rule_step.py tests/test_kernel_router_topk.py tests/test_kernel_shared_expert.py \
    tests/test_fused.py
step tune 100 python bench/tune_decode.py                  # includes the split-grid DeltaNet kernel (block_v)
step engine 190 python bench/gpu_engine_check.py           # tiny families' tokens, then bench vs transformers
step breakdown 70 python bench/step_breakdown.py 0.85
step offload 140 python bench/offload_modes.py --cases direct:0.85,direct:0.85:16:bg,skewed,direct:0.85,direct:0.85:16:bg \
    --baseline-tokens 0
tail -n 3 "$OUT/tests.log"
grep -A6 "^| kernel" "$OUT/tune.log"
grep -A7 "^family" "$OUT/engine.log"
grep -A4 "random weights) on" "$OUT/engine.log" | tail -4
grep -A12 "^sparsity" "$OUT/breakdown.log"
grep "^|" "$OUT/offload.log"
