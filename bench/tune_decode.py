"""Launch-parameter sweep of the fused decode kernels at a registry model's shapes (GPU, not a test; default
Qwen3.5-35B-A3B).

router_topk (Qwen3.5-35B: H 2048, E 256, k 8), shared_expert (H 2048, I 512; models with a shared expert) and
gated_deltanet_step (H_k 16, H_v 32, d 128, conv 4; Qwen3.5's linear attention only; its one-program-per-key-head
grid, block_v None, against the split grid over value heads and d_v slices), bf16. `--shape ALIAS` takes the widths
from the registry model's config (`localmoe/models/shapes.json`): e.g. `--shape qwen3-30b` (H 2048, E 128, k 8, I 768,
no shared expert, no DeltaNet; standard RMSNorm). Each configuration is checked against the default launch (same
outputs up to accumulation order) and timed as a CUDA graph of 12 calls over 12 different weight sets (so L2 does
not hold the weights; `triton.testing.do_bench` median, µs per call). Prints the table of the best per kernel and writes
`$OUT/decode_params.json` ({"decode_params": {kernel: {shape: kwargs}}, "launch_params": {shape: {"fused": kwargs}}})
to merge into kernels/tuned/<device>.json.

Also moe_front (residual add + norm + router top-k + shared gate, one launch; with a gated shared expert, as Qwen3.5's
decoder layer runs it, that expert's programs in the same launch) and the experts' `sparse_fused` with
the shared expert and the residual in its tail (the decoder layer's two launches on the sparse path; thresholds at
the model's registry default sparsity, or `--sparsity S`, 0.85 for a shape the registry does not list; its best
launch is written as `launch_params`' "fused" entry, which the engine's experts read).

Usage: PYTHONUNBUFFERED=1 python bench/tune_decode.py [--shape ALIAS] [--sparsity S] [--only router_topk,
       shared_expert,gated_deltanet_step,moe_front,sparse_tail]
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import torch
from graph_timing import graph_us

from localmoe.kernels.delta_rule_step import gated_deltanet_step
from localmoe.kernels.moe_front import moe_front
from localmoe.kernels.router_topk import router_topk
from localmoe.kernels.shared_expert import shared_expert
from localmoe.kernels.sparse_fused import sparse_fused
from localmoe.kernels.token_tail import SharedExpert
from localmoe.models.registry import load_registry
from localmoe.models.shapes import shape_config

DEV, DT, N = torch.device("cuda"), torch.bfloat16, 12
SHAPE = sys.argv[sys.argv.index("--shape") + 1] if "--shape" in sys.argv else "qwen3.5-35b"
_spec = load_registry().get(SHAPE)
SPARSITY = (  # sparse_tail's thresholds: the sparsity the model decodes at by default
    float(sys.argv[sys.argv.index("--sparsity") + 1])
    if "--sparsity" in sys.argv
    else (_spec.sparsity if _spec is not None and _spec.sparsity > 0 else 0.85)
)
cfg = shape_config(SHAPE)
cfg = getattr(cfg, "text_config", None) or cfg
E = next(getattr(cfg, a) for a in ("num_experts", "num_local_experts", "n_routed_experts") if getattr(cfg, a, None))
H, K, I = cfg.hidden_size, cfg.num_experts_per_tok, getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
# shared expert width (0: none): Qwen's one shared expert, or DeepSeek-V2's n_shared_experts run as one MLP
I_S = getattr(cfg, "shared_expert_intermediate_size", 0) or (getattr(cfg, "n_shared_experts", 0) or 0) * I
DELTANET = hasattr(cfg, "linear_num_key_heads")
KIND = "zero_centred" if cfg.model_type.startswith("qwen3_5") else "standard"
NORM_TOPK = getattr(cfg, "norm_topk_prob", None) is not False  # None: the family always renormalises
KIND = "zero_centred" if "qwen3_5" in cfg.model_type else KIND  # DeaMoE's Qwen3.5 twin too
# DeaMoE (`--shape qwen3.5-35b-deamoe`): moe_front's group-limited top-k (departments of n experts, g of them kept)
GROUP = (
    {"group_size": cfg.experts_per_department, "topk_group": cfg.topk_group}
    if hasattr(cfg, "experts_per_department")
    else {}
)
if DELTANET:
    HK, HV, D, KS = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_conv_kernel_dim,
    )
    C = 2 * HK * D + HV * D
g = torch.Generator(device=DEV).manual_seed(0)


def rnd(*shape, scale=0.02):
    return torch.randn(shape, device=DEV, dtype=torch.float32, generator=g).mul_(scale).to(DT)


ONLY = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None
SKIP = {"shared_expert"} if not I_S else set()
SKIP |= {"gated_deltanet_step"} if not DELTANET else set()
print(
    f"{SHAPE}: H {H}, E {E}, k {K}, I {I}, shared expert {I_S or 'none'}, DeltaNet {DELTANET}, norm {KIND}, "
    f"sparse_tail at {SPARSITY:.0%}",
    flush=True,
)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want|: a launch's accumulation order against the default's, at any output scale
    (an absolute bound rejected every Mixtral sparse_tail launch, whose outputs run to the hundreds)."""
    return float((got.float() - want.float()).abs().max()) / max(float(want.float().abs().max()), 1e-6)


