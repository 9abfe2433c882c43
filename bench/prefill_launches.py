"""How many kernel launches one prompt piece makes, and from where: the CPU's view of a host-bound prefill (not a
test; runs on this machine's CPU, no GPU).

A GPU prefill of an offloaded or resident Qwen3.5-35B-A3B piece is bound by the host issuing its launches
(bench/RESULTS.md, issue #29), so their count is the lever. This builds the model's real structure (--shape: its
layers, experts, top-k, layer types) at tiny widths with random weights, installs the fused modules as on a GPU, runs
every Triton kernel under the interpreter on CPU tensors (the path a GPU takes), and counts, during one piece of
--prompt-tokens tokens after a warm-up piece: aten ops that launch a kernel (views, allocations and the interpreter's
own argument copies left out) and Triton launches, the aten ops by the innermost localmoe / transformers source line.
Counts, not times: the interpreter is far slower than a GPU.

Usage: TRITON_INTERPRET=1 python bench/prefill_launches.py [--shape qwen3.5-35b] [--prompt-tokens 256]
       [--experts full|int4] [--int4-in-place] [--prepare torch|split|triton] [--host-spans] [--prefill-off]
       [--vram GiB [--span N]] [--top 20]
The engine's prefill defaults unless a flag says otherwise (`--prefill-off`: the fused norms, MoE block and attention
off, as before session 37). Slow: a 256-token piece of the default shape took over 15 minutes on a 2-core machine.
--vram (> 0.5: the workspace reserve) offloads experts behind a cache on the CPU, staged by the gather kernel, --span
experts a staging span (at tiny widths every expert fits one span; Qwen3.5-35B-A3B int4 at `--vram 16` takes 60).
At tiny widths the experts are small (Qwen3.5-35B-A3B's 40 layers: ~250 MB full, ~31 MB int4): `--vram 0.6` offloads
full experts but holds every int4 one, so int4 needs ~0.515; the first line says whether experts were offloaded.
"""

from __future__ import annotations

import argparse
import collections
import os
import traceback

if os.environ.get("TRITON_INTERPRET") != "1":
    raise SystemExit("run it with TRITON_INTERPRET=1 (the Triton kernels on CPU tensors)")

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime import interpreter

import localmoe.decode.deltanet_prefill as deltanet_prefill
import localmoe.engine.load as load
from localmoe.decode import replacements
from localmoe.decode.deltanet import FusedGatedDeltaNet
from localmoe.engine.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.experts.dense_path import DensePath
from localmoe.models.shapes import shape_config

p = argparse.ArgumentParser()
p.add_argument("--shape", default="qwen3.5-35b")
p.add_argument("--prompt-tokens", type=int, default=2048)
p.add_argument("--prepare", default=None, choices=("torch", "split", "triton"), help="the DeltaNet rule's first phase")
p.add_argument("--host-spans", action="store_true", help="DensePath.device_spans off (a host read of the routing)")
p.add_argument("--prefill-off", action="store_true", help="the prefill's fused norms, block and attention off")
p.add_argument("--experts", default="full", choices=("full", "int4"), help="the experts' format")
p.add_argument(
    "--int4-in-place",
    action="store_true",
    help="DensePath.int4_in_place on (resident int4 read in place; offloaded: int4_staged_packed, on)",
)
p.add_argument("--vram", type=float, default=0.0)
p.add_argument("--span", type=int, default=0, help="offloaded: experts a staging span (int4 at --vram 16 takes 60)")
p.add_argument("--top", type=int, default=20)
a = p.parse_args()
NARROW = dict(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, intermediate_size=64,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=512)  # fmt: skip
# views, allocations, metadata: no kernel on a GPU
FREE = {"view", "_unsafe_view", "t", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze", "as_strided",
        "detach", "alias", "permute", "reshape", "_reshape_alias", "split", "unbind", "split_with_sizes", "unflatten",
        "empty", "empty_like", "new_empty", "empty_strided", "narrow", "lift_fresh", "_local_scalar_dense"}  # fmt: skip


