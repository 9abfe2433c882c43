"""Offloaded prefill's staging spans filled by `gather_experts` (one launch per part) against a copy per expert and
part (the path memory-mapped or pageable master copies take), in one process (not a test; run on the H200).

Random weights at --shape, experts offloaded at --vram, sparsity 0.85: time to first token of random prompts of each
--prompt-tokens length, each way, --reps times (median), alternating; the engine's pieces are its own. Against the
PCIe ceiling as `bench --prompt-tokens` computes it (every absent expert part once per piece at the measured pinned
host-to-device bandwidth), then decode tok/s (512-token prompt, 128 tokens) after gathered prefills.
`--programs A,B` instead compares two grids of the gather (`kernels/gather_experts.PROGRAMS`; 0: one program a tile):
A in the "copies" columns, B in the "gather" ones; `--dequant-grid PxR,PxR` two grids of int4 / NF4 staging's
`kernels/gather_dequant.py` (PROGRAMS programs, BLOCK_R rows a tile, optionally xNUM_WARPS (4); the default 128x4).
`--packed` (int4 / NF4 experts) instead compares spans staged packed (a gather_experts launch per part, then three
dequantizing launches on the compute stream) in the "copies" columns against spans staged dequantized
(kernels/gather_dequant.py, the default) in the "gather" ones.
`--int4-in-place` instead compares int4 experts dequantized a span at a time before the grouped GEMMs ("copies")
against the GEMMs reading them in place (`DensePath.int4_staged_packed` offloaded, `DensePath.int4_in_place`
resident, "gather"); `--vram 0` too. `--packed-fill` (int4
offloaded, read in place in both) packed spans of the dequantized span's experts ("copies") against as many as the
staging buffers' memory holds (`Staging.packed_fill`, "gather").
`--cpu-share F` (full experts) compares every absent expert staged ("copies") against a share F of each layer's
computed on the CPU meanwhile (`Staging.cpu_share`, localmoe/experts/cpu_share.py, "gather"; `auto`: the share the
measured rates balance at each piece, the default); the PCIe column still counts every absent byte.
`--stage-layers` (int4 / NF4 experts) compares a layer's spans staged dequantized on the side stream span by span
("copies") against its absent experts staged packed a layer ahead and every span dequantized on the compute stream
(`Staging.stage_layers`, experts/layer_stage.py, the default for long pieces, "gather"; under each row, how its
runs took the layers: staged a layer ahead, as they start, or span by span, and the stage's span); `--stage-rows N`:
the stage takes pieces of at least N slots an expert (`Staging.stage_rows`; 0: every piece). `--stage-engines` the
stage filled by one gather_experts launch a projection (SMs reading pinned memory, "copies") against the copy
engines (`LayerStage.by_copy_engines`, experts/host_copies.py, the default, "gather").
`--joined-dequant` compares a staged span's three projections dequantized in a launch each ("copies") against one
launch (`kernels/gather_dequant.JOINED`, "gather").
`--span A,B` compares two staging spans (experts a buffer; 0: the engine's own), e.g. 60,64.
`--device-spans` instead compares the dense path with torch's grouped_mm and a host read of the routing each layer
("copies") against `DensePath.device_spans` (every expert in fixed spans, the group ends read on the device by
kernels/grouped_gate_up.py and grouped_gemm.py; "gather"); with `--vram 0` on the resident engine too.
`--deltanet A,B` instead compares two ways of the Gated DeltaNet prefill's delta rule, each PREPARE/PRECISION
(`FusedGatedDeltaNet.prefill_prepare`: the intra-chunk phase as torch ops, ~30 launches a layer, "split", ~7, or one
Triton launch;
`prefill_precision`: the dots' "ieee" or "tf32"), e.g. torch/ieee,triton/tf32: A in the "copies" columns,
B in the "gather" ones; `--vram 0` too. `--prefill-norms` instead compares transformers' decoder layer for prefill
("copies") against `FusedDecoderLayer.prefill_norms` (the layer's arithmetic with the fused norms; "gather").
`--prefill-block` instead compares transformers' MoE block for prefill against `FusedSparseMoeBlock.prefill_fused`
(F.linear + one top-k launch, the shared expert in the experts' last launch); `--prefill-attention` transformers'
attention module against `FusedAttention.prefill_fused` (decode/attention_prefill.py); `--prefill-all` the four
prefill switches off ("copies") against all on (split/ieee DeltaNet rule, fused norms, block and attention).

`--decode-first N` decodes N tokens after a 512-token prompt before the timed prompts (the cache as a chat's next
turn and `localmoe bench` find it).

Usage: PYTHONUNBUFFERED=1 python bench/staging_ab.py [--shape qwen3.5-35b] [--vram 24] [--experts full]
       [--prompt-tokens 2048,8192] [--reps 2] [--decode-first N] [--stage-rows N]
       [--programs 0,64 | --dequant-grid 128x4,256x8 | --packed
       | --cpu-share F | --stage-layers | --stage-engines | --joined-dequant | --span A,B
       | --device-spans | --int4-in-place
       | --packed-fill | --deltanet A,B | --prefill-norms | --prefill-block | --prefill-attention | --prefill-all]
"""

