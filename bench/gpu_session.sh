#!/usr/bin/env bash
# The pending GPU measurements (bench/README.md), in device calls of <= 570 s of steps each.
# Usage on the device machine, from the repository root:  bash bench/gpu_session.sh [a|b|c|all]
# Parts of earlier sessions stay as the record of what was run; some name options removed since (e.g. s6's and s6f's
# `fused:ticket_levels=2`, a two-level expert ticket that measured no faster and left the kernel).
#   a: GPU kernel/module tests, the engine check (tiny families + bench vs transformers), one step's breakdown
#   b: offloading under --vram 24 (gate tier vs whole-expert slots, skewed routing), sparse/dense crossover
#   c: the decode-attention kernel: its tests, the engine check and breakdown again, bench at the 8192 default context
#   next: pending for the next session (bench/README.md): breakdown with the decode-attention defaults, gate tier
#         placed by calibration routing where gates do not all fit (Qwen3.5-35B shapes at 12 GiB, skewed routing)
#   pdl:  programmatic dependent launch (kernels/pdl.py): every kernel test on the GPU, the tiny families' tokens,
#         then bench at 35B shapes with LOCALMOE_PDL=0 and =1 (same machine, back to back) and the step breakdown
#   s4:   session 4's decode changes (MoE block in two launches, input norms inside GEMVs, fused attention): their
#         GPU tests, the tiny families' tokens, bench 0/85%, the step breakdown, the new kernels' launch sweeps
#   s4b:  after the step's launch count came down: GPU tests of the changed kernels, the engine check with the bench
#         against transformers (the #6 table), the breakdown, the GEMV sweep at the engine's shapes, the MoE block
#   s4c:  the closing figures: GPU tests, engine check + bench vs transformers, breakdown, MoE block (tuned in-run)
#   s4d:  offloading with this session's decoder tail: 24 GiB (gates all fit but 6%) and 12 GiB (gates placed by
#         calibration routing counts), uniform and skewed routing
#   s4e:  the final code with PDL off and on (back to back), and at the chat's default 8192-token context
#   s4f:  the last two kernel changes (cache position in qk_norm_rope, DeltaNet state read before the wait): their
#         GPU tests, the tiny families' tokens, bench 0/85%
#   s5a:  session 5's expert-launch experiments (bench/sparse_variants.py: neuron-block loop, shared expert first and
#         prefetched, atomics and gate pass alone), the step breakdown as this machine's baseline
#   s5b:  register caps for the expert launch (sparse_variants.py), L2 prefetch during latency-bound kernels
#         (prefetch_try.py, kernels/l2_prefetch.py)
#   s5c:  routing inside the experts' launch and the text model's glue in 4 launches: their GPU tests, the tiny
#         families' tokens, then A/B on the whole step (step_ab.py: base, top-k back in moe_front, glue unfused,
#         sparse_fused maxnreg 64)
#   s5d:  L2 prefetch from many programs after the kernel before (prefetch_try.py), in the DeltaNet layer's chain
#   s5e:  launch parameters tuned in the whole step (step_ab.py): GEMV shapes, moe_front, sparse_fused, DeltaNet
#   s5f:  the best of s5e together against the tuned table, 4 rounds
#   s5g:  the closing figures: GPU tests of the changed kernels and modules, engine check + bench vs transformers,
#         the step breakdown
#   s5h:  prefill with and without FusedTextModel (512-token prompt; the closing bench's 85% prefill read 251 against
#         335 in session 4), and the bench at the chat's default 8192-token context
#   s5i:  what one kernel boundary costs (boundary_cost.py): empty kernels chained with and without PDL, and
#         chained on a flag set by the kernel before's last program
#   s5j:  more launch parameters in the whole step, around session 5's tuned table
#   s6:   GPU tests of sparse_fused (its jit-helper refactor) and the graph, the tiny families' graph tokens (graph
#         captured on the warm-up stream, 2 steps in flight), then the step breakdown as now written (StaticCache, PDL off: each kernel's own
#         time), in the whole step: decode 1 step ahead against 2, the DeltaNet step at block_v 16 / 2 warps,
#         and what the expert launch's per-token ticket costs (sparse_variants.py --tickets; in the whole step:
#         sparse_fused ticket_levels=2), and flag-started chains
#         polled with ld.acquire (boundary_cost.py)
#   s6b:  the decode attention's chunk loaded before the PDL wait (prefetch): its GPU tests, the tiny families' tokens,
#         then launch settings in the whole step at the bench's 512-token prompt (step_ab.py, 3 rounds)
#   s6c:  the closing figures with session 6's code (moe_front's residual, qk_norm_rope's cos/sin and the DeltaNet
#         step's conv windows loaded before the PDL wait; their GPU tests first): engine check + bench vs transformers (the #6 table), bench at
#         the chat's default 8192-token context, the step breakdown at a 512-token prompt, the in-kernel barrier
#   s6d:  s6c's GPU tests with time to finish, and the bench again at context 832 and 8192 (s6c's 85% row lost 9% at
#         8192 where the dense row lost 1%: run-to-run spread or the long static cache)
#   s6e:  decode attention with at most 16 programs per head (each walks chunks p, p + NP, ...): its GPU tests, the
#         tiny families' tokens, A/B at the chat's 8192-token context (step_ab.py --context 8192), the bench at 832/8192
#   s6f:  sparse_fused's two-level ticket against the one-level default in the whole step, 5 rounds at prompt 512
#   s6g:  the closing figures with the final code: engine check + bench vs transformers
#   s7a:  what a publish-free expert tail saves and costs (publish_free.py)
#   s7b:  the shared expert in moe_front's launch (GPU tests; step A/B at 85 % and at 0 % with the dense paths)
#   s7c:  moe_front's parts (moe_front_parts.py); the engine check and bench with the shared expert in moe_front and
#         sparse_fused at threshold 0 as the dense path (both new defaults); the bench again, sparsities reversed
#   s7d:  the top-k by ranks (router_topk.topk_tail): GPU tests, moe_front_parts.py, moe_front launch A/B in the step,
#         the engine check and bench
#   s7e:  the top-k rounds on int32 keys (16-bit logits), the probabilities gathered after them (the ranks of s7d
#         were slower and left): GPU tests, moe_front_parts.py, the engine check and bench
#   s7f:  moe_front stores no gate when the shared expert is inside; the whole block (block_chain.py) for #3; the
#         closing engine check and bench
#   s7g:  launch A/B in the step now that the experts launch has no shared programs (sparse_fused tiles, register cap;
#         moe_front tiles); block_chain.py with the bench's copy bandwidth
#   s7h:  the closing code at the chat's default context (8192)
#   s7i:  where the step goes now, at 85 % (step_breakdown.py, prompt 512)
#   s8a:  pending for the next session: the engine check and bench first (figures move by machine), then the shared
#         expert's neurons per moe_front program (2 and 8 against the default 4) in the step
#   s8b:  the greedy token chosen inside the graph (kernels/argmax.py) and the DeltaNet step's single ticket: GPU
#         tests, then both A/B'd in the step (choice0, one_ticket=0), then the engine check and bench
#   s8c:  the gate pass with TMA-pipelined loads (bench/gate_tma.py, a lead), s8b's two changes off together in the
#         step, the step breakdown and the bench at the chat's 8192-token context with the final code
#   s8d:  #3's figures in this session: the whole MoE block chain, and the MoE-block bench at the three shapes
#   s8e:  what a decode step costs beyond its graph: the engine's greedy decode against back-to-back replays
#   s8f:  the attention layer's position advanced by the decode attention (no ticket in qk_norm_rope): GPU tests,
#         then A/B in the step with the replay column (choice0 is the control: the same graph). Measured no
#         difference (-0.06% in the replays, inside choice0's 0.3%): reverted, so this part's attr case is gone
#   s9a:  open MoE sums (no ticket and no publishing tail in the experts' launch; the next layer's first kernels
#         added the sum): GPU tests, A/B in the step, the block chain for #3. Measured no gain in the step (-0.2%):
#         reverted (commit 6258a3f holds the variant), so this part's commands are gone
#   s9b:  the dense path as torch's grouped GEMM (prefill): GPU test, prefill A/B against the per-expert loop at
#         512 and 2048 prompt tokens, then the closing engine check and bench, and the bench at the chat's context
#   s9c:  the GPU test again (bf16 masked check by relative norm), the bench at the chat's 8192-token context, an
#         8000-token prompt (prefill in 2048-token chunks), and where the step goes (step_breakdown.py)
#   s9d:  prefill with the experts offloaded (the 24 GB card: --vram 24, direct misses, gates first; the dense path
#         takes the per-expert loop there): 512- and 2048-token prompts
#   s10a: prompt reuse across chat turns (localmoe/prefix.py): the tiny families' graph tokens (engine check without
#         the bench), a 3-turn chat per family with and without reuse, then time to first token per turn at
#         Qwen3.5-35B shapes resident and at --vram 24 (bench/chat_turns.py)
#   s10b: prompt reuse with the state kept at the prompt's end (and its logits: the same prompt again runs nothing):
#         the tiny families' 3-turn chats, then time to first token per turn at Qwen3.5-35B shapes resident and at
#         --vram 24 with the state kept at the prompt's end, at the history's end, and without reuse; logits check
#   s10c: a chat turn's prefill offloaded (--vram 24): n new tokens after a rewound history, sparse path (direct
#         misses) against the dense path's per-expert fetches (bench/offload_prefill.py)
#   s10d: the offloaded sparse-piece limit from host bytes (sparsity.sparse_token_limit, ~178 tokens at 24 GiB):
#         offload_prefill.py around it, then chat turns at --vram 24 whose new tokens fit under it
#   s10e: the final code: the GPU-only graph tests, and the tiny families' chats with and without reuse
#   s10f: the reply prefilled after its turn (Engine.prepare_next_turn, called by the chat app while the user
#         types): GPU graph tests, then chat turns resident and at --vram 24 (4 turns each)
#   s11a: --experts int4: the tiny families' graph tokens against the dequantized model, bench at 35B shapes resident
#         (0 and 85%), then int4 and full at 85% under --vram 24 (int4 all in VRAM, full offloaded)
#   s11b: the dense path's dequantization as one Triton kernel (kernels/dequant_int4.py): its GPU tests and the int4
#         module paths on CUDA, then the int4 bench again (prefill)
#   s11c: the closing figures with session 11's code: GPU tests of sparse_fused and the graph, the engine check + the
#         bench vs transformers (the #6 table)
#   s11d: int4 loaded expert by expert (Int4Tensor.put): the tiny families' tokens again, and a 4-layer checkpoint at
#         35B widths loaded int4 and full (time, VRAM peak during the load)
#   s11e: int4 experts offloaded (int4 slots, int4 pinned master copies, the kernel's int4 direct reads): GPU kernel
#         tests, the tiny families (offloaded int4 = resident int4), then int4 and full at 85% under --vram 16
# Each step has its own time limit and log under $OUT; the last lines printed are the summary tables.
ln -sfn ../kernels localmoe/kernels
ln -sfn ../tui localmoe/tui
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/localmoe-gpu}
PART=${1:-all}
mkdir -p "$OUT"
step() {  # name, seconds, command...
    local name=$1 secs=$2
    shift 2
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? ($(wc -l < "$OUT/$name.log") lines)"
}
if [[ $PART == a || $PART == all ]]; then
    step tests 170 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_router_topk.py tests/test_kernel_gemv.py tests/test_kernel_rmsnorm.py \
        tests/test_kernel_shared_expert.py tests/test_fused.py
    step engine 200 python bench/gpu_engine_check.py       # tiny families' tokens, then bench vs transformers
    step breakdown 80 python bench/step_breakdown.py 0.85
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    grep -A7 "^family" "$OUT/engine.log"
    grep -A4 "random weights) on" "$OUT/engine.log" | tail -4
    grep -A12 "^sparsity" "$OUT/breakdown.log"
