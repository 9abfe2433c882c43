"""localmoe's experts module: the parameter-free stand-in for a transformers MoE block's `experts`.

Same call as transformers' unified experts interface: `experts(hidden [T,H], top_k_index [T,k],
top_k_weights [T,k]) -> [T,H]`; the routing weights are final and applied after `down`.
Weights live in an `ExpertWeights` owned by the expert store (filled by the loader), not in parameters,
so transformers never loads, moves or saves them.

Two paths:
- dense (prefill, many tokens, or sparsity off): the tokens grouped by expert, three grouped GEMMs (torch's
  grouped_mm) for all experts at once; a loop of per-expert matmuls where torch has no grouped GEMM for the
  device / dtype, or the experts are offloaded;
- sparse (decode, T <= `max_sparse_tokens`): gate computed densely, neurons with |act(x·W_gate)| < τ skipped,
  only the kept rows of W_up and W_down_t read. On CUDA this is ONE launch of `localmoe.kernels.sparse_fused`
  (gate, mask, kept up/down, the kept-neuron count added in its tail; offloaded experts read from the cache pool or
  host memory by the same kernel); elsewhere the torch reference below (same arithmetic, gathers only kept rows).
  The two-kernel split (`sparse_gate` + `sparse_updown`) stays in `kernels/` as the benchmarked alternative: its
  kernels are as fast, but with the count it costs four launches per layer to this path's one.
  With a department-shared gate predictor (`predictor`, `--departments N`; experts/predicted.py) the sparse path
  reads only the predicted candidates' gate rows: on CUDA two launches, `kernels.gate_predictor.department_basis`
  (z_d = B_d x once per touched department) then `sparse_fused` with its predictor (candidates from C_e z_d, then
  their gate rows, kept up/down rows; int4 too), resident or offloaded with direct misses, inside the CUDA graph;
  elsewhere the torch reference `predicted_reference` (resident only), and evaluation's masked grouped path keeps
  candidates with |g| >= τ.

GPT-OSS's experts (`swiglu`: its clamped SwiGLU, `biases`: its expert biases; experts/clamped_swiglu.py) take the
same paths with their biases added and their activation: the dense ones as they are (MXFP4 experts dequantized a span
at a time, like int4); decode on CUDA in ONE launch of `localmoe.kernels.mxfp4_sparse` (sparse, or at threshold 0
with sparsity off; resident, from the cache's slots, or with direct misses from the host copies), elsewhere the torch
reference `sparse_reference` with biases.

Shapes: T = tokens, k = experts per token, E = experts, I = expert width, H = hidden.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from localmoe.experts.clamped_swiglu import (
    CLAMPED_SWIGLU,
    ClampedSwiGLU,
    ExpertBiases,
)
from localmoe.experts.dense_path import DensePath
from localmoe.experts.expert_weights import ExpertWeights
from localmoe.experts.gate_recorder import GateRecorder
from localmoe.experts.mxfp4_path import Mxfp4Path, tail_kw
from localmoe.experts.predicted import LayerPredictor, predicted_reference
from localmoe.experts.sparse_reference import sparse_reference
from localmoe.kernels.dense_experts import dense_experts
from localmoe.kernels.gate_predictor import GatePredictor, department_basis
from localmoe.kernels.sparse_fused import sparse_fused
from localmoe.kernels.tuning import launch_params


class LocalExperts(DensePath, Mxfp4Path, nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        layer_idx: int,
        swiglu: tuple[float, float] | None = None,
    ):
        """`swiglu` (alpha, limit): GPT-OSS's clamped SwiGLU instead of `hidden_act` (experts/clamped_swiglu.py)."""
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.layer_idx = layer_idx
        self.hidden_act = CLAMPED_SWIGLU if swiglu else hidden_act
        self.act_fn = ClampedSwiGLU(*swiglu) if swiglu else ACT2FN[hidden_act]
        self.up_fn = self.act_fn.up if swiglu else None  # the up projection's clamp and + 1 (GPT-OSS), or None
        self.biases: ExpertBiases | None = None  # GPT-OSS: the experts' biases on the compute device (by expert id)
        self._host_biases: ExpertBiases | None = None  # their copy in host memory (cpu misses compute there)
        self.weights: ExpertWeights | None = None  # all experts (resident), or the host master copies when offloaded
        self.cache = None  # localmoe.experts.cache.ExpertCache when experts are offloaded
        self.last_routing = None  # direct/cpu-miss modes: what the last decode call routed to (for the cache)
        self._zero_tau: torch.Tensor | None = None
        # sparse path state, set by the engine / sparsity module
        self.tau: torch.Tensor | None = None  # [E] float32 threshold per expert (per-layer τ broadcast)
        self.target_sparsity = 0.0  # the sparsity tau was calibrated for (launches tuned by band: `tuned_at`)
        self.sparse_enabled = False
        self.max_sparse_tokens = 1
        self.mask_all_tokens = False  # evaluation: apply the sparse mask on the grouped path too (same function)
        self.recorder: GateRecorder | None = None
        self.predictor: LayerPredictor | None = None  # department-shared gate predictor (--departments), or None
        self._params: dict | None = None  # tuned launch parameters (CUDA), looked up once
        self.kernel_on_cpu = False  # tests: take the Triton path on CPU tensors too (TRITON_INTERPRET=1)
        # sparsity off, one decode token: True (default) runs sparse_fused at threshold 0 (the dense math) where the
        # caller hands a tail (Qwen3.5: moe_front before it with the shared expert, the residual add in its tail);
        # False: dense_experts, the caller does the shared expert. H200, Qwen3.5-35B shapes, whole step at 0 %
        # (bench/step_ab.py, session 7): 2392 µs against 2558 (session 4, before PDL early loads: 3065 against 3022).
        self.dense_tail = True
        self.grouped = True  # dense calls through torch's grouped GEMM where it can (`_groups`); False: the loop
        self.dequant_bytes: int | None = None  # resident 4-bit experts: bytes a dequantized span (None: DEQUANT_BYTES)
        self.kept = torch.zeros((), dtype=torch.int64)  # kept neurons on the sparse path (updated in place)
        self.seen = 0  # neurons considered on the sparse path (host int; a CUDA graph's replays add theirs)

    def extra_repr(self) -> str:
        return (
            f"E={self.num_experts}, H={self.hidden_size}, I={self.intermediate_size}, act={self.hidden_act}, "
            f"sparse={self.sparse_enabled}"
        )

    @property
    def tau_groups(self) -> int:
        """Entries of `tau` (and of calibration's per-expert samples and routing counts): one per expert."""
        return self.num_experts

    def reset_counters(self) -> None:
        self.kept.zero_()
        self.seen = 0
        if self.predictor is not None:
            self.predictor.reset()

    def _kept_on(self, device) -> torch.Tensor:
        """The kept-neuron counter on `device` (moved there on the first decode step, before any graph capture)."""
        if self.kept.device != torch.device(device):
            self.kept = self.kept.to(device)
        return self.kept

    def _count(self, kept: torch.Tensor, neurons: int) -> None:
        self._kept_on(kept.device).add_(kept)  # in place: a captured CUDA graph keeps counting on replay
        self.seen += neurons

    def takes_tail(self, hidden_states: torch.Tensor) -> bool:
        """Whether a call on these tokens runs `sparse_fused` (sparse, or offloaded with direct misses), so it can
        take `tail=` (the shared expert and the residual add in the same launch); GPT-OSS's: `sparse_mxfp4` (the
        residual add)."""
        if not (
            self._few(hidden_states.shape[0])
            and self.weights is not None
            and (hidden_states.is_cuda or self.kernel_on_cpu)
        ):
            return False
        if self.hidden_act != "silu":  # GPT-OSS: its MXFP4 launch takes the residual add (it has no shared expert)
            modes = (None, "direct", "copy")
            return self._mxfp4_kernel(hidden_states) and (self.cache.mode if self.cache else None) in modes
        sparse = self.sparse_enabled and self.tau is not None
        if sparse and self.predictor is not None and not self.predictor_fused(hidden_states.device):
            return False  # the predictor's torch reference runs instead
        if self.cache is None:
            return sparse or self.dense_tail
        return self.cache.mode == "direct" or (self.cache.mode == "copy" and (sparse or self.dense_tail))

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        *,
        tail=None,
        shared=None,
        z=None,
    ):
        """transformers' experts call; `tail` (a `kernels.sparse_fused.Tail`, only where `takes_tail` holds) adds
        the shared expert and the residual inside the same launch; `shared` ((s [T, H], gate logit [T, 1] or None),
        only where `takes_shared` holds: a prompt piece) adds the shared expert in the dense path's last launch;
        `z` ([1, N, r] fp32, only where `front_basis` gave the maps): the gate predictor's stage 1, computed by the
        caller's launch (kernels/moe_front.py `basis=`) instead of `department_basis`."""
        if self.weights is None:
            raise RuntimeError(f"layer {self.layer_idx}: expert weights were not loaded")
        if shared is not None:
            if tail is not None or not self.takes_shared(hidden_states, top_k_index):
                raise ValueError(f"layer {self.layer_idx}: this call does not run the device dense path, no shared=")
            return self._dense(hidden_states, top_k_index, top_k_weights, shared=shared)
        if tail is not None and not self.takes_tail(hidden_states):
            raise ValueError(f"layer {self.layer_idx}: this call does not run sparse_fused, it cannot take a tail")
        few = self._few(hidden_states.shape[0])
        sparse = few and self.sparse_enabled and self.tau is not None
        if sparse and self.predictor is not None and not self.predictor_fused(hidden_states.device):
            if self.cache is not None:
                raise RuntimeError(f"layer {self.layer_idx}: the gate predictor reads offloaded experts on CUDA only")
            return self._predicted(hidden_states, top_k_index, top_k_weights)
        if tail is None and few and self.cache is not None and self.cache.mode == "cpu":
            return self._split(hidden_states, top_k_index, top_k_weights, sparse)
        if tail is None and not (sparse or (few and self._decode_kernel(hidden_states))):
            return self._dense(hidden_states, top_k_index, top_k_weights)
        if self.cache is not None and self.cache.mode == "direct":
            return self._direct(hidden_states, top_k_index, top_k_weights, sparse, tail, z)
        if self._mxfp4_kernel(hidden_states):  # GPT-OSS: its one launch, resident or from the cache's slots
            if self.cache is not None:
                self.cache.fetch(self.layer_idx, sorted(set(top_k_index.reshape(-1).tolist())))
            return self._mxfp4(hidden_states, top_k_index, top_k_weights, sparse, tail=tail)
        w, ids, tau = self.weights, top_k_index, self.tau
        if self.cache is not None:  # offloaded: compute from cache slots (misses copied in first)
            w, ids = self.cache.pool, self.cache.slot_ids(self.layer_idx, top_k_index)
            if tau is not None:
                tau = self.cache.slot_tau(ids, top_k_index, tau)
        if sparse:
            return self._sparse(hidden_states, ids, top_k_weights, w, tau, tail, experts=top_k_index, z=z)
        if tail is not None:  # sparsity off: the dense math in the tail-taking kernel, threshold 0 keeps every neuron
            zeros = self._zeros_tau(hidden_states.device, w.w_gate.shape[0])  # [experts or pool slots]
            return self._sparse(hidden_states, ids, top_k_weights, w, zeros, tail, count=False)
        return self._dense_decode(hidden_states, ids, top_k_weights, w, top_k_index)

    def predictor_fused(self, device) -> bool:
        """Whether the gate predictor (when set) runs in the fused kernels on `device` (silu experts, full
        precision or int4/nf4, CUDA or the interpreter with `kernel_on_cpu`); else its torch reference."""
        w = self.weights
        on = torch.device(device).type == "cuda" or self.kernel_on_cpu
        return on and self.hidden_act == "silu" and w is not None and (w.int4 or not w.quantized)

    def front_basis(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The gate predictor's stage-1 maps (B [N, r, H] int8, B_scale [N, r]) when a one-token decode call on x's
        device runs it in the fused kernels, so the caller's launch may compute z for every department and pass it
        as `forward(z=)`; else None."""
        p = self.predictor
        if p is None or not (self._few(1) and self.sparse_enabled and self.tau is not None):
            return None
        return (p.B, p.B_scale) if self.predictor_fused(x.device) else None

    def _few(self, T: int) -> bool:
        """Whether a call of T tokens is decode-sized: the sparse / fused kernels' path (no recorder, no mask-all)."""
        return T <= self.max_sparse_tokens and self.recorder is None and not self.mask_all_tokens

    def _predictor_kw(self, x: torch.Tensor, experts: torch.Tensor, z: torch.Tensor | None = None) -> dict:
        """sparse_fused's `predictor=` for this call (stage 1 launched here, z_d = B_d x per touched department,
        unless the caller computed `z`), or {} without a predictor. `experts` [T, k]: the expert ids (the kernel's
        ids may be cache slots)."""
        p = self.predictor
        if p is None:
            return {}
        if z is None:
            z = department_basis(x, p.B, p.B_scale, p.dept_of, experts)
        return {"predictor": GatePredictor(z, p.C, p.C_scale, p.dept_of, p.tau_rows, experts=experts)}

    @property
    def direct_misses(self) -> bool:
        """Whether offloaded misses can be read in place from host memory by a fused kernel ("direct"): silu experts'
        sparse_fused, GPT-OSS's MXFP4 experts' sparse_mxfp4."""
        return self.hidden_act == "silu" or (self.up_fn is not None and self.weights is not None and self.weights.mxfp4)

    def _decode_kernel(self, x: torch.Tensor) -> bool:
        """Whether a decode-sized call with sparsity off runs a kernel: silu experts' dense decode kernel (CUDA),
        GPT-OSS's MXFP4 experts' sparse one at threshold 0 (`_mxfp4_kernel`)."""
        return (x.is_cuda and self.hidden_act == "silu") or self._mxfp4_kernel(x)

    @torch.compiler.disable
    def _direct(self, x, top_k_index, top_k_weights, sparse: bool, tail=None, z=None) -> torch.Tensor:
        """Offloaded, direct misses: one fused launch reads resident experts from the cache pool and absent ones
        (gate rows + kept rows only) from the host master copies. Routing and counts are kept for `observe`."""
        if self.up_fn is not None:  # GPT-OSS: its own kernel reads absent experts in place too
            self.last_routing = top_k_index
            return self._mxfp4(x, top_k_index, top_k_weights, sparse, direct=True, tail=tail)
        tau = self.tau if sparse else self._zeros_tau(x.device)
        c, m = self.cache, self.weights
        p = self._launch(x, top_k_index.shape[1])["fused"] if x.is_cuda else {}
        y, _ = sparse_fused(
            x,
            m.w_gate,
            m.w_up,
            m.w_down_t,
            top_k_index,
            top_k_weights,
            tau,
            torch.empty(x.shape, dtype=x.dtype, device=x.device),
            slot_table=c.tables[self.layer_idx],
            pool_gate=c.pool.w_gate,
            pool_up=c.pool.w_up,
            pool_down_t=c.pool.w_down_t,
            gate_table=c.gate_tables.get(self.layer_idx),
            kept_total=self._kept_on(x.device) if sparse else None,
            host_rows=c.host_rows,
            read_rows=c.read_rows,
            **tail_kw(tail),
            **(self._predictor_kw(x, top_k_index, z) if sparse else {}),
            **p,
        )
        self.last_routing = top_k_index  # graph replays rewrite this tensor in place
        if sparse:
            self.seen += top_k_index.numel() * self.intermediate_size
        return y

    def _zeros_tau(self, device, n: int | None = None) -> torch.Tensor:
        n = self.num_experts if n is None else n
        if self._zero_tau is None or self._zero_tau.device != torch.device(device) or self._zero_tau.numel() < n:
            self._zero_tau = torch.zeros(n, dtype=torch.float32, device=device)
        return self._zero_tau[:n]

    def _split(self, x, top_k_index, top_k_weights, sparse: bool) -> torch.Tensor:
        """Offloaded, CPU misses: resident experts run on the device from the cache pool while absent ones are
        computed on the CPU from the host master copies (x goes down, y comes back; no weights cross PCIe)."""
        c, layer, I = self.cache, self.layer_idx, self.intermediate_size
        tau = self.tau if sparse else self._zeros_tau(x.device)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for t, row in enumerate(top_k_index.tolist()):
            live = [(layer, e) in c.lru and (layer, e) not in c.pending for e in row]  # pending: still copying
            hit = [j for j, ok in enumerate(live) if ok]
            miss = [j for j, ok in enumerate(live) if not ok]
            if hit:
                j = torch.tensor(hit, device=x.device)
                experts = top_k_index[t, j]
                slots = c.tables[layer][experts]
                pool_tau = c.slot_tau(slots, experts, tau)
                out[t] += self._sparse(
                    x[t : t + 1], slots[None], top_k_weights[t, j][None], c.pool, pool_tau, experts=experts[None]
                )[0].float()
            if miss:
                j = torch.tensor(miss)
                experts = top_k_index[t].cpu()[j]
                y, kept = sparse_reference(
                    x[t : t + 1].cpu(),
                    self.weights,
                    experts[None],
                    top_k_weights[t].cpu()[j][None],
                    tau.cpu(),
                    self.act_fn,
                    biases=self._biases_on_host(),
                    up_fn=self.up_fn,
                )
                out[t] += y[0].to(x.device)
                self._count(kept.to(self.kept.device), len(miss) * I)
        self.last_routing = top_k_index
        return out.to(x.dtype)

    def _launch(self, x: torch.Tensor, k: int) -> dict:
        if not x.is_cuda:
            return {"fused": {}, "fused_pred": {}, "dense": {}}
        if self._params is None:
            self._params = launch_params(
                torch.cuda.get_device_name(x.device),
                self.hidden_size,
                self.intermediate_size,
                k,
                int4=self.weights.int4,
            )
        return self._params

    @torch.compiler.disable  # Triton launches stay opaque to dynamo (graph break; the CUDA graph still holds them)
    def _dense_decode(self, x, top_k_index, top_k_weights, w: ExpertWeights, experts=None):
        """Few tokens, sparsity off, CUDA: localmoe's dense decode kernel (no host sync); int4 experts take the fused
        sparse kernel at threshold 0 (the dense kernel reads full-precision weights only), GPT-OSS's experts their
        sparse path at threshold 0 (`experts`: the expert ids when `top_k_index` holds cache slots)."""
        if w.quantized or self.up_fn is not None:
            zeros = self._zeros_tau(x.device, w.w_gate.shape[0])
            return self._sparse(x, top_k_index, top_k_weights, w, zeros, count=False, experts=experts)
        p = self._launch(x, top_k_index.shape[1])["dense"]
        return dense_experts(x, w.w_gate, w.w_up, w.w_down_t, top_k_index, top_k_weights, **p).to(x.dtype)

    # -- sparse: decode ---------------------------------------------------------------------------------
    @torch.compiler.disable
    def _sparse(
        self,
        x,
        top_k_index,
        top_k_weights,
        w: ExpertWeights,
        tau: torch.Tensor,
        tail=None,
        count: bool = True,
        experts=None,
        z=None,
    ) -> torch.Tensor:
        """`count`: add the kept neurons to the sparsity stats (False: threshold 0, the dense path with a tail);
        `experts`: the expert ids [T, k] when `top_k_index` holds cache slots (biases are indexed by expert)."""
        if (x.is_cuda or self.kernel_on_cpu) and self.hidden_act == "silu":  # one launch, output in x's dtype
            p = self._launch(x, top_k_index.shape[1])["fused_pred" if count and self.predictor is not None else "fused"]
            y, _ = sparse_fused(
                x,
                w.w_gate,
                w.w_up,
                w.w_down_t,
                top_k_index,
                top_k_weights,
                tau,
                torch.empty(x.shape, dtype=x.dtype, device=x.device),
                kept_total=self._kept_on(x.device) if count else None,
                **tail_kw(tail),
                **(self._predictor_kw(x, top_k_index if experts is None else experts, z) if count else {}),
                **p,
            )
            if count:
                self.seen += top_k_index.numel() * self.intermediate_size
            return y
        y, kept = sparse_reference(
            x, w, top_k_index, top_k_weights, tau, self.act_fn, biases=self.biases, experts=experts, up_fn=self.up_fn
        )
        if count:
            self._count(kept, top_k_index.numel() * self.intermediate_size)
        return y.to(x.dtype)

    @torch.compiler.disable
    def _predicted(self, x, top_k_index, top_k_weights) -> torch.Tensor:
        """The sparse path through the gate predictor (experts/predicted.py's stages 1-3; torch reference)."""
        if self.biases is not None:
            raise RuntimeError(f"layer {self.layer_idx}: the gate predictor does not take GPT-OSS's expert biases")
        y, kept = predicted_reference(
            x, self.weights, top_k_index, top_k_weights, self.tau, self.act_fn, self.predictor
        )
        self._count(kept, top_k_index.numel() * self.intermediate_size)
        return y.to(x.dtype)
