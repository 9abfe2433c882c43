"""The MoE decode block: the softmax-top-k MoE block for one token (fused router, localmoe's experts, fused shared
expert; or, from a decoder layer (decode/decoder_layer.py), `moe_front` (with the shared expert, if any) + the
experts' `sparse_fused` with the residual add in its tail). Installed by `localmoe.decode.replacements`. A prompt
piece runs the block's own few launches (`FusedSparseMoeBlock.prefill_fused`, on by default): the router's GEMM and
one top-k launch, the shared expert's SwiGLU GEMM, down GEMM and gate GEMV, added in the experts' last launch.

GraniteMoE: the block is the layer's `block_sparse_moe` (not `mlp`) and its router `router` (not `gate`); its router
(top-k of the logits, softmax over those k) is the renormalised softmax top-k (the same weights up to fp32 rounding).
Its layer scales both branches by `residual_multiplier` m before each residual add, both inside moe_front
(`x_scale`, `w_scale`): the attention branch rounded as transformers' `h * m` before the add, so s = residual + h·m
is transformers' value, and the MoE branch by m folded into the k routing weights (sparse_fused then adds residual
+ Σ (w_i·m)·expert_i: equal to transformers' residual + (Σ w_i·expert_i)·m up to fp32 rounding). So as many launches
as Qwen3-MoE's layer (two more before, the multiplies).

GPT-OSS: the block is GptOssMLP (its router `router`, with a bias: router_topk's `bias`; top-k of the logits and a
softmax over them, the renormalised softmax top-k). Its layer: residual add + post-attention norm 1 launch, router 1,
the experts module (LocalExperts: MXFP4 on sparse_mxfp4), the residual add 1; with `bias_in_front` (the default)
moe_front adds the router's bias and sparse_mxfp4 the residual: 2 launches, as a layer whose experts take
sparse_fused's residual tail.

Shape legend: B batch, T tokens, H hidden, E experts, k experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from localmoe.decode.ops import FusedLinear, FusedRMSNorm
from localmoe.kernels.grouped_gate_up import grouped_gate_up
from localmoe.kernels.moe_front import moe_front
from localmoe.kernels.router_topk import router_topk, router_topk_of_logits
from localmoe.kernels.shared_expert import shared_expert
from localmoe.kernels.token_tail import SharedExpert, Tail, fused_workspace
from localmoe.kernels.tuning import tuned

# router class -> renormalises the top-k weights (True), or per its `norm_topk_prob` (None). DeaMoE's router is
# group-limited (`group_size` experts per department, `topk_group` departments allowed): router_topk's group mode
_ROUTERS: dict[str, bool | None] = {
    "Qwen3_5MoeTopKRouter": True,
    "Qwen3MoeTopKRouter": None,
    "OlmoeTopKRouter": None,
    "DeaMoeRouter": None,
    "MixtralTopKRouter": True,  # softmax (fp32) -> top-k -> renormalise; its weights stay fp32 (here: x's dtype)
    "GraniteMoeTopKRouter": True,  # top-k of the logits, softmax over the k: the renormalised softmax top-k
    "DeepseekV2TopkRouter": False,  # fp32 weight, softmax top-k (group-limited: n_group), x routed_scaling_factor
    "GptOssTopKRouter": True,  # logits + bias (router_topk's `bias`), top-k, softmax over the k: renormalised
}
# routers whose prompt-piece routing `FusedSparseMoeBlock.prefill` reproduces: logits one F.linear in x's dtype, then
# the softmax top-k (group-limited for DeaMoE) with the weights cast to x's dtype
_PREFILL_ROUTERS = {"Qwen3_5MoeTopKRouter", "Qwen3MoeTopKRouter", "OlmoeTopKRouter", "DeaMoeRouter"}
_ROUTER_NAMES = ("gate", "router")  # the block's router child: Qwen/OLMoE/Mixtral/DeaMoE `gate`, GraniteMoE `router`
BLOCK_NAMES = ("mlp", "block_sparse_moe")  # the decoder layer's MoE block: GraniteMoE's is `block_sparse_moe`


def _group_kw(gate: nn.Module) -> dict | None:
    """router_topk's group-limited keywords for a DeaMoE router or DeepSeek-V2's `group_limited_greedy` ({} for the
    plain ones); None when the kernel cannot route it (a department score other than the best expert's, another
    DeepSeek top-k method)."""
    if type(gate).__name__ == "DeepseekV2TopkRouter":
        method = getattr(gate, "topk_method", "greedy")
        if method == "greedy":
            return {}
        if method != "group_limited_greedy":
            return None
        return {"group_size": int(gate.num_experts) // int(gate.num_group), "topk_group": int(gate.topk_group)}
    if type(gate).__name__ != "DeaMoeRouter":
        return {}
    if getattr(gate, "score", "max") != "max":
        return None
    return {"group_size": int(gate.per_department), "topk_group": int(gate.topk_group)}


class FusedSparseMoeBlock(nn.Module):
    """A softmax-top-k MoE block (Qwen3.5 with its sigmoid-gated shared expert; Qwen3-MoE / OLMoE / Mixtral /
    GraniteMoE without; DeaMoE and its Qwen3.5 twin, group-limited, their experts DepartmentExperts) whose
    one-token call is: fused router (1 launch) -> the block's `experts` module, called as transformers calls it ->
    fused shared expert (2 launches, the add into the routed output included). A prompt piece runs `prefill` when
    `prefill_fused` is on; other calls run the original block."""

    # A prompt piece through the block's own launches (`prefill`): the router's GEMM and one top-k launch, the shared
    # expert's gate | up GEMM with its SwiGLU (grouped_gate_up over one group of every token), its down GEMM and gate
    # GEMV, added in the experts' last launch (kernels/token_combine.py): 6 launches where transformers' Qwen3.5
    # block takes 15 around the experts (the tiny models of tests/test_fused_model.py); the numerics are the decode
    # step's (fp32 sums inside one kernel). On by default: alone 1.00x TTFT (`bench/staging_ab.py --prefill-block`,
    # H100, int4 at --vram 16, 2048 tokens), with the other three prefill switches 1.09x (`--prefill-all`).
    prefill_fused = True
    # step_front with the experts' gate predictor (issue #23): its stage 1 (z = B_d h for every department) in
    # moe_front's launch; False: `department_basis`'s own launch between the router and the experts
    basis_in_front = True
    # step_front with DeaMoE's experts: the step's department slots written by moe_front's routing program; False:
    # kernels/department_slots.py's own launch between the router and the department kernel
    slots_in_front = True
    # step_front for a router with a bias (GPT-OSS's): moe_front adds it, and the MXFP4 experts' launch takes the
    # residual add (2 launches from the mixer's output on, was 4: add + norm, router, experts, add). gpt-oss-20b on an
    # H100 (bench/step_ab.py, session 53): +3.1% at 85%, +2.1% at 50%; False: the four launches
    bias_in_front = True

    def __init__(self, hf: nn.Module):
        super().__init__()
        object.__setattr__(self, "_hf", hf)  # prefill / unsupported calls, and uninstall
        for name, child in hf.named_children():  # gate, experts, [shared_expert, shared_expert_gate]: same objects
            self.add_module(name, child)
        for name, p in hf.named_parameters(recurse=False):
            self.register_parameter(name, p)
        self._gate_name = next((n for n in _ROUTER_NAMES if isinstance(getattr(hf, n, None), nn.Module)), "gate")
        gate = getattr(hf, self._gate_name, None)
        norm = _ROUTERS.get(type(gate).__name__, False)
        self.norm_topk_prob = bool(getattr(gate, "norm_topk_prob", False)) if norm is None else norm
        self.top_k = int(getattr(gate, "top_k", 0))
        self._group = _group_kw(gate)
        self._router_ok = (
            type(gate).__name__ in _ROUTERS
            and self._group is not None
            and isinstance(getattr(gate, "weight", None), torch.Tensor)
        )
        # the shared expert: Qwen3.5's `shared_expert` with a sigmoid `shared_expert_gate`, DeepSeek-V2's
        # `shared_experts` without a gate; DeepSeek-V2's router scales the top-k weights by routed_scaling_factor
        names = ("shared_expert", "shared_experts")
        self._shared_name = next((n for n in names if isinstance(getattr(hf, n, None), nn.Module)), names[0])
        se, sg = getattr(hf, self._shared_name, None), getattr(hf, "shared_expert_gate", None)
        self.has_shared = se is not None
        self.shared_gated = sg is not None
        self._routed_scale = float(getattr(gate, "routed_scaling_factor", 1.0) or 1.0)
        gate_ok = sg is None or (isinstance(sg, (nn.Linear, FusedLinear)) and sg.bias is None and sg.out_features == 1)
        self._shared_ok = not self.has_shared or (
            gate_ok
            and all(
                isinstance(getattr(se, n, None), (nn.Linear, FusedLinear)) and getattr(se, n).bias is None
                for n in ("gate_proj", "up_proj", "down_proj")
            )
            and getattr(getattr(se, "config", None), "hidden_act", None) in ("silu", "swish")
        )
        self._tuple_out = False  # the original returned (hidden, router_logits): mirror it
        w = getattr(gate, "weight", None)
        self._tickets = torch.zeros(64, dtype=torch.int32, device=w.device if w is not None else "cpu")
        self.decode_calls = 0  # fused calls taken (eager calls; a CUDA graph replay does not count)
        self.front_calls = 0  # of which through `step_front` (moe_front + sparse_fused's tail)
        self._launch: tuple[dict, dict] | None = None  # tuned (router, shared expert) keywords, on the first call
        self._front: dict | None = None  # tuned moe_front keywords, on the first call
        # step_front: the shared expert in moe_front's launch (its weights load before the PDL wait, off the path
        # after the router); False: in sparse_fused's, after the router (sessions 4-6)
        self.shared_in_front = True
        self._down_t: tuple[int, torch.Tensor] | None = None  # (source data_ptr, shared down_proj weight [I, H])
        self._unit: torch.Tensor | None = None  # [1] = 1: an ungated shared expert's weight in sparse_fused

    @property
    def _gate(self) -> nn.Module:
        """The router child (`gate`, or GraniteMoE's `router`)."""
        return getattr(self, self._gate_name)

    @property
    def _se(self) -> nn.Module | None:
        """The shared expert child (`shared_expert`, or DeepSeek-V2's `shared_experts`), None without one."""
        return getattr(self, self._shared_name, None) if self.has_shared else None

    def _fusable(self, h: torch.Tensor) -> bool:
        if not (self._router_ok and self._shared_ok) or h.dim() != 3 or h.shape[0] * h.shape[1] != 1:
            return False
        w = self._gate.weight  # x's dtype, or an fp32 router (DeepSeek-V2)
        return w.dtype in (h.dtype, torch.float32) and h.device == w.device

    def _prefill_ok(self, h: torch.Tensor) -> bool:
        """Whether `prefill` runs this call: switched on, more than one token, a router it reproduces
        (`_PREFILL_ROUTERS`) with its weight in x's dtype on x's device, a plain shared expert or none."""
        gate = self._gate
        return (
            self.prefill_fused
            and h.dim() == 3
            and h.shape[0] * h.shape[1] > 1
            and type(gate).__name__ in _PREFILL_ROUTERS
            and self._router_ok
            and self._shared_ok
            and gate.weight.dtype == h.dtype
            and gate.weight.device == h.device
        )

    def forward(self, hidden_states: torch.Tensor):  # [B, T, H]
        if self._prefill_ok(hidden_states):
            y, logits = self.prefill(hidden_states)
            return (y, logits) if self._tuple_out else y
        if not self._fusable(hidden_states):
            out = self._hf(hidden_states)
            self._tuple_out = isinstance(out, tuple)
            return out
        y, logits = self.step(hidden_states)
        return (y, logits) if self._tuple_out else y

    def step(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None):
        """The fused one-token call (`_fusable` holds) -> (y [B, T, H], router logits); with `residual` (only with a
        shared expert) y = residual + the block's output, the add done in the shared expert's last kernel."""
        self.decode_calls += 1
        B, T, H = hidden_states.shape
        x = hidden_states.view(-1, H)
        logits, top_k_weights, top_k_index = self._route(x)
        if self._routed_scale != 1.0:  # DeepSeek-V2's routed_scaling_factor, as its router applies it
            top_k_weights = top_k_weights * self._routed_scale
        y = self.experts(x, top_k_index, top_k_weights)
        if self.has_shared:
            y = self._shared(x, y, None if residual is None else residual.view(-1, H))
        elif residual is not None:
            raise ValueError("a residual is fused into the shared expert's kernel: this block has none")
        return y.reshape(B, T, H), logits

    @torch.compiler.disable
    def prefill(self, hidden_states: torch.Tensor):
        """A prompt piece (`_prefill_ok` holds) -> (y [B, T, H], router logits [B·T, E]): logits by F.linear (as
        transformers' router), the softmax top-k in one launch, the experts, and the shared expert (`_shared_rows`)
        added in the experts' last launch where their call takes it (`takes_shared`), else by torch's ops."""
        B, T, H = hidden_states.shape
        x = hidden_states.reshape(-1, H)
        logits = F.linear(x, self._gate.weight)
        tw, ti = router_topk_of_logits(logits, self.top_k, self.norm_topk_prob, **self._group)
        if not self.has_shared:
            return self.experts(x, ti, tw).reshape(B, T, H), logits
        s, g = self._shared_rows(x)
        if getattr(self.experts, "takes_shared", None) is not None and self.experts.takes_shared(x, ti):
            y = self.experts(x, ti, tw, shared=(s, g))
        else:  # transformers' ops: y + sigmoid(g) * s
            y = self.experts(x, ti, tw) + (s if g is None else torch.sigmoid(g) * s)
        return y.reshape(B, T, H), logits

    def _shared_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The shared expert on every token of x [T, H]: (its output [T, H], its gate logit [T, 1], None ungated).
        gate | up with the SwiGLU in one launch (grouped_gate_up, one group of all T rows: the same roundings as
        transformers' gate_proj, act, up_proj and product), down_proj and the gate by F.linear."""
        se, T = self._se, x.shape[0]
        wg, wu = se.gate_proj.weight, se.up_proj.weight
        h = torch.empty(T, wg.shape[0], dtype=x.dtype, device=x.device)
        ends = torch.full((1,), T, dtype=torch.int32, device=x.device)
        grouped_gate_up(x, wg.unsqueeze(0), wu.unsqueeze(0), ends, 0, h)
        s = F.linear(h, se.down_proj.weight)
        return s, F.linear(x, self.shared_expert_gate.weight) if self.shared_gated else None

    def takes_front(self, h: torch.Tensor) -> bool:
        """Whether `step_front` can run this one-token call: the fused call holds and the block's experts run
        `sparse_fused` (which then takes the residual add, and the shared expert's sum if there is one), or DeaMoE's
        department kernels on resident weights (experts/departments.py `tail=`)."""
        takes = getattr(self.experts, "takes_tail", None)
        plain = self._gate.weight.dtype in (h.dtype, torch.float32)  # moe_front: x's dtype, or DeepSeek-V2's fp32
        plain = plain and (self._router_bias is None or self.bias_in_front)  # GPT-OSS's biased router
        # DeepSeek-V2's ungated shared experts on the sparse path: the five launches (norm, router_topk, sparse_fused,
        # the shared experts' two) measured faster than moe_front + sparse_fused with them in its shared programs
        # (V2-Lite, H200, 75%: 443 against 432 tok/s; at sparsity 0 the front wins, 385 against 325)
        # (and 4-bit experts: sparse_fused runs no shared programs beside them)
        plain = plain and (self.shared_gated or not self.has_shared or self._dense_unquantized_experts())
        return plain and self._fusable(h) and takes is not None and takes(h.view(-1, h.shape[-1]))

    def _dense_unquantized_experts(self) -> bool:
        """Whether the routed experts decode dense (no thresholds enabled) on unquantized weights: host-side flags."""
        sparse = bool(getattr(self.experts, "sparse_enabled", False)) and getattr(self.experts, "tau", None) is not None
        return not sparse and not getattr(getattr(self.experts, "weights", None), "quantized", False)

    @torch.compiler.disable
    def step_front(
        self, mixed: torch.Tensor, residual: torch.Tensor, norm: FusedRMSNorm, scale: float = 1.0
    ) -> torch.Tensor:
        """The decoder layer from the mixer's output on, two launches (`takes_front` holds): moe_front (residual
        add, post-attention norm, router top-k, the shared expert into the experts' workspace row), then the
        experts' `sparse_fused` with the residual add in its tail (`shared_in_front=False`: the shared expert in
        sparse_fused's launch; a block without one: moe_front without it). DeaMoE's DepartmentExperts take the same
        tail: moe_front routes group-limited and writes the department slots (`slots_in_front`), then the
        department kernel (one launch for one token) adds into the workspace row and publishes residual + row (2
        launches, was 9). With the gate predictor, moe_front computes its stage 1 too (`basis_in_front`). GPT-OSS
        (`bias_in_front`): moe_front with the router's bias, then its MXFP4 experts' `sparse_mxfp4` with the residual
        add in its tail. mixed, residual [B, T, H] -> the layer's output.
        `scale` (GraniteMoE's residual_multiplier; no shared expert): the mixer's output is scaled before its add
        and the block's output before its own, through the k routing weights, both inside moe_front (`mixed` comes
        unscaled)."""
        if scale != 1.0 and self.has_shared:
            raise ValueError("a scaled MoE output is folded into the routing weights: not with a shared expert")
        self.decode_calls += 1
        self.front_calls += 1
        B, T, H = mixed.shape
        if self._front is None:
            self._front = tuned(mixed, "moe_front", f"H{H}_E{self._gate.weight.shape[0]}_k{self.top_k}")
        se = self._se
        weights = (se.gate_proj.weight, se.up_proj.weight, self._shared_down_t()) if se is not None else None
        # the shared expert in moe_front's launch, into the workspace (its programs apply the sigmoid gate: Qwen3.5);
        # DeepSeek-V2's ungated shared experts run in sparse_fused's shared programs with weight 1
        in_front = se is not None and self.shared_in_front and self.shared_gated
        if in_front:
            ws = fused_workspace(mixed.device, H + self.top_k + 1)
            front = {"shared_expert": weights, "acc": ws[:H].view(torch.float32)}
        else:
            ws, front = None, {}
        extras, handed = self._front_extras(mixed)
        front |= extras
        # residual_early: the residual is the layer's input, written before the mixer's kernels, so moe_front may
        # load it before its PDL wait
        s, h, _, tw, ti, sg = moe_front(
            mixed,
            residual,
            norm.weight,
            norm.eps,
            norm.kind,
            self._gate.weight,
            self.top_k,
            self.norm_topk_prob,
            self.shared_expert_gate.weight if se is not None and self.shared_gated else None,
            tickets=self._tickets_on(mixed.device),
            residual_early=True,
            **front,
            **self._group,  # DeaMoE: group-limited top-k
            **self._front,
            x_scale=scale,  # GraniteMoE: the attention branch times m before the add, and the MoE branch through
            # the k routing weights (residual + Σ (w_i·m)·expert_i); DeepSeek-V2's routed_scaling_factor there too
            w_scale=scale * self._routed_scale,
            router_bias=self._router_bias,
        )
        shared = None if se is None or in_front else SharedExpert(*weights, sg if self.shared_gated else self._one(h))
        y = self.experts(h.view(1, H), ti, tw, tail=Tail(shared, s.view(1, H), ws), **handed)
        return y.view(B, T, H)

    def _front_extras(self, mixed: torch.Tensor) -> tuple[dict, dict]:
        """Work moe_front's launch can take from the experts' call: the gate predictor's stage 1 for every department
        (it needs no routing) and DeaMoE's department slots (written by the program that routes) -> (moe_front's
        keywords `basis=` / `slots=` with their output buffers, the experts' keywords `z=` / `slots=` reading them)."""
        front, handed, dev = {}, {}, mixed.device
        maps = self.experts.front_basis(mixed) if self.basis_in_front and hasattr(self.experts, "front_basis") else None
        if maps is not None:
            handed["z"] = torch.empty((1, *maps[0].shape[:2]), dtype=torch.float32, device=dev)
            front["basis"] = (*maps, handed["z"])
        slots = (
            self.experts.front_slots(mixed) if self.slots_in_front and hasattr(self.experts, "front_slots") else None
        )
        if slots is not None:
            n, S = slots
            handed["slots"] = (
                torch.empty(S, dtype=torch.int32, device=dev),
                torch.empty((S, 1, n), dtype=torch.float32, device=dev),
            )
            front["slots"] = (n, *handed["slots"])
        return front, handed

    @property
    def _router_bias(self) -> torch.Tensor | None:
        bias = getattr(self._gate, "bias", None)  # GPT-OSS's router
        return bias if isinstance(bias, torch.Tensor) else None

    def _one(self, like: torch.Tensor) -> torch.Tensor:
        """[1] = 1 in like's dtype on its device (an ungated shared expert's weight), made once."""
        if self._unit is None or self._unit.device != like.device or self._unit.dtype != like.dtype:
            self._unit = torch.ones(1, dtype=like.dtype, device=like.device)
        return self._unit

    def _shared_down_t(self) -> torch.Tensor:
        """The shared expert's W_down transposed, [I, H] contiguous (a neuron's output row contiguous, as the routed
        experts store it): a copy of down_proj.weight made on the first call, remade if that weight is replaced."""
        w = self._se.down_proj.weight
        if self._down_t is None or self._down_t[0] != w.data_ptr():
            self._down_t = (w.data_ptr(), w.detach().t().contiguous())
        return self._down_t[1]

    def _tickets_on(self, device) -> torch.Tensor:
        if self._tickets.device != device:
            self._tickets = torch.zeros(64, dtype=torch.int32, device=device)
        return self._tickets

    @torch.compiler.disable  # Triton launches stay opaque to dynamo (the CUDA graph still holds them)
    def _route(self, x):
        tickets = self._tickets_on(x.device)
        if self._launch is None:
            H, E = self._gate.weight.shape[1], self._gate.weight.shape[0]
            se = self._se
            self._launch = (
                tuned(x, "router_topk", f"H{H}_E{E}_k{self.top_k}"),
                tuned(x, "shared_expert", f"H{H}_I{se.gate_proj.weight.shape[0]}") if se else {},
            )
        return router_topk(
            x,
            self._gate.weight,
            self.top_k,
            self.norm_topk_prob,
            tickets=tickets,
            bias=self._router_bias,
            **self._group,
            **self._launch[0],
        )

    @torch.compiler.disable
    def _shared(self, x, routed, residual=None):
        se = self._se
        return shared_expert(
            x,
            se.gate_proj.weight,
            se.up_proj.weight,
            se.down_proj.weight,
            self.shared_expert_gate.weight if self.shared_gated else None,
            routed.to(x.dtype),
            residual=residual,
            **self._launch[1],
        )