fi
if [[ $PART == b || $PART == all ]]; then
    step offload 200 python bench/offload_modes.py --cases direct:0.85,whole:0.85,direct:0,skewed,direct:0.85 \
        --baseline-tokens 2
    # non-expert modules spilled to host memory by accelerate (4.56 GiB of them do not fit beside the rest in 5 GiB)
    step spill 70 python -m localmoe bench --shape qwen3.5-35b --vram 5 --sparsity 0.85 --prompt-tokens 32 \
        --decode-tokens 8
    # decode tok/s against prompt length and decode length (the bench's 512/256 ran slower than 128/129)
    step probe1 45 python -m localmoe bench --shape qwen3.5-35b --sparsity 0.85 --prompt-tokens 128 --decode-tokens 256
    step probe2 45 python -m localmoe bench --shape qwen3.5-35b --sparsity 0.85 --prompt-tokens 512 --decode-tokens 64
    step crossover 130 python bench/bench_moe_block.py --out "$OUT" --only 35B
    grep "^|\|note" "$OUT/offload.log"
    tail -n 4 "$OUT/spill.log" "$OUT/probe1.log" "$OUT/probe2.log"
    grep -i "crossover\|copy bandwidth" "$OUT/crossover.log" | tail -6
fi
if [[ $PART == c ]]; then
    step tests 130 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_decode_attention.py tests/test_attention.py tests/test_fused.py
    step engine 110 python bench/gpu_engine_check.py
    step breakdown 50 python bench/step_breakdown.py 0.85
    step ctx8192 50 python -m localmoe bench --shape qwen3.5-35b --sparsity 0.85 --context 8192 --decode-tokens 128
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    grep -A7 "^family" "$OUT/engine.log"
    grep -A4 "random weights) on" "$OUT/engine.log" | tail -4
    grep -A12 "^sparsity" "$OUT/breakdown.log"
    tail -n 3 "$OUT/ctx8192.log"