import argparse
import statistics

import torch

from localmoe.decode.attention import FusedAttention
from localmoe.decode.decoder_layer import FusedDecoderLayer
from localmoe.decode.deltanet import FusedGatedDeltaNet
from localmoe.decode.moe_layer import FusedSparseMoeBlock
from localmoe.decode.prefix import piece_cuts
from localmoe.devices import host_bandwidth
from localmoe.engine.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.experts.dense_path import DensePath
from localmoe.experts.layer_stage import LayerStage
from localmoe.experts.staging import Staging
from localmoe.kernels import gather_dequant, gather_experts

p = argparse.ArgumentParser()
p.add_argument("--shape", default="qwen3.5-35b")
p.add_argument("--vram", type=float, default=24)
p.add_argument("--experts", default="full")
p.add_argument("--prompt-tokens", default="2048,8192")
p.add_argument("--reps", type=int, default=2)
p.add_argument("--decode-first", type=int, default=0, help="decode N tokens (512-token prompt) before timing, as bench")
p.add_argument("--programs", default=None, help="A,B: two gather grids instead of copies against the gather")
p.add_argument("--packed", action="store_true", help="int4 / NF4: packed staging against dequantized staging")
p.add_argument("--device-spans", action="store_true", help="torch's grouped_mm against the device-side grouped GEMMs")
p.add_argument("--prefill-norms", action="store_true", help="the original layer against the fused norms in prefill")
p.add_argument("--prefill-block", action="store_true", help="the original MoE block against the fused one in prefill")
p.add_argument("--prefill-attention", action="store_true", help="the original attention against the fused one")
p.add_argument("--prefill-all", action="store_true", help="the four prefill switches off against on")
p.add_argument(
    "--dequant-grid", default=None, help="A,B: int4 / NF4 staging's gather_dequant PROGRAMSxBLOCK_R[xNUM_WARPS]"
)
p.add_argument("--int4-in-place", action="store_true", help="int4: spans dequantized against read in place")
p.add_argument("--cpu-share", default=None, help="full experts: no CPU share against this share (auto: the default)")
p.add_argument("--stage-layers", action="store_true", help="int4 / NF4: span by span against the layer stage")
p.add_argument("--joined-dequant", action="store_true", help="int4 / NF4: a span's projections in 3 launches or 1")
p.add_argument("--stage-rows", type=int, default=None, help="the layer stage's shortest piece, slots an expert")
p.add_argument("--stage-engines", action="store_true", help="the layer stage by the gather kernel or copy engines")
p.add_argument("--span", default=None, help="A,B: two staging spans (experts a buffer; 0: the engine's)")
p.add_argument("--packed-fill", action="store_true", help="int4 in place: packed spans as plain ones against full")
p.add_argument("--deltanet", default=None, help="A,B: two PREPARE/PRECISION ways of the DeltaNet prefill's rule")
a = p.parse_args()
if a.stage_rows is not None:
    Staging.stage_rows = a.stage_rows
lengths = [int(n) for n in a.prompt_tokens.split(",")]
grids = [int(n) for n in a.programs.split(",")] if a.programs else None
dq_grids = [(*map(int, w.split("x")), 4)[:3] for w in a.dequant_grid.split(",")] if a.dequant_grid else None
rules = [tuple(w.split("/")) for w in a.deltanet.split(",")] if a.deltanet else None
spans = [int(n) for n in a.span.split(",")] if a.span else None
fused_prefill = a.prefill_norms or a.prefill_block or a.prefill_attention or a.prefill_all

