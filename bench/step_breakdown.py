"""Where one batch-1 decode step's GPU time goes (run on the GPU, not a test).

Builds a random-weight engine at a registry model's real shapes (`--shape`, default qwen3.5-35b; qwen3-30b for
Qwen3-30B-A3B; the engine's defaults: fused decode modules on), profiles eager decode steps on a StaticCache (what
the graph step runs) with programmatic dependent launch off (so a kernel's time is its own, not its wait for the one
before) with torch.profiler, sorts every CUDA kernel of a step into a part by its name (projection GEMVs, lm_head,
routed experts, router, shared expert, DeltaNet step, attention, MLA's absorbed products, norms, glue), then times
the captured CUDA-graph step (PDL as configured). Kernel time per part is exact; the graph step also pays ~1 µs
between kernels. The launches per step tell whether the fused path ran: Qwen3-30B-A3B fused is 6 per layer (288) +
~6 around them.
Usage: python bench/step_breakdown.py [sparsity] [--shape qwen3-30b] [--no-fused] [--dense-tail] [--prompt 128]
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from localmoe.engine.engine import Engine
from localmoe.engine.sampling import sample
from localmoe.events import GenerationSettings

ap = argparse.ArgumentParser(description="per-part GPU time of one decode step")
ap.add_argument("sparsity", nargs="?", type=float, default=0.85)
ap.add_argument("--shape", default="qwen3.5-35b", help="registry model whose real config is built (random weights)")
ap.add_argument("--no-fused", action="store_true", help="transformers' modules (no decode replacements)")
ap.add_argument("--dense-tail", action="store_true", help="sparsity 0 through sparse_fused at threshold 0")
ap.add_argument("--prompt", type=int, default=128, help="prompt tokens before the profiled steps")
opts = ap.parse_args()
sparsity = opts.sparsity
engine = Engine.random(opts.shape, device=torch.device("cuda"), dtype=torch.bfloat16, fused=not opts.no_fused)
engine.set_sparsity(sparsity)
if opts.dense_tail:  # sparsity 0 through sparse_fused at threshold 0 with the tail, not dense_experts
    from localmoe.experts.local_experts import LocalExperts

    for m in engine.model.modules():
        if isinstance(m, LocalExperts):
            m.dense_tail = True
engine.set_context(1024)
model = engine.model
kw = engine._cache_kw

# kernel name (lower case) substring -> part; first match wins
PARTS = [
    ("_sparse_fused", "routed (+ shared) experts, residual add"),
    ("_sparse_mxfp4", "routed experts (MXFP4)"),
    ("_department_basis", "gate predictor (department bases)"),
    ("_absorb_kernel", "MLA absorbed products (W_UK, W_UV)"),
    ("_mla_rope_write", "attention q/k norm + RoPE"),
    ("_mla_", "attention core"),
    ("_dept_", "routed experts (DeaMoE departments)"),
    ("_slots_kernel", "DeaMoE department slotting"),
    ("_residual_publish", "residual add"),
    ("_moe_front", "MoE front (add, norm, router)"),
    ("_qk_norm_rope", "attention q/k norm + RoPE"),
    ("_dense_experts", "routed experts"),
    ("_router_topk", "router"),
    ("_gate_up_kernel", "shared expert"),
    ("_down_add_kernel", "shared expert"),
    ("_gdn_step", "deltanet step"),
    ("_gdn_split", "deltanet step"),
    ("_rmsnorm", "norms"),
    ("attention", "attention core"),
    ("_split_kernel", "attention core"),
    ("flash", "attention core"),
    ("fmha", "attention core"),
    ("softmax", "sampling / softmax"),
    ("argmax", "sampling / softmax"),
    ("nvjet", "GEMV (projections, lm_head)"),
    ("gemv", "GEMV (projections, lm_head)"),
    ("gemm", "GEMV (projections, lm_head)"),
    ("cutlass", "GEMV (projections, lm_head)"),
]


def part_of(name: str) -> str:
    low = name.lower()
    return next((p for key, p in PARTS if key in low), "glue (copies, adds, casts, cat, …)")


n_prompt = opts.prompt
prompt = torch.randint(0, engine.loaded.config.vocab_size, (1, n_prompt), device="cuda")
settings = GenerationSettings()
steps = 10
# the profiled steps run what the graph step runs: a StaticCache (the text model's fused call takes only that), with
# programmatic dependent launch OFF so that each kernel's time is its own (with PDL it includes its wait for the one
# before); the graph step below is timed with PDL as configured
from transformers import StaticCache  # noqa: E402

from localmoe.kernels import pdl  # noqa: E402

cache = StaticCache(config=engine.loaded.config, max_cache_len=1024)
pos = torch.arange(prompt.shape[1], device="cuda")
step_kw = {kw: cache, **engine._logits_kw}
pdl.set_enabled(False)
with torch.inference_mode():
    out = model(input_ids=prompt, cache_position=pos, use_cache=True, **step_kw)
    tok = sample(out.logits[0, -1], settings, None)
    p0 = prompt.shape[1]
    for i in range(3):  # warm-up
        out = model(
            input_ids=tok.view(1, 1), cache_position=torch.tensor([p0 + i], device="cuda"), use_cache=True, **step_kw
        )
        tok = sample(out.logits[0, -1], settings, None)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            out = model(
                input_ids=tok.view(1, 1),
                cache_position=torch.tensor([p0 + 3 + i], device="cuda"),
                use_cache=True,
                **step_kw,
            )
            tok = sample(out.logits[0, -1], settings, None)
        torch.cuda.synchronize()
pdl.set_enabled(None)

parts: dict[str, list] = {}
for ev in prof.key_averages():
    if ev.device_type != torch.autograd.DeviceType.CUDA or ev.self_device_time_total <= 0:
        continue
    p = parts.setdefault(part_of(ev.key), [0.0, 0, {}])
    p[0] += ev.self_device_time_total / steps
    p[1] += ev.count / steps
    p[2][ev.key] = p[2].get(ev.key, 0.0) + ev.self_device_time_total / steps
total = sum(p[0] for p in parts.values())

eos = engine.eos_ids
engine.eos_ids = set()
p = torch.randint(0, engine.loaded.config.vocab_size, (n_prompt,)).tolist()
list(engine.generate(p, GenerationSettings(max_new_tokens=4)))
list(engine.generate(p, GenerationSettings(max_new_tokens=129)))
st = engine.stats
print(
    f"\n{opts.shape}, sparsity {sparsity:.0%}, fused {not opts.no_fused}: graph decode {st.decode_tok_s:.1f} tok/s = "
    f"{1e6 / st.decode_tok_s:.0f} µs/step (graph: {engine._graph is not None}); "
    f"eager step (StaticCache, PDL off): {total:.0f} µs of kernels in {sum(p[1] for p in parts.values()):.0f} "
    f"launches"
)
print("| part | µs/step (kernels) | share | kernels/step | largest kernel (µs/step) |")
print("|---|---:|---:|---:|---|")
for name, (us, n, ks) in sorted(parts.items(), key=lambda kv: -kv[1][0]):
    big = max(ks.items(), key=lambda kv: kv[1])
    print(f"| {name} | {us:.0f} | {us / total:.1%} | {n:.0f} | {big[0][:50]} ({big[1]:.0f}) |")
print("\nkernels over 1% of the step:")
every = sorted(((k, us, name) for name, (_, _, ks) in parts.items() for k, us in ks.items()), key=lambda r: -r[1])
for k, us, name in every:
    if us >= 0.01 * total:
        print(f"  {us:7.0f} µs/step  {us / total:6.1%}  {k[:70]}")