fi
if [[ $PART == next ]]; then
    step tests 150 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_decode_attention.py tests/test_attention.py tests/test_kernel_sparse_fused.py
    step breakdown 60 python bench/step_breakdown.py 0.85
    step offload12 240 python bench/offload_modes.py --vram 12 --cases direct:0.85,skewed,direct:0.85 \
        --baseline-tokens 0
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    grep -A12 "^sparsity" "$OUT/breakdown.log"
    grep "^|\|note" "$OUT/offload12.log"
fi
if [[ $PART == pdl ]]; then
    step tests 200 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short tests/test_kernel_*.py \
        tests/test_fused.py tests/test_attention.py tests/test_pdl.py
    step engine 100 python bench/gpu_engine_check.py --skip-bench
    step bench_nopdl 90 env LOCALMOE_PDL=0 python -m localmoe bench --shape qwen3.5-35b --sparsity 0,0.85
    step bench_pdl 90 python -m localmoe bench --shape qwen3.5-35b --sparsity 0,0.85
    step breakdown 60 python bench/step_breakdown.py 0.85
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    grep -A7 "^family" "$OUT/engine.log"
    tail -n 6 "$OUT/bench_nopdl.log" "$OUT/bench_pdl.log"
    grep -A12 "^sparsity" "$OUT/breakdown.log"
fi
if [[ $PART == s4 ]]; then
    step tests 120 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_moe_front.py tests/test_kernel_gemv.py tests/test_kernel_sparse_fused.py \
        tests/test_kernel_qk_norm_rope.py tests/test_kernel_decode_attention.py tests/test_fused.py \
        tests/test_fused_attention.py
    step engine 80 python bench/gpu_engine_check.py --skip-bench
    step bench 80 python -m localmoe bench --shape qwen3.5-35b --sparsity 0,0.85
    step breakdown 50 python bench/step_breakdown.py 0.85
    step breakdown0 45 python bench/step_breakdown.py 0
    step breakdown0k 45 python bench/step_breakdown.py 0 --dense-kernel
    step tune 90 python bench/tune_decode.py --only moe_front,sparse_tail
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    grep -A7 "^family" "$OUT/engine.log"
    tail -n 4 "$OUT/bench.log"
    for b in breakdown breakdown0 breakdown0k; do grep -A14 "^sparsity" "$OUT/$b.log"; done
    grep -A6 "^| kernel" "$OUT/tune.log"
