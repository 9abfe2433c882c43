"""The paths bench/bench_moe_block.py times for one MoE block at batch 1, and how it times them (a helper module of
that script, not run on its own).

Owns: a real transformers MoE block with random bf16 weights and localmoe's views of its experts (`make_block`),
the routing and the threshold calibration, `Timer` (CUDA-graph median on the GPU, wall clock in smoke mode), the
device copy bandwidth, and `Paths`: one family's rotating blocks and inputs with a builder per timed path
(transformers' experts, localmoe dense, localmoe fused, the offload variants, the whole block). Each builder returns
a function that runs every input once, for the timer.
"""

from __future__ import annotations

import time

import torch
import triton.testing

from localmoe.kernels.dense_experts import dense_experts
from localmoe.kernels.sparse_fused import sparse_fused

PROJECTIONS = ("w_gate", "w_up", "w_down_t")


class Timer:
    """Graph-captured median timing on CUDA; plain wall clock in smoke mode."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __call__(self, fn, n_inner: int) -> tuple[float, str]:
        """Median µs of one `fn()` call divided by n_inner (fn runs n_inner blocks); mode 'graph' or 'eager'."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6 / n_inner, "cpu"
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        mode = "graph"
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            run = graph.replay
            run()
            torch.cuda.synchronize()
        except Exception as exc:  # capture failed: time eagerly and say so
            print(f"    (graph capture failed: {type(exc).__name__}: {str(exc)[:120]}; timing eager)")
            torch.cuda.synchronize()
            run, mode = fn, "eager"
        ms = triton.testing.do_bench(run, warmup=10, rep=40, return_mode="median")
        return ms * 1e3 / n_inner, mode


def copy_bandwidth(cuda: bool) -> float:
    """Device copy GB/s counting bytes read + written."""
    if not cuda:
        return 1.0
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=50, return_mode="median")
    return 2 * n / (ms * 1e-3) / 1e9


def _block_class(family: str, H: int, I: int, E: int, k: int, SI: int):
    """(config, block class) of a family's MoE block: Qwen3.5's (with a shared expert of width SI) or Qwen3-MoE's."""
    if family == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig as Cfg
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock as Block

        kw = dict(shared_expert_intermediate_size=SI)
    else:
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig as Cfg
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        kw = dict(norm_topk_prob=True)
    return Cfg(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k, **kw), Block


def make_block(family, H, I, E, k, SI, dev):
    """A real transformers MoE block with random bf16 weights plus localmoe's weight views."""
    cfg, Block = _block_class(family, H, I, E, k, SI)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            blk = Block(cfg)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for p in blk.parameters():
            p.normal_(0.0, 0.02)
    blk.eval().requires_grad_(False)
    ex = blk.experts
    # localmoe layout: w_gate / w_up are row-contiguous views of gate_up_proj, w_down_t is down_proj transposed
    lw = dict(
        w_gate=ex.gate_up_proj[:, :I], w_up=ex.gate_up_proj[:, I:], w_down_t=ex.down_proj.transpose(1, 2).contiguous()
    )
    return cfg, blk, lw


def shared_part(blk, hs):
    """Shared expert (with its sigmoid gate) of a Qwen3.5 block; None when the family has none."""
    if not hasattr(blk, "shared_expert"):
        return None
    return torch.sigmoid(blk.shared_expert_gate(hs)) * blk.shared_expert(hs)


def route(blk, hs):
    _, rw, ids = blk.gate(hs)
    return ids, rw


