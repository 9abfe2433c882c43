#!/usr/bin/env bash
# The GPU checks a release needs, in one device call of under 9 minutes (bench/README.md).
# On a CUDA machine, from the repository root:  bash bench/gpu_release_check.sh
#   1. tests:  the GPU-only tests (tests/test_graph.py), the kernel / module tests with compiled Triton kernels and
#              the DeaMoE tests (tests/test_deamoe*.py: departments on CUDA, department offloading)
#   2. engine: bench/gpu_engine_check.py: the six tiny families' CUDA-graph tokens equal transformers' at sparsity 0
#              and eager at 0.5, then `localmoe bench --shape qwen3.5-35b --sparsity 0,0.85 --baseline transformers`
#   3. prefill: bench/prefill_check.py: offloaded prompt processing (staging, gather_experts) equals resident in the
#              six tiny families and each expert format
#   4. offload: `localmoe bench --shape qwen3.5-35b --vram 24 --sparsity 0.85 --prompt-tokens 512,2048` (bf16 experts
#              offloaded, a 24 GB card; a 2048-token prompt's time to first token against the PCIe ceiling)
#   5. int4:   the same with `--experts int4 --vram 16` and 1024 tokens too (int4 experts offloaded, a 16 GB card;
#              pieces of 1024 tokens and up take the layer stage)
# Needs torch, triton, transformers, accelerate, safetensors, pytest (and pytest-xdist to run the tests in parallel);
# not textual: the package runs from the checkout (PYTHONPATH), kernels/ and tui/ linked in as localmoe.kernels/.tui.
# Each step has its own time limit and log under $OUT; a summary is printed last; exit status 1 if anything failed.
ln -sfn ../kernels localmoe/kernels
ln -sfn ../tui localmoe/tui
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
OUT=${OUT:-/tmp/localmoe-gpu}
mkdir -p "$OUT"
: > "$OUT/steps.txt"
step() {  # name, seconds, command...
    local name=$1 secs=$2 t0=$SECONDS rc
    shift 2
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    printf '%-7s exit %-3s %4ss  %s\n' "$name" "$rc" $((SECONDS - t0)) "$(tail -n 1 "$OUT/$name.log")" \
        | tee -a "$OUT/steps.txt"
}

tests=()
for f in tests/test_graph.py tests/test_kernel_*.py tests/test_fused*.py tests/test_attention.py \
         tests/test_experts.py tests/test_pdl.py tests/test_quantize.py tests/test_deamoe*.py; do
    [[ -f $f ]] && tests+=("$f")
done
xdist=(); python -c "import xdist" 2>/dev/null && xdist=(-n 8)
step tests 330 python -m pytest -q -p no:cacheprovider --tb=short "${xdist[@]}" "${tests[@]}"
step engine 220 python bench/gpu_engine_check.py
step prefill 120 python bench/prefill_check.py
step offload 130 python -m localmoe bench --shape qwen3.5-35b --vram 24 --sparsity 0.85 --prompt-tokens 512,2048
step int4 100 python -m localmoe bench --shape qwen3.5-35b --experts int4 --vram 16 --sparsity 0.85 --prompt-tokens 512,1024,2048

echo
echo "== release check on $(python -c 'import torch; print(torch.cuda.get_device_name())') (logs under $OUT)"
cat "$OUT/steps.txt"
grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | head -20
grep -A8 "^family" "$OUT/engine.log" | grep -v "^$"
grep -B1 -A3 "^engine " "$OUT/engine.log"
grep -h -B1 -A1 "^engine " "$OUT/offload.log" "$OUT/int4.log" | grep -v "^engine \|^--"
grep -h -A2 "^  prompt sparsity" "$OUT/offload.log" "$OUT/int4.log" | grep -v "^  prompt\|^--"
grep -A20 "^family        experts" "$OUT/prefill.log"
if grep -q " exit [^0]" "$OUT/steps.txt" || grep -A8 "^family" "$OUT/engine.log" | grep -qE "False|ERROR"; then
    echo "RELEASE CHECK: FAILED"; exit 1
fi
echo "RELEASE CHECK: passed"