fi
if [[ $PART == s4b ]]; then
    step tests 90 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_router_topk.py tests/test_kernel_moe_front.py tests/test_kernel_qk_norm_rope.py \
        tests/test_fused_attention.py tests/test_fused.py
    step engine 200 python bench/gpu_engine_check.py    # tiny families' tokens, then bench vs transformers
    step breakdown 50 python bench/step_breakdown.py 0.85
    step gemv 80 python bench/gemv_sweep.py --skip lm_head
    step moe 110 python bench/bench_moe_block.py --out "$OUT" --only 35B --no-cross --no-tune --no-offload
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    grep -A7 "^family" "$OUT/engine.log"
    grep -A5 "random weights) on" "$OUT/engine.log" | tail -5
    grep -A14 "^sparsity" "$OUT/breakdown.log"
    grep -A6 "^| shape" "$OUT/gemv.log"
    grep -A16 "| path | whole" "$OUT/moe.log"; grep "fused 85% experts" "$OUT/moe.log"
fi
if [[ $PART == s4c ]]; then
    step tests 100 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_qk_norm_rope.py tests/test_kernel_gemv.py tests/test_fused_attention.py tests/test_fused.py
    step engine 200 python bench/gpu_engine_check.py    # tiny families' tokens, then bench vs transformers
    step breakdown 50 python bench/step_breakdown.py 0.85
    step moe 170 python bench/bench_moe_block.py --out "$OUT" --only 35B --no-cross --no-offload
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    grep -A7 "^family" "$OUT/engine.log"
    grep -A5 "random weights) on" "$OUT/engine.log" | tail -5
    grep -A14 "^sparsity" "$OUT/breakdown.log"
    grep "copy bandwidth" "$OUT/moe.log" | head -2; grep -A16 "| path | whole" "$OUT/moe.log"
    grep "fused 85% experts\|tuned" "$OUT/moe.log"
fi
if [[ $PART == s4d ]]; then
    step offload24 110 python bench/offload_modes.py --vram 24 --cases direct:0.85,skewed,direct:0.85 \
        --baseline-tokens 0
    step offload12 120 python bench/offload_modes.py --vram 12 --cases direct:0.85,skewed,direct:0.85 \
        --baseline-tokens 0
    grep "^|\|note" "$OUT/offload24.log" "$OUT/offload12.log"
fi
if [[ $PART == s4e ]]; then
    step nopdl 70 env LOCALMOE_PDL=0 python -m localmoe bench --shape qwen3.5-35b --sparsity 0,0.85
    step pdl 70 python -m localmoe bench --shape qwen3.5-35b --sparsity 0,0.85
    step ctx8192 70 python -m localmoe bench --shape qwen3.5-35b --sparsity 0,0.85 --context 8192
    tail -n 3 "$OUT/nopdl.log" "$OUT/pdl.log" "$OUT/ctx8192.log"
fi
if [[ $PART == s4f ]]; then
    step tests 60 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_qk_norm_rope.py tests/test_kernel_delta_rule_step.py tests/test_fused_attention.py
    step engine 60 python bench/gpu_engine_check.py --skip-bench
    step bench 65 python -m localmoe bench --shape qwen3.5-35b --sparsity 0,0.85
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    grep -A7 "^family" "$OUT/engine.log"
    tail -n 3 "$OUT/bench.log"
fi
if [[ $PART == s5a ]]; then
    step variants 330 python bench/sparse_variants.py
    step breakdown 90 python bench/step_breakdown.py 0.85
    grep -A60 "^moe_front alone" "$OUT/variants.log" | tail -62
    grep -A14 "^sparsity" "$OUT/breakdown.log"
fi
if [[ $PART == s5b ]]; then
    step variants 300 python bench/sparse_variants.py
    step prefetch 200 python bench/prefetch_try.py
    grep -A50 "^moe_front alone" "$OUT/variants.log" | tail -52
    grep -A40 "^| chain" "$OUT/prefetch.log"
fi
if [[ $PART == s5c ]]; then
    step tests 210 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_sparse_fused.py tests/test_kernel_moe_front.py tests/test_kernel_router_topk.py \
        tests/test_fused.py tests/test_fused_model.py
    step engine 80 python bench/gpu_engine_check.py --skip-bench
    step ab 240 python bench/step_ab.py base,attr:FusedSparseMoeBlock.route_in_experts=0,unfuse:FusedTextModel,fused:maxnreg=64
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    grep -A7 "^family" "$OUT/engine.log"
    grep -B2 -A8 "^| case" "$OUT/ab.log"
fi
if [[ $PART == s5d ]]; then
    step prefetch 200 python bench/prefetch_try.py
    grep -A40 "^| chain" "$OUT/prefetch.log"
fi
if [[ $PART == s5e ]]; then
    step ab 560 python bench/step_ab.py 'base,table:gemv:N12352_K2048:BLOCK_N=4;num_warps=2,table:gemv:N12352_K2048:BLOCK_N=4;num_warps=4,table:gemv:N12352_K2048:BLOCK_N=16;num_warps=4,table:gemv:N12352_K2048:BLOCK_N=8;num_warps=4,table:gemv:N2048_K4096:BLOCK_N=2;num_warps=8,table:gemv:N2048_K4096:BLOCK_N=1;num_warps=4,table:gemv:N2048_K4096:BLOCK_N=2;num_warps=4,table:gemv:N9216_K2048:BLOCK_N=4;num_warps=4,table:gemv:N9216_K2048:BLOCK_N=8;num_warps=2,table:gemv:N248320_K2048:BLOCK_N=4;num_warps=4,table:gemv:N248320_K2048:BLOCK_N=1;num_warps=4,base,table:moe_front:H2048_E256_k8:block_e=2;num_warps=2,table:moe_front:H2048_E256_k8:block_e=1;num_warps=4,table:moe_front:H2048_E256_k8:block_e=4;num_warps=4,fused:BLOCK_I=4;num_warps=8,fused:BLOCK_I=4;num_warps=4,table:gated_deltanet_step:HK16_HV32_D128:block_v=16;num_warps=4,table:gated_deltanet_step:HK16_HV32_D128:block_v=64;num_warps=4,table:gated_deltanet_step:HK16_HV32_D128:block_v=32;num_warps=8' --rounds 2
    grep -B2 -A30 "^| case" "$OUT/ab.log"