def calibrate(blk, lw, H, sparsity, n_tok, dev):
    """tau: quantile of |g| over the routed experts of n_tok random tokens (one value per layer)."""
    xs = torch.randn(n_tok, H, device=dev, dtype=torch.bfloat16)
    ids, _ = route(blk, xs)
    w = lw["w_gate"]
    gs = []
    for c in range(0, n_tok, 16):
        wi = w[ids[c : c + 16].long()].float()  # [t,k,I,H]
        gs.append(torch.nn.functional.silu(torch.einsum("th,tkih->tki", xs[c : c + 16].float(), wi)).abs().flatten())
    a = torch.cat(gs)
    if a.numel() > 8_000_000:
        a = a[torch.randperm(a.numel(), device=a.device)[:8_000_000]]
    return float(torch.quantile(a.float(), sparsity)) if sparsity > 0 else 0.0


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _weights(lw) -> list[torch.Tensor]:
    return [lw[p] for p in PROJECTIONS]


class Paths:
    """One family's `sets` blocks of distinct weights and `sets * reps` batch-1 inputs rotating over them (L2 must
    not hold the working set), one zeroed sparse_fused workspace (allocated before any capture: launches in one
    graph run in order and each leaves it zeroed), and a builder per timed path."""

    def __init__(self, spec, sets: int, reps: int, dev: str, workspace_tokens: int):
        _, self.H, self.I, self.E, self.k, self.SI, family = spec
        self.dev, self.nsets, self.nin = dev, sets, reps * sets
        self.blocks = [make_block(family, self.H, self.I, self.E, self.k, self.SI, dev) for _ in range(sets)]
        self.xs = [torch.randn(1, self.H, device=dev, dtype=torch.bfloat16) for _ in range(self.nin)]
        self.routes = [route(self.block(i), self.xs[i]) for i in range(self.nin)]
        self.ws = torch.zeros(workspace_tokens * (self.H + self.k + 1), dtype=torch.int32, device=dev)

    def block(self, i: int):
        return self.blocks[i % self.nsets][1]

    def weights(self, i: int) -> dict:
        return self.blocks[i % self.nsets][2]

    def set_impl(self, impl: str) -> None:
        for cfg, _, _ in self.blocks:  # every block has its own config object
            cfg._experts_implementation = impl

    def inputs(self, T_inputs=None):
        return T_inputs if T_inputs else (self.xs, self.routes)

    def dense_experts(self, pd, T_inputs=None):
        xs, routes = self.inputs(T_inputs)
        bufs = [torch.empty(x.shape[0], self.H, device=self.dev) for x in xs]

        def fn():
            for i in range(len(xs)):
                dense_experts(xs[i], *_weights(self.weights(i)), *routes[i], out=bufs[i], **pd)

        return fn

    def hf_experts(self, impl, T_inputs=None):
        xs, routes = self.inputs(T_inputs)

        def fn():
            self.set_impl(impl)
            for i in range(len(xs)):
                self.block(i).experts(xs[i], *routes[i])

        return fn

    def fused_experts(self, tau, pf, T_inputs=None, out_dtype=torch.float32, accumulate=False):
        xs, routes = self.inputs(T_inputs)
        H, k, dev = self.H, self.k, self.dev
        bufs = []
        for x in xs:
            T = x.shape[0]
            if accumulate:  # y and count in one buffer: a single memset node clears both
                zb = torch.zeros(T * H + T * k, dtype=torch.int32, device=dev)
                bufs.append((zb, zb[: T * H].view(torch.float32).view(T, H), zb[T * H :].view(T, k)))
            else:
                y = torch.empty(T, H, device=dev, dtype=out_dtype)
                bufs.append((None, y, torch.empty(T, k, device=dev, dtype=torch.int32)))

        def fn():
            for i in range(len(xs)):
                zb, yb, cb = bufs[i]
                if accumulate:
                    zb.zero_()
                w = _weights(self.weights(i))
                sparse_fused(xs[i], *w, *routes[i], tau, yb, count=cb, accumulate=accumulate, workspace=self.ws, **pf)

        return fn

    def offload_inputs(self, tau_value: float, absent_share: float):
        """Per input: its k routed experts' master copies in (pinned) host memory as a k-expert layer, expert ids
        remapped to 0..k-1, and slot tables into the set's device weights (the pool, slot = original id):
        'mixed' with a random `absent_share` of the k experts absent (-1), 'resident' with none absent."""
        gen = torch.Generator().manual_seed(1)
        k, dev = self.k, self.dev
        n_abs = int(round(absent_share * k))
        out = []
        for i in range(self.nin):
            lw = self.weights(i)
            ids, rw = self.routes[i]
            orig = ids[0].long()
            masters = []
            for nm in PROJECTIONS:
                m = torch.empty((k, self.I, self.H), dtype=lw[nm].dtype, pin_memory=dev == "cuda")
                m.copy_(lw[nm][orig].cpu())
                masters.append(m)
            absent = torch.randperm(k, generator=gen)[:n_abs].to(dev)
            mixed = orig.clone()
            mixed[absent] = -1
            out.append(
                dict(
                    masters=masters,
                    ids=torch.arange(k, device=dev, dtype=ids.dtype)[None],
                    rw=rw,
                    orig=orig,
                    absent=absent,
                    tabs={"mixed": mixed, "resident": orig.clone()},
                    tau=torch.full((k,), tau_value, device=dev, dtype=torch.float32),
                )
            )
        return out

    def _outputs(self):
        return [
            (torch.empty(1, self.H, device=self.dev), torch.empty(1, self.k, device=self.dev, dtype=torch.int32))
            for _ in range(self.nin)
        ]

    def fused_offload(self, off, table: str, pf):
        """sparse_fused reading the absent experts from the pinned master copies through a slot table."""
        bufs = self._outputs()

        def fn():
            for i in range(self.nin):
                lw, o = self.weights(i), off[i]
                pools = dict(pool_gate=lw["w_gate"], pool_up=lw["w_up"], pool_down_t=lw["w_down_t"])
                sparse_fused(self.xs[i], *o["masters"], o["ids"], o["rw"], o["tau"], bufs[i][0], count=bufs[i][1],
                             slot_table=o["tabs"][table], workspace=self.ws, **pools, **pf)  # fmt: skip

        return fn

    def copy_then_compute(self, off, tau, pf):
        """What the expert cache does on a miss: copy the absent experts' three matrices host -> device (into their
        slots; here the set's own weights at the original ids, same bytes), then compute resident."""
        bufs = self._outputs()
        miss = [[(j, int(off[i]["orig"][j])) for j in off[i]["absent"].tolist()] for i in range(self.nin)]

        def fn():
            for i in range(self.nin):
                lw, o = self.weights(i), off[i]
                for j, e in miss[i]:
                    for nm, m in zip(PROJECTIONS, o["masters"]):
                        lw[nm][e].copy_(m[j], non_blocking=True)
                sparse_fused(self.xs[i], *_weights(lw), *self.routes[i], tau, bufs[i][0], count=bufs[i][1],
                             workspace=self.ws, **pf)  # fmt: skip

        return fn

    def whole(self, kind: str, params: dict, tau=None):
        """The whole block: transformers' (`kind` batched_mm / grouped_mm) or its router and shared expert with
        localmoe's experts (`dense`, `fused` at `tau`), `params` the launch parameters by path."""
        bufs = [(torch.empty(1, self.k, device=self.dev, dtype=torch.int32), torch.empty(1, self.H, device=self.dev))
                for _ in range(self.nin)]  # fmt: skip

        def fn():
            if kind in ("batched_mm", "grouped_mm"):
                self.set_impl(kind)
                for i in range(self.nin):
                    self.block(i)(self.xs[i][None])
                return
            for i in range(self.nin):
                blk, w, x = self.block(i), _weights(self.weights(i)), self.xs[i]
                sh = shared_part(blk, x)
                ids, rw = route(blk, x)
                cb, yb = bufs[i]
                if kind == "dense":
                    y = dense_experts(x, *w, ids, rw, out=yb, **params["dense"])
                else:
                    y, _ = sparse_fused(x, *w, ids, rw, tau, yb, count=cb, workspace=self.ws, **params["fused"])
                y = y if sh is None else y + sh
                y.to(torch.bfloat16)

        return fn