e = Engine.random(
    a.shape,
    device=torch.device("cuda"),
    dtype=torch.bfloat16,
    vram_gib=a.vram or None,
    context=max(lengths) + 64,
    experts=a.experts,
)
e.set_sparsity(0.85)
e.eos_ids = set()  # random weights: decode the full count
cache = e.loaded.cache
if cache is None and not (a.device_spans or rules or fused_prefill or a.int4_in_place):
    raise SystemExit(
        "--vram 0 (experts resident) compares --device-spans, --int4-in-place, --deltanet or --prefill-*: no staging"
    )
staging = cache.staging if cache is not None else None
plain = staging.plain if staging is not None else None
engine_span = staging.span if staging is not None else 0
if (a.packed or a.packed_fill) and plain is None:
    raise SystemExit("--packed / --packed-fill compare int4 / NF4 staging: give --experts int4 (nf4: --packed)")
if a.packed_fill:
    DensePath.int4_staged_packed = True
gen = torch.Generator().manual_seed(1)
vocab = e.loaded.config.vocab_size


def ttft(n: int, gather: bool) -> float:
    """Time to first token of a random n-token prompt; `gather` picks the B way (module doc), else the A way."""
    if grids:
        gather_experts.PROGRAMS = grids[int(gather)]
    elif dq_grids:
        gather_dequant.PROGRAMS, gather_dequant.BLOCK_R, gather_dequant.NUM_WARPS = dq_grids[int(gather)]
    elif a.joined_dequant:
        gather_dequant.JOINED = gather
    elif a.device_spans:
        for m in e.loaded.experts:
            m.device_spans = gather
    elif a.stage_layers or a.stage_engines:
        if a.stage_layers and Staging.stage_layers != gather:
            staging.settle(torch.device("cuda"))
            Staging.stage_layers = gather
        if a.stage_engines and LayerStage.by_copy_engines != gather:
            staging.settle(torch.device("cuda"))
            LayerStage.by_copy_engines = gather
    elif spans:
        staging.resize(spans[int(gather)] or engine_span)
    elif a.cpu_share is not None:
        Staging.cpu_share = (None if a.cpu_share == "auto" else float(a.cpu_share)) if gather else 0.0
    elif a.int4_in_place:
        DensePath.int4_in_place = DensePath.int4_staged_packed = gather
    elif rules:
        FusedGatedDeltaNet.prefill_prepare, FusedGatedDeltaNet.prefill_precision = rules[int(gather)]
    elif a.prefill_norms:
        FusedDecoderLayer.prefill_norms = gather
    elif a.prefill_block:
        FusedSparseMoeBlock.prefill_fused = gather
    elif a.prefill_attention:
        FusedAttention.prefill_fused = gather
    elif a.prefill_all:
        FusedDecoderLayer.prefill_norms = FusedSparseMoeBlock.prefill_fused = FusedAttention.prefill_fused = gather
        FusedGatedDeltaNet.prefill_prepare = "split" if gather else "torch"
    elif a.packed_fill:
        if Staging.packed_fill != gather:  # the packed views: made again at the next use
            staging.settle(torch.device("cuda"))
            Staging.packed_fill, staging.packed_buffers = gather, None
    elif a.packed:
        if (staging.plain is not None) != gather:  # the other buffers: made again at the next use
            staging.settle(torch.device("cuda"))
            staging.plain, staging.buffers = (plain if gather else None), None
    else:
        staging.gathers = {} if gather else dict.fromkeys(e.loaded.cache.masters, False)
    prompt = torch.randint(0, vocab, (n,), generator=gen).tolist()
    for _ in e.generate(prompt, GenerationSettings(max_new_tokens=1)):
        pass
    return e.stats.ttft_s


for gather in (True, False):  # warm-up: compile and allocate both ways
    ttft(min(lengths), gather)
if a.decode_first:  # the cache as a chat's next turn (or `localmoe bench`) finds it: decode admitted experts
    for _ in e.generate(
        torch.randint(0, vocab, (512,), generator=gen).tolist(), GenerationSettings(max_new_tokens=a.decode_first)
    ):
        pass