fi
if [[ $PART == s5f ]]; then
    step ab 300 python bench/step_ab.py 'base,table:gemv:N12352_K2048:BLOCK_N=4;num_warps=4+table:gemv:N2048_K4096:BLOCK_N=1;num_warps=4+table:gemv:N9216_K2048:BLOCK_N=4;num_warps=4+table:moe_front:H2048_E256_k8:block_e=4;num_warps=4,table:gemv:N9216_K2048:BLOCK_N=4;num_warps=4+table:moe_front:H2048_E256_k8:block_e=4;num_warps=4,table:moe_front:H2048_E256_k8:block_e=4;num_warps=4' --rounds 4
    grep -B2 -A8 "^| case" "$OUT/ab.log"
fi
if [[ $PART == s5g ]]; then
    step tests 200 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_decode_attention.py tests/test_attention.py tests/test_fused_attention.py \
        tests/test_fused_model.py tests/test_fused.py tests/test_kernel_moe_front.py tests/test_kernel_gemv.py
    step engine 230 python bench/gpu_engine_check.py
    step breakdown 90 python bench/step_breakdown.py 0.85
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    grep -A7 "^family" "$OUT/engine.log"
    grep -A5 "random weights) on" "$OUT/engine.log" | tail -5
    grep -A14 "^sparsity" "$OUT/breakdown.log"
fi
if [[ $PART == s5h ]]; then
    step ab 150 python bench/step_ab.py base,unfuse:FusedTextModel --rounds 3 --prompt 512
    step ctx8192 100 python -m localmoe bench --shape qwen3.5-35b --sparsity 0,0.85 --context 8192
    grep -B2 -A5 "^| case" "$OUT/ab.log"
    tail -n 4 "$OUT/ctx8192.log"
fi
if [[ $PART == s5i ]]; then
    step boundary 120 python bench/boundary_cost.py
    cat "$OUT/boundary.log" | tail -12
fi
if [[ $PART == s5j ]]; then
    step ab 200 python bench/step_ab.py 'base,table:moe_front:H2048_E256_k8:block_e=8;num_warps=4,table:moe_front:H2048_E256_k8:block_e=4;num_warps=8,table:gemv:N248320_K2048:BLOCK_N=2;num_warps=8,table:gated_deltanet_step:HK16_HV32_D128:block_v=16;num_warps=2,table:gemv:N12352_K2048:BLOCK_N=2;num_warps=4,table:gemv:N9216_K2048:BLOCK_N=2;num_warps=4' --rounds 3
    grep -B2 -A10 "^| case" "$OUT/ab.log"
fi
if [[ $PART == s6 ]]; then
    step tests 75 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_sparse_fused.py tests/test_kernel_delta_rule_step.py
    step tiny 70 python bench/gpu_engine_check.py --skip-bench
    step ab 190 python bench/step_ab.py 'base,depth:1,fused:ticket_levels=2,table:gated_deltanet_step:HK16_HV32_D128:block_v=16;num_warps=2' --rounds 4
    step tickets 90 python bench/sparse_variants.py --quick --tickets
    step boundary 75 python bench/boundary_cost.py
    step breakdown 75 python bench/step_breakdown.py 0.85
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    grep -A7 "^family" "$OUT/tiny.log"
    grep -B2 -A6 "^| case" "$OUT/ab.log"
    grep -A12 "^| kernel" "$OUT/tickets.log"
    tail -n 14 "$OUT/boundary.log"
    grep -A14 "^sparsity" "$OUT/breakdown.log"
fi
if [[ $PART == s6b ]]; then
    step tests 80 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_decode_attention.py tests/test_fused_attention.py tests/test_attention.py
    step tiny 70 python bench/gpu_engine_check.py --skip-bench
    A=table:decode_attention:Hq16_Hkv2_D256
    step ab 300 python bench/step_ab.py "base,$A:chunk=64;block_l=64;num_warps=4;prefetch=0,$A:chunk=64;block_l=64;num_warps=8,$A:chunk=32;block_l=32;num_warps=8,$A:chunk=32;block_l=32;num_warps=4,$A:chunk=16;block_l=16;num_warps=4,$A:chunk=32;block_l=32;num_warps=8;prefetch=0" --rounds 3 --prompt 512
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    grep -A7 "^family" "$OUT/tiny.log"
    grep -B2 -A9 "^| case" "$OUT/ab.log"
fi
if [[ $PART == s6c ]]; then
    step tests 80 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_moe_front.py tests/test_kernel_qk_norm_rope.py tests/test_kernel_delta_rule_step.py \
        tests/test_fused.py tests/test_pdl.py
    step engine 230 python bench/gpu_engine_check.py
    step ctx8192 100 python -m localmoe bench --shape qwen3.5-35b --sparsity 0,0.85 --context 8192
    step breakdown 90 python bench/step_breakdown.py 0.85 --prompt 512
    step barrier 40 python bench/boundary_cost.py --barrier
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    grep -A7 "^family" "$OUT/engine.log"
    grep -A4 "random weights) on\|copy bandwidth" "$OUT/engine.log" | tail -5
    tail -n 4 "$OUT/ctx8192.log"
    grep -A14 "^sparsity" "$OUT/breakdown.log"
    tail -n 5 "$OUT/barrier.log"
