ln -sfn ../kernels localmoe/kernels; ln -sfn ../tui localmoe/tui
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
step() { local name=$1 secs=$2; shift 2; timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? ($(wc -l < "$OUT/$name.log") lines)"; }
step offload 230 python bench/offload_modes.py --cases direct:0.85,whole:0.85,direct:0,skewed,direct:0.85,whole:0.85 --baseline-tokens 2
step gemv 170 python bench/gemv_sweep.py
step tests 120 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short tests/test_kernel_router_topk.py tests/test_kernel_gemv.py tests/test_kernel_sparse_fused.py
grep "^|\|note\|slots" "$OUT/offload.log"
grep "^|" "$OUT/gemv.log"
grep -E "Error|assert|FAILED|passed|failed" "$OUT/tests.log" | head -30