h2d = host_bandwidth(torch.device("cuda"))
print(
    f"{a.shape} --experts {a.experts} --vram {a.vram:g}, sparsity 0.85, median of {a.reps}, "
    f"pinned H2D {h2d / 1e9:.1f} GB/s"
)
if grids:
    print(f"'copies': gather_experts.PROGRAMS = {grids[0]}, 'gather': {grids[1]}")
if dq_grids:
    print(f"gather_dequant PROGRAMSxBLOCK_R, 'copies': {a.dequant_grid}".replace(",", ", 'gather': "))
if a.stage_layers:
    print("'copies': int4 / NF4 spans staged dequantized span by span; 'gather': the layer stage")
if a.stage_engines:
    print("'copies': the layer stage filled by gather_experts; 'gather': by the copy engines")
if spans:
    print(f"staging span (experts a buffer) 'copies': {spans[0] or engine_span}, 'gather': {spans[1] or engine_span}")
if a.cpu_share is not None:
    print(f"'copies': every absent expert staged; 'gather': a share of {a.cpu_share} computed on the CPU")
if a.int4_in_place:
    print("'copies': int4 spans dequantized, then grouped GEMMs; 'gather': grouped GEMMs reading int4 in place")
if a.packed_fill:
    print("'copies': int4 packed spans of the dequantized span's experts; 'gather': as many as the buffers hold")
if a.packed:
    print("'copies': spans staged packed, then dequantized; 'gather': staged dequantized (gather_dequant)")
if a.prefill_norms:
    print("'copies': transformers' decoder layer for prefill; 'gather': its arithmetic with the fused norms")
if a.prefill_block:
    print("'copies': transformers' MoE block for prefill; 'gather': FusedSparseMoeBlock.prefill_fused")
if a.prefill_attention:
    print("'copies': transformers' attention for prefill; 'gather': FusedAttention.prefill_fused")
if a.prefill_all:
    print("'copies': the prefill switches off; 'gather': split DeltaNet rule, fused norms, MoE block, attention")
if a.device_spans:
    print("'copies': torch's grouped_mm, the routing read on the host; 'gather': device_spans (no host read)")
if rules:
    print(f"DeltaNet prefill (prepare/precision) 'copies': {a.deltanet}".replace(",", ", 'gather': "))
print("prompt  copies TTFT s  tok/s   gather TTFT s  tok/s   speed-up  PCIe s  of PCIe (gather)")
for n in lengths:
    t = {True: [], False: []}
    if staging is not None and staging.stage is not None:
        staging.stage.counts.clear()
    for _ in range(a.reps):
        for gather in (False, True):
            t[gather].append(ttft(n, gather))
    c, g = statistics.median(t[False]), statistics.median(t[True])
    pcie = (len(piece_cuts(0, n, e.prefill_chunk)) - 1) * cache.absent_bytes() / h2d if cache is not None else 0.0
    print(
        f"{n:>6}  {c:>13.3f}  {n / c:>5.0f}   {g:>13.3f}  {n / g:>5.0f}   {c / g:>7.2f}x  "
        f"{pcie:>6.2f}  {pcie / g:>6.1%}",
        flush=True,
    )
    if a.stage_layers and staging.stage is not None:  # how the stage took the layers of these runs
        k = staging.stage.counts
        print(f"        layer stage: spans of {staging.stage.span} experts; layers staged a layer ahead "
              f"{k['ahead']}, as they start {k['at start']}, span by span {k['spans']}", flush=True)  # fmt: skip
if staging is not None and staging.rates is not None:  # the automatic CPU share's, where it ran
    r, k = staging.rates, e.loaded.config.num_experts_per_tok
    shares = ", ".join(f"{n}: {r.share(min(n, e.prefill_chunk) * k / cache.num_experts):.3f}" for n in lengths)
    print(f"CPU share rates: PCIe {r.pcie * 1e3:.3f} ms an expert, CPU {r.fixed * 1e3:.3f} ms + {r.row * 1e6:.1f} us"
          f" a row; share at {shares}")  # fmt: skip
    synced, busy, waited = staging.cpu_seconds
    print(f"CPU share over the run: host syncs {synced:.3f} s, worker {busy:.3f} s, waited for it {waited:.3f} s")
prompt = torch.randint(0, vocab, (512,), generator=gen).tolist()
for _ in e.generate(prompt, GenerationSettings(max_new_tokens=128)):
    pass
print(f"decode {e.stats.decode_tok_s:.1f} tok/s")