def sweep(name, shape_key, space, make_calls, check):
    if (ONLY is not None and name not in ONLY) or name in SKIP:
        return name, shape_key, 0.0, []
    default_us = graph_us(make_calls({}))
    print(f"  {name} default launch: {default_us:.2f} us", flush=True)
    rows = []
    for combo in itertools.product(*space.values()):
        kw = dict(zip(space, combo))
        try:
            calls = make_calls(kw)
            err = check(kw)
            us = graph_us(calls)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
            print(f"  {name} {kw}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
            continue
        rows.append((us, kw, err))
        print(f"  {name} {kw}: {us:.2f} us (err {err:.1e})", flush=True)
    rows.sort(key=lambda r: r[0])
    return name, shape_key, default_us, rows


results = []
# -- router ---------------------------------------------------------------------------------------------------------
xs = [rnd(1, H, scale=1.0) for _ in range(N)]
wr = [rnd(E, H) for _ in range(N)]
tick = torch.zeros(64, dtype=torch.int32, device=DEV)
ref = [router_topk(xs[i], wr[i], K, NORM_TOPK) for i in range(N)]


def router_calls(kw):
    return [lambda i=i: router_topk(xs[i], wr[i], K, NORM_TOPK, tickets=tick, **kw) for i in range(N)]


def router_check(kw):
    err = 0.0
    for i in range(N):
        lg, w, idx = router_topk(xs[i], wr[i], K, NORM_TOPK, tickets=tick, **kw)
        err = max(err, rel_err(lg, ref[i][0]))
        if not torch.equal(idx.sort(1).values, ref[i][2].sort(1).values):
            err = max(err, 1.0)  # a different expert set counts as a failure
    return err


results.append(
    sweep(
        "router_topk",
        f"H{H}_E{E}_k{K}",
        {"block_e": [1, 2, 4], "block_h": [1024, 2048], "num_warps": [4, 8]},
        router_calls,
        router_check,
    )
)
# -- shared expert --------------------------------------------------------------------------------------------------
IS = I_S or I  # (built either way; the sweep is skipped without a shared expert)
se = [(rnd(IS, H), rnd(IS, H), rnd(H, IS), rnd(1, H)) for _ in range(N)]
routed = [rnd(1, H, scale=1.0) for _ in range(N)]
ref_se = [shared_expert(xs[i], *se[i], routed[i]) for i in range(N)]


def se_calls(kw):
    return [lambda i=i: shared_expert(xs[i], *se[i], routed[i], **kw) for i in range(N)]


def se_check(kw):
    return max(rel_err(shared_expert(xs[i], *se[i], routed[i], **kw), ref_se[i]) for i in range(N))


results.append(
    sweep(
        "shared_expert",
        f"H{H}_I{IS}",
        {
            "block_i": [2, 4, 8],
            "block_h": [2048],
            "down_block_h": [2, 4, 8],
            "down_block_i": [512, 1024],
            "num_warps": [4, 8],
        },
        se_calls,
        se_check,
    )
)
# -- Gated DeltaNet step ---------------------------------------------------------------------------------------------
if DELTANET:
    gd = []
    for _ in range(N):
        gd.append(
            dict(
                mixed_qkv=rnd(1, C, scale=1.0),
                z=rnd(1, HV * D, scale=1.0),
                a=rnd(1, HV, scale=1.0),
                b=rnd(1, HV, scale=1.0),
                conv_state=rnd(1, C, KS, scale=1.0),
                conv_weight=rnd(C, KS, scale=0.5),
                conv_bias=None,
                A_log=torch.rand(HV, device=DEV),
                dt_bias=torch.rand(HV, device=DEV),
                norm_weight=torch.ones(D, device=DEV, dtype=DT),
                norm_eps=1e-6,
                state=torch.randn(1, HV, D, D, device=DEV, generator=g) * 0.1,
                num_k_heads=HK,
                head_k_dim=D,
                num_v_heads=HV,
                head_v_dim=D,
            )
        )

    def gd_call(i, kw):
        d = dict(gd[i])
        d["conv_state"], d["state"] = d["conv_state"].clone(), d["state"].clone()  # the check must not drift the inputs
        return gated_deltanet_step(**d, **kw)

    def gd_calls(kw):
        return [lambda i=i: gated_deltanet_step(**gd[i], **kw) for i in range(N)]

    def gd_check(kw):  # against the default launch from the same (timed runs advance the states) inputs
        return max(rel_err(gd_call(i, kw), gd_call(i, {})) for i in range(N))

    results.append(
        sweep(
            "gated_deltanet_step",
            f"HK{HK}_HV{HV}_D{D}",
            {"block_v": [None, 16, 32, 64], "num_warps": [2, 4, 8]},
            gd_calls,
            gd_check,
        )
    )

# -- MoE front ------------------------------------------------------------------------------------------------------
res = [rnd(1, H, scale=1.0) for _ in range(N)]
nw = [rnd(H, scale=0.1) for _ in range(N)]
wsg = [rnd(1, H) if I_S else None for _ in range(N)]
ref_front = [moe_front(xs[i], res[i], nw[i], 1e-6, KIND, wr[i], K, NORM_TOPK, wsg[i], **GROUP) for i in range(N)]


# the engine's decoder layer puts a gated shared expert (Qwen3.5's) in moe_front's launch (its programs share the
# launch's num_warps): the sweep times it that way, so a launch that would spill those programs is not chosen
GATED_SHARED = bool(getattr(cfg, "shared_expert_intermediate_size", 0))
front_shared = [
    {"shared_expert": (rnd(I_S, H), rnd(I_S, H), rnd(I_S, H)), "acc": torch.zeros(H, device=DEV)}
    if GATED_SHARED
    else {}
    for _ in range(N)
]


def front_calls(kw):
    return [
        lambda i=i: moe_front(
            xs[i],
            res[i],
            nw[i],
            1e-6,
            KIND,
            wr[i],
            K,
            NORM_TOPK,
            wsg[i],
            tickets=tick,
            **GROUP,
            **front_shared[i],
            **kw,
        )
        for i in range(N)
    ]


def front_check(kw):
    err = 0.0
    for i in range(N):
        got = moe_front(xs[i], res[i], nw[i], 1e-6, KIND, wr[i], K, NORM_TOPK, wsg[i], tickets=tick, **GROUP, **kw)
        err = max(err, rel_err(got[2], ref_front[i][2]))
        if not torch.equal(got[4].sort(1).values, ref_front[i][4].sort(1).values):
            err = max(err, 1.0)
    return err


# with the shared expert in the launch its neurons a program (`shared_block`) set the registers of every program (the
# router's too): bf16 at 8 warps, sm_90, 4 neurons take 92 registers (two programs an SM), 2 take 62-64 (four)
FRONT_SPACE = {"block_e": [1, 2, 4, 8], "num_warps": [2, 4, 8]} | ({"shared_block": [1, 2, 4]} if GATED_SHARED else {})
results.append(sweep("moe_front", f"H{H}_E{E}_k{K}", FRONT_SPACE, front_calls, front_check))
# -- sparse_fused with the shared expert and the residual (at SPARSITY) ----------------------------------------------
EX = min(64, E)  # experts per weight set (the routed k drawn from them; 12 sets do not fit L2; Mixtral: its 8)
ew = [(rnd(EX, I, H, scale=0.05), rnd(EX, I, H, scale=0.05), rnd(EX, I, H, scale=0.05)) for _ in range(N)]
ids = [torch.randperm(EX, device=DEV)[:K].view(1, K) for _ in range(N)]
rws = [torch.softmax(torch.randn(1, K, device=DEV), -1).to(DT) for _ in range(N)]
sh = [
    SharedExpert(
        rnd(IS, H, scale=0.05), rnd(IS, H, scale=0.05), rnd(IS, H, scale=0.05), torch.rand(1, device=DEV).to(DT)
    )
    if I_S
    else None
    for _ in range(N)
]
taus = []
for i in range(N):
    gate = torch.nn.functional.silu(torch.einsum("h,eih->ei", xs[i][0].float(), ew[i][0].float())).abs()
    taus.append(torch.full((EX,), float(torch.quantile(gate.flatten()[: 1 << 20], SPARSITY)), device=DEV))
outs = [torch.empty(1, H, device=DEV, dtype=DT) for _ in range(N)]
ref_tail = [
    sparse_fused(xs[i], *ew[i], ids[i], rws[i], taus[i], outs[i].clone(), shared=sh[i], residual=res[i])[0]
    for i in range(N)
]


def tail_calls(kw):
    return [
        lambda i=i: sparse_fused(xs[i], *ew[i], ids[i], rws[i], taus[i], outs[i], shared=sh[i], residual=res[i], **kw)
        for i in range(N)
    ]


def tail_check(kw):
    return max(
        rel_err(
            sparse_fused(xs[i], *ew[i], ids[i], rws[i], taus[i], outs[i].clone(), shared=sh[i], residual=res[i], **kw)[
                0
            ],
            ref_tail[i],
        )
        for i in range(N)
    )


results.append(
    sweep("sparse_tail", f"H{H}_I{I}_k{K}", {"BLOCK_I": [4, 8, 16], "num_warps": [4, 8, 16]}, tail_calls, tail_check)
)

print("\n| kernel | shape | default µs | best µs | best launch | max rel diff vs default |")
print("|---|---|---:|---:|---|---:|")
out, fused = {}, {}
for name, key, default_us, rows in results:
    ok = [r for r in rows if r[2] < 1e-2]  # a different expert set counts 1.0
    if not ok:
        continue
    us, kw, err = ok[0]
    if us >= default_us:  # nothing beats the default launch: no entry (the default stays)
        print(f"| {name} | {key} | {default_us:.2f} | {us:.2f} | default kept | {err:.1e} |")
        continue
    print(f"| {name} | {key} | {default_us:.2f} | {us:.2f} | {kw} | {err:.1e} |")
    if name == "sparse_tail":  # sparse_fused's launch: the engine reads it from launch_params' "fused"
        fused[key] = {"fused": kw}
    else:
        out.setdefault(name, {})[key] = kw
o = os.environ.get("OUT")
if o:
    Path(o, "decode_params.json").write_text(json.dumps({"decode_params": out, "launch_params": fused}, indent=1))
