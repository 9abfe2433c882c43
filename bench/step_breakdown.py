"""Where one batch-1 decode step's GPU time goes (run on the GPU, not a test).

Builds the random-weight Qwen3.5-35B-A3B-shaped engine, then profiles eager decode steps with torch.profiler;
module hooks open a profiler range per part (DeltaNet, full attention, router, shared expert, localmoe experts,
lm_head, sampling), and the table sums the device time of the kernels launched inside each range. Also times the
captured CUDA graph step for comparison. Usage: python bench/step_breakdown.py [sparsity] [--fused]
(`--fused`: with localmoe.fused's decode-time replacements installed; "moe_block" then is the whole fused block.)
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from localmoe.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.sampling import sample

args = [a for a in sys.argv[1:] if not a.startswith("--")]
sparsity = float(args[0]) if args else 0.85
engine = Engine.random("qwen3.5-35b", device=torch.device("cuda"), dtype=torch.bfloat16, fused="--fused" in sys.argv)
engine.set_sparsity(sparsity)
engine.set_context(1024)
model = engine.model

PARTS = {"linear_attn": "deltanet", "self_attn": "attention", "mlp.gate": "router", "mlp.shared_expert": "shared_expert",
         "mlp.shared_expert_gate": "shared_expert", "mlp.experts": "experts", "lm_head": "lm_head",
         "input_layernorm": "norms", "post_attention_layernorm": "norms", "model.norm": "norms",
         "embed_tokens": "embedding", ".mlp": "moe_block (router+shared+experts)"}
ranges = {}


def attach(name, module, part):
    def pre(mod, args, kwargs=None):
        r = record_function(f"part::{part}")
        r.__enter__()
        ranges.setdefault(id(mod), []).append(r)

    def post(mod, args, out):
        ranges[id(mod)].pop().__exit__(None, None, None)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


for name, mod in model.named_modules():
    for suffix, part in PARTS.items():
        if name.endswith(suffix) and (suffix != "mlp.gate" or name.endswith(".mlp.gate")):
            attach(name, mod, part)
            break

prompt = torch.randint(0, engine.loaded.config.vocab_size, (1, 128), device="cuda")
settings = GenerationSettings()
with torch.inference_mode():
    out = model(input_ids=prompt, use_cache=True)
    cache = out.past_key_values
    tok = sample(out.logits[0, -1], settings, None)
    for _ in range(3):  # warm-up
        out = model(input_ids=tok.view(1, 1), use_cache=True, past_key_values=cache)
        tok = sample(out.logits[0, -1], settings, None)
    torch.cuda.synchronize()
    steps = 10
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            out = model(input_ids=tok.view(1, 1), use_cache=True, past_key_values=cache)
            with record_function("part::sampling"):
                tok = sample(out.logits[0, -1], settings, None)
                int(tok)
        torch.cuda.synchronize()

totals = {}
kernels = {}
for ev in prof.key_averages():
    if ev.key.startswith("part::"):
        totals[ev.key[6:]] = ev.device_time_total / steps
all_kernels = sum(e.self_device_time_total for e in prof.key_averages() if not e.key.startswith("part::")) / steps
n_kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA) / steps

# the captured step
ids = engine.encode_raw if False else None
eos = engine.eos_ids
engine.eos_ids = set()
p = torch.randint(0, engine.loaded.config.vocab_size, (128,)).tolist()
list(engine.generate(p, GenerationSettings(max_new_tokens=4)))
t = time.perf_counter()
list(engine.generate(p, GenerationSettings(max_new_tokens=129)))
graph_step_us = None
st = engine.stats
print(f"\nsparsity {sparsity:.0%}: graph decode {st.decode_tok_s:.1f} tok/s = {1e6 / st.decode_tok_s:.0f} us/step "
      f"(graph: {engine._graph is not None})")
print(f"eager step: device busy {all_kernels:.0f} us over ~{n_kernels:.0f} kernel launches")
print(f"{'part':<15} {'us/step (device)':>16} {'share':>7}")
for part, us in sorted(totals.items(), key=lambda kv: -kv[1]):
    print(f"{part:<15} {us:>16.1f} {us / all_kernels:>7.1%}")
print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