fi
if [[ $PART == s6d ]]; then
    step tests 200 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_moe_front.py tests/test_kernel_qk_norm_rope.py tests/test_kernel_delta_rule_step.py \
        tests/test_kernel_decode_attention.py tests/test_fused.py tests/test_pdl.py
    step bench832 100 python -m localmoe bench --shape qwen3.5-35b --sparsity 0,0.85
    step ctx8192 100 python -m localmoe bench --shape qwen3.5-35b --sparsity 0,0.85 --context 8192
    step bench832b 100 python -m localmoe bench --shape qwen3.5-35b --sparsity 0.85,0
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    tail -n 4 "$OUT/bench832.log" "$OUT/ctx8192.log" "$OUT/bench832b.log"
fi
if [[ $PART == s6e ]]; then
    step tests 120 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_decode_attention.py tests/test_fused_attention.py tests/test_attention.py
    step tiny 70 python bench/gpu_engine_check.py --skip-bench
    A=table:decode_attention:Hq16_Hkv2_D256
    step ab 200 python bench/step_ab.py "base,$A:max_splits=128,$A:chunk=32;block_l=32;num_warps=4,$A:max_splits=32" \
        --rounds 3 --prompt 512 --context 8192
    step bench832 80 python -m localmoe bench --shape qwen3.5-35b --sparsity 0,0.85
    step ctx8192 80 python -m localmoe bench --shape qwen3.5-35b --sparsity 0,0.85 --context 8192
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    grep -A7 "^family" "$OUT/tiny.log"
    grep -B2 -A6 "^| case" "$OUT/ab.log"
    tail -n 3 "$OUT/bench832.log" "$OUT/ctx8192.log"
fi
if [[ $PART == s6f ]]; then
    step ab 240 python bench/step_ab.py "base,fused:ticket_levels=2" --rounds 6 --prompt 512
    grep -B2 -A4 "^| case" "$OUT/ab.log"
    grep round "$OUT/ab.log"
fi
if [[ $PART == s6g ]]; then
    step engine 200 python bench/gpu_engine_check.py
    grep -A7 "^family" "$OUT/engine.log"
    grep -A4 "random weights) on" "$OUT/engine.log" | tail -5
fi
if [[ $PART == s7a ]]; then
    step publish 150 python bench/publish_free.py
    tail -n 10 "$OUT/publish.log"
fi
if [[ $PART == s7b ]]; then
    step tests 120 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_moe_front.py tests/test_fused.py
    F="table:moe_front:H2048_E256_k8:block_e=4;num_warps=4"
    step ab85 230 python bench/step_ab.py \
        "base,attr:FusedSparseMoeBlock.shared_in_front=0,$F;shared_block=4,$F;shared_block=1" --rounds 3 --prompt 512
    step ab0 170 python bench/step_ab.py \
        "base,attr:LocalExperts.dense_tail=1,attr:LocalExperts.dense_tail=1+attr:FusedSparseMoeBlock.shared_in_front=0" \
        --sparsity 0 --rounds 3 --prompt 512
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    grep -B2 -A6 "^| case" "$OUT/ab85.log" "$OUT/ab0.log"
fi
if [[ $PART == s7c ]]; then
    step parts 120 python bench/moe_front_parts.py
    step engine 220 python bench/gpu_engine_check.py
    step bench0 100 python -m localmoe bench --shape qwen3.5-35b --sparsity 0.85,0
    cat "$OUT/parts.log" | tail -n 12
    grep -A7 "^family" "$OUT/engine.log"
    grep -A4 "random weights) on" "$OUT/engine.log" | tail -5
    tail -n 4 "$OUT/bench0.log"
fi
if [[ $PART == s7d ]]; then
    step tests 120 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_router_topk.py tests/test_kernel_moe_front.py tests/test_fused.py
    step parts 120 python bench/moe_front_parts.py
    F="table:moe_front:H2048_E256_k8"
    step ab 200 python bench/step_ab.py "base,$F:block_e=8;num_warps=4,$F:block_e=4;num_warps=2" --rounds 3 --prompt 512
    step engine 220 python bench/gpu_engine_check.py
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    cat "$OUT/parts.log" | tail -n 12
    grep -B2 -A5 "^| case" "$OUT/ab.log"
    grep -A7 "^family" "$OUT/engine.log"
    grep -A4 "random weights) on" "$OUT/engine.log" | tail -5
fi
if [[ $PART == s7e ]]; then
    step tests 150 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_router_topk.py tests/test_kernel_moe_front.py tests/test_fused.py
    step parts 120 python bench/moe_front_parts.py
    step engine 220 python bench/gpu_engine_check.py
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    cat "$OUT/parts.log" | tail -n 12
    grep -A7 "^family" "$OUT/engine.log"
    grep -A4 "random weights) on" "$OUT/engine.log" | tail -5
fi
if [[ $PART == s7f ]]; then
    step tests 150 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_moe_front.py tests/test_fused.py
    step block 150 python bench/block_chain.py
    step engine 220 python bench/gpu_engine_check.py
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    tail -n 12 "$OUT/block.log"
    grep -A7 "^family" "$OUT/engine.log"
    grep -A4 "random weights) on" "$OUT/engine.log" | tail -5