def narrow(alias: str):
    config = shape_config(alias)
    for name, value in NARROW.items():
        if hasattr(config, name):
            setattr(config, name, value)
    return config


load.shape_config = narrow  # the shape's structure at tiny widths
deltanet_prefill.kernel_available = lambda t: True  # the chunk rule's Triton path, as on CUDA
FusedGatedDeltaNet.prefill_prepare = a.prepare or FusedGatedDeltaNet.prefill_prepare
if a.prefill_off:
    replacements.FusedDecoderLayer.prefill_norms = False
    replacements.FusedSparseMoeBlock.prefill_fused = replacements.FusedAttention.prefill_fused = False
DensePath.int4_in_place = a.int4_in_place
e = Engine.random(
    a.shape,
    device=torch.device("cpu"),
    dtype=torch.float32,
    vram_gib=a.vram or None,
    context=a.prompt_tokens + 64,
    experts=a.experts,
)
replacements.install(e.model, "cpu", force=True)  # the fused modules a GPU load installs
e.set_sparsity(0.85)
for m in e.loaded.experts:
    m.device_spans, m.kernel_on_cpu = not a.host_spans, True
if e.loaded.cache is not None:
    e.loaded.cache.staging.kernel_on_cpu = True
    e.loaded.cache.staging.span = a.span or e.loaded.cache.staging.span

triton_launches: collections.Counter = collections.Counter()
counting = [False]
_run = interpreter.InterpretedFunction.run


def counted_run(self, *args, **kwargs):
    if counting[0]:
        triton_launches[self.fn.__name__] += 1
    return _run(self, *args, **kwargs)


interpreter.InterpretedFunction.run = counted_run


class Launches(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.by_site: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        stack = traceback.extract_stack(limit=40)
        name = func.overloadpacket.__name__
        if name not in FREE and not any("triton/runtime" in f.filename for f in stack):
            site = next(
                (
                    f"{f.filename.split('site-packages/')[-1].rsplit('localmoe/', 1)[-1]}:{f.lineno} {f.name}"
                    for f in reversed(stack)
                    if ("localmoe" in f.filename or "transformers" in f.filename) and "bench/" not in f.filename
                ),
                "?",
            )
            self.by_site[site] += 1
        return func(*args, **(kwargs or {}))


gen = torch.Generator().manual_seed(1)


def piece() -> None:
    prompt = torch.randint(0, e.loaded.config.vocab_size, (a.prompt_tokens,), generator=gen).tolist()
    for _ in e.generate(prompt, GenerationSettings(max_new_tokens=1)):
        pass


piece()  # warm-up: caches allocated, the cache placed
count = Launches()
counting[0] = True
with count:
    piece()
counting[0] = False
aten, tri = sum(count.by_site.values()), sum(triton_launches.values())
cache = e.loaded.cache
print(
    f"{a.shape} structure at tiny widths, {len(e.loaded.experts)} MoE layers, a {a.prompt_tokens}-token piece, "
    f"{a.experts} experts{' read in place' if a.int4_in_place else ''}, prepare {FusedGatedDeltaNet.prefill_prepare}, "
    f"device spans {'off' if a.host_spans else 'on'}, prefill norms {replacements.FusedDecoderLayer.prefill_norms}, "
    f"fused block {replacements.FusedSparseMoeBlock.prefill_fused}, fused attention "
    f"{replacements.FusedAttention.prefill_fused}, "
    + (f"experts offloaded ({cache.slots} slots, spans of {cache.staging.span})" if cache else "experts resident")
)
print(f"launches: {aten + tri} ({aten} aten ops, {tri} Triton: {dict(triton_launches.most_common())})")
for site, n in count.by_site.most_common(a.top):
    print(f"{n:>7}  {site}")