fi
if [[ $PART == s7g ]]; then
    F="table:moe_front:H2048_E256_k8"
    step ab 260 python bench/step_ab.py "base,fused:BLOCK_I=4;num_warps=8,fused:BLOCK_I=16;num_warps=16,fused:maxnreg=128,$F:block_e=8;num_warps=4,$F:block_e=4;num_warps=8" \
        --rounds 3 --prompt 512
    step block 150 python bench/block_chain.py
    grep -B2 -A8 "^| case" "$OUT/ab.log"
    tail -n 12 "$OUT/block.log"
fi
if [[ $PART == s7h ]]; then
    step ctx8192 150 python -m localmoe bench --shape qwen3.5-35b --sparsity 0,0.85 --context 8192
    tail -n 4 "$OUT/ctx8192.log"
fi
if [[ $PART == s7i ]]; then
    step breakdown 110 python bench/step_breakdown.py 0.85 --prompt 512
    tail -n 16 "$OUT/breakdown.log"
fi
if [[ $PART == s8a ]]; then
    step tests 110 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_moe_front.py tests/test_fused.py tests/test_pdl.py
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    step engine 220 python bench/gpu_engine_check.py
    F="table:moe_front:H2048_E256_k8:block_e=4;num_warps=4"
    step ab 200 python bench/step_ab.py "base,$F;shared_block=2,$F;shared_block=8" --rounds 3 --prompt 512
    grep -A7 "^family" "$OUT/engine.log"
    grep -A4 "random weights) on" "$OUT/engine.log" | tail -5
    grep -B2 -A5 "^| case" "$OUT/ab.log"
fi
if [[ $PART == s8b ]]; then
    step tests 150 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_argmax.py tests/test_graph.py tests/test_kernel_delta_rule_step.py tests/test_pdl.py
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    G="table:gated_deltanet_step:HK16_HV32_D128:block_v=16;num_warps=2"
    step ab 200 python bench/step_ab.py "base,choice0,$G;one_ticket=0" --rounds 4 --prompt 512
    step engine 220 python bench/gpu_engine_check.py
    grep -B2 -A5 "^| case" "$OUT/ab.log"
    grep -A7 "^family" "$OUT/engine.log"
    grep -A4 "random weights) on" "$OUT/engine.log" | tail -5
fi
if [[ $PART == s8c ]]; then
    step tests 60 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short tests/test_kernel_argmax.py
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -10
    step gate 150 python bench/gate_tma.py
    G="table:gated_deltanet_step:HK16_HV32_D128:block_v=16;num_warps=2"
    step ab 130 python bench/step_ab.py "base,choice0+$G;one_ticket=0" --rounds 3 --prompt 512
    step breakdown 100 python bench/step_breakdown.py 0.85 --prompt 512
    step ctx8192 110 python -m localmoe bench --shape qwen3.5-35b --sparsity 0,0.85 --context 8192
    cat "$OUT/gate.log" | grep -v Warning | tail -n 16
    grep -B2 -A4 "^| case" "$OUT/ab.log"
    tail -n 16 "$OUT/breakdown.log"
    tail -n 5 "$OUT/ctx8192.log"
fi
if [[ $PART == s8d ]]; then
    step chain 150 python bench/block_chain.py
    step moe 250 python bench/bench_moe_block.py --out "$OUT" --no-cross --no-tune --no-offload
    grep -v Warning "$OUT/chain.log" | tail -n 12
    grep -A40 "| path | whole" "$OUT/moe.log" | head -60
fi
if [[ $PART == s8e ]]; then
    step gap 200 python bench/replay_gap.py --rounds 4
    grep -v Warning "$OUT/gap.log" | tail -n 12
fi
if [[ $PART == s8f ]]; then
    step tests 170 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_kernel_qk_norm_rope.py tests/test_kernel_decode_attention.py tests/test_fused_attention.py \
        tests/test_fused_model.py tests/test_graph.py tests/test_pdl.py
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -20
    step ab 260 python bench/step_ab.py "base,attr:FusedAttention.defer_advance=0,choice0" --rounds 3 --prompt 512
    grep "round" "$OUT/ab.log"
    grep -B2 -A5 "^| case" "$OUT/ab.log"
fi
if [[ $PART == s9b ]]; then
    step tests 60 python -m pytest -q -p no:cacheprovider --tb=short tests/test_experts.py
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -10
    step ab 150 python bench/step_ab.py "base,attr:LocalExperts.grouped=0" --rounds 2 --prompt 512
    step p2048 90 python -m localmoe bench --shape qwen3.5-35b --sparsity 0.85 --prompt-tokens 2048 \
        --decode-tokens 64
    step engine 220 python bench/gpu_engine_check.py
    grep -B2 -A4 "^| case" "$OUT/ab.log"
    tail -n 4 "$OUT/p2048.log"
    grep -A7 "^family" "$OUT/engine.log"
    grep -A4 "random weights) on" "$OUT/engine.log" | tail -5
fi
if [[ $PART == s9c ]]; then
    step tests 60 python -m pytest -q -p no:cacheprovider --tb=short tests/test_experts.py
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -10
    step ctx8192 130 python -m localmoe bench --shape qwen3.5-35b --sparsity 0,0.85 --context 8192
    step p8000 120 python -m localmoe bench --shape qwen3.5-35b --sparsity 0.85 --prompt-tokens 8000 \
        --decode-tokens 64 --context 8192
    step breakdown 100 python bench/step_breakdown.py 0.85 --prompt 512
    tail -n 5 "$OUT/ctx8192.log"
    tail -n 3 "$OUT/p8000.log"
    tail -n 16 "$OUT/breakdown.log"
fi
if [[ $PART == s9d ]]; then
    step v512 240 python -m localmoe bench --shape qwen3.5-35b --vram 24 --sparsity 0.85 --prompt-tokens 512 \
        --decode-tokens 32
    step v2048 240 python -m localmoe bench --shape qwen3.5-35b --vram 24 --sparsity 0.85 --prompt-tokens 2048 \
        --decode-tokens 32
    tail -n 6 "$OUT/v512.log"
    tail -n 6 "$OUT/v2048.log"
fi
if [[ $PART == s10a ]]; then
    step engine 150 python bench/gpu_engine_check.py --skip-bench
    step turns 200 python bench/chat_turns.py --skip-tiny
    step turns24 230 python bench/chat_turns.py --skip-tiny --vram 24
    grep -A7 "^family" "$OUT/engine.log"
    grep -A7 "^family" "$OUT/turns.log"
    grep -A10 "^chat turns" "$OUT/turns.log"
    grep -A10 "^chat turns" "$OUT/turns24.log"
fi
if [[ $PART == s10b ]]; then
    step turns 200 python bench/chat_turns.py --skip-tiny
    step turns24 300 python bench/chat_turns.py --skip-tiny --vram 24
    grep -v "Writing\|falling" "$OUT/turns.log" | grep -A6 "^family"
    grep -A10 "^chat turns" "$OUT/turns.log"
    grep -A10 "^chat turns" "$OUT/turns24.log"
fi
if [[ $PART == s10c ]]; then
    step oprefill 300 python bench/offload_prefill.py --vram 24 --sizes 16,64,128,256,512,1024
    grep -A12 "^prefill of n" "$OUT/oprefill.log"
    grep -E "Error|error" "$OUT/oprefill.log" | head -5
fi

if [[ $PART == s10d ]]; then
    step oprefill 200 python bench/offload_prefill.py --vram 24 --sizes 96,160,192,320
    step turns24 250 python bench/chat_turns.py --skip-tiny --vram 24 --reply 60 --user 60
    grep -A10 "^prefill of n" "$OUT/oprefill.log"
    grep -A10 "^chat turns" "$OUT/turns24.log"
    grep -E "Error|error" "$OUT/oprefill.log" "$OUT/turns24.log" | head -5
fi
if [[ $PART == s10e ]]; then
    step tests 200 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short tests/test_graph.py
    step turns 150 python bench/chat_turns.py --skip-shape
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -10
    grep -v "Writing\|falling" "$OUT/turns.log" | grep -A6 "^family"
fi
if [[ $PART == s10f ]]; then
    step tests 150 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short tests/test_graph.py
    step turns 130 python bench/chat_turns.py --skip-tiny --turns 4
    step turns24 200 python bench/chat_turns.py --skip-tiny --vram 24 --reply 60 --user 60 --turns 4
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -10
    grep -A8 "^chat turns" "$OUT/turns.log"
    grep -A8 "^chat turns" "$OUT/turns24.log"
    grep -E "Error" "$OUT/turns.log" "$OUT/turns24.log" | head -5
fi
if [[ $PART == s11a ]]; then
    step tiny 110 python bench/int4_check.py
    step resident 200 python bench/int4_check.py --skip-tiny --bench resident
    step vram24 260 python bench/int4_check.py --skip-tiny --bench vram24
    grep -A7 "^family" "$OUT/tiny.log"
    grep -E "Error|error" "$OUT/tiny.log" "$OUT/resident.log" "$OUT/vram24.log" | head -5
    grep -E "note: VRAM|note: --experts|^engine|^localmoe|^qwen" "$OUT/resident.log" "$OUT/vram24.log"
fi
if [[ $PART == s11b ]]; then
    step tests 150 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short tests/test_kernel_dequant_int4.py tests/test_experts.py tests/test_quantize.py
    step resident 200 python bench/int4_check.py --skip-tiny --bench resident
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -10
    grep -E "Error|error" "$OUT/resident.log" | head -5
    grep -E "^engine|^localmoe|^qwen" "$OUT/resident.log"
fi
if [[ $PART == s11c ]]; then
    step tests 200 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short tests/test_kernel_sparse_fused.py tests/test_graph.py
    step engine 250 python bench/gpu_engine_check.py
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -10
    grep -A7 "^family" "$OUT/engine.log"
    grep -A4 "random weights) on" "$OUT/engine.log" | tail -5
fi
if [[ $PART == s11d ]]; then
    step tiny 110 python bench/int4_check.py
    step load 300 python bench/int4_load.py
    grep -A7 "^family" "$OUT/tiny.log"
    grep -E "Error|error" "$OUT/tiny.log" "$OUT/load.log" | head -5
    grep -E "^saved|^int4|^full" "$OUT/load.log"
fi
if [[ $PART == s11e ]]; then
    step tiny 120 python bench/int4_check.py
    step vram16 220 python bench/int4_check.py --skip-tiny --bench vram16
    step tests 90 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider --tb=short tests/test_kernel_sparse_fused.py -k int4
    grep -A7 "^family" "$OUT/tiny.log"
    grep -E "Error|error" "$OUT/tiny.log" "$OUT/vram16.log" | head -5
    grep -E "note: VRAM|^engine|^localmoe|^qwen" "$OUT/vram16.log"
    grep -E "FAILED|passed|failed|^E " "$OUT/tests.log" | head -10
fi
