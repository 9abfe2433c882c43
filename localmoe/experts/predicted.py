"""The department-shared gate predictor at decode time (issue #23): one MoE layer's fitted predictor and the torch
reference of the predicted sparse path.

A layer's routed experts are grouped into N departments; department d has a shared basis B_d [r, H], expert e a
private C_e [I, r] (fitted by `localmoe.experts.predictor`), both held as int8 rows with an fp32 scale a row
(kernels/gate_predictor.py's `quantize_rows`: what the kernels read, and what the torch paths here compute with, in
fp32). For a token x routed to experts e of departments d(e):

    stage 1  z_d = B_d · x                          once per department the token's experts touch
    stage 2  p_e = |act(C_e · z_d(e))|              candidates: neurons with p_e >= τ′_e (a threshold a neuron)
    stage 3  g = act(W_gate_e[cand] · x)            the exact gate rows of the candidates only;
             kept = cand with |g| >= τ              as the exact sparse path; their up/down rows read, computed exactly

The only error against the exact-mask sparse path is a neuron with |g| >= τ that the predictor missed. τ′ = 0 makes
every neuron a candidate: the exact sparse path. τ′_e [I] is stored in fp16 (`tau_rows` [E, I]): the fit
(localmoe.experts.predictor) sets the layer's τ′ and lowers each neuron's by a multiple of its prediction error.
The counters (`mass_exact`, `mass_kept`: the exact mask's |act| mass and the part of it kept; `candidates`, `slots`,
`touches`: candidate neurons, (token, expert) slots and (token, department) pairs) are filled by evaluation's masked
grouped path (`observe`) and by the decode reference (which cannot see the mass it missed: it adds counts only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from localmoe.kernels.gate_predictor import dequantize_rows, quantize_rows


@dataclass
class LayerPredictor:
    B: torch.Tensor  # [N, r, H] int8 the departments' shared bases
    B_scale: torch.Tensor  # [N, r] fp32 their rows' scales
    C: torch.Tensor  # [E, I, r] int8 the experts' private maps
    C_scale: torch.Tensor  # [E, I] fp32 their rows' scales
    dept_of: torch.Tensor  # [E] int64: each expert's department
    tau_rows: torch.Tensor  # [E, I] fp16: neuron i of expert e is a candidate when |act(C_e B_d x)|_i >= tau_rows[e, i]
    candidate_share: float | None = None  # the share of routed neurons that were candidates when fitted (None: unknown)
    counts: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.reset()

    @classmethod
    def of(cls, B, C, dept_of, tau=0.0, candidate_share=None) -> LayerPredictor:
        """From float maps B [N, r, H] and C [E, I, r] (stored as int8 rows with their scales) and `tau`, one
        threshold for every neuron or [E, I]."""
        (qb, sb), (qc, sc) = quantize_rows(B), quantize_rows(C)
        return cls(qb, sb, qc, sc, dept_of, row_thresholds(tau, C.shape[:2]), candidate_share)

    def maps(self, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, C) as the kernels see them (int8 x scale), in `dtype`."""
        return dequantize_rows(self.B, self.B_scale, dtype), dequantize_rows(self.C, self.C_scale, dtype)

    @property
    def departments(self) -> int:
        return self.B.shape[0]

    @property
    def rank(self) -> int:
        return self.B.shape[1]

    def reset(self) -> None:
        self.counts.update(mass_exact=0.0, mass_kept=0.0, candidates=0, slots=0, touches=0)  # in place

    def to(self, device) -> LayerPredictor:
        return LayerPredictor(
            self.B.to(device),
            self.B_scale.to(device, torch.float32).contiguous(),
            self.C.to(device),
            self.C_scale.to(device, torch.float32).contiguous(),
            self.dept_of.to(device),
            self.tau_rows.to(device, torch.float16).contiguous(),
            self.candidate_share,
        )

    def predicted_abs(self, x: torch.Tensor, experts: torch.Tensor, act_fn) -> torch.Tensor:
        """|act(C_e B_d(e) x)| [n, I] of rows x [n, H] routed to experts [n] (stage 1 and 2 for many rows)."""
        n, (N, r, H) = x.shape[0], self.B.shape
        z_all = ((x.float() @ self.B.reshape(N * r, H).float().T) * self.B_scale.reshape(N * r)).view(n, N, r)
        dept = self.dept_of[experts]
        z = z_all.gather(1, dept.view(n, 1, 1).expand(n, 1, r)).squeeze(1)  # [n, r] fp32
        out = torch.empty(n, self.C.shape[1], dtype=z.dtype, device=x.device)
        for e in torch.unique(experts).tolist():
            rows = experts == e
            out[rows] = act_fn((z[rows] @ self.C[e].float().T) * self.C_scale[e]).abs()
        return out

    def candidates(self, x: torch.Tensor, experts: torch.Tensor, act_fn) -> torch.Tensor:
        """bool [n, I]: the neurons the predictor lets through."""
        return self.predicted_abs(x, experts, act_fn) >= self.tau_rows[experts].float()

    def observe(self, g_abs, keep_exact, cand, experts, tokens) -> None:
        """Evaluation (every row's exact gate known): the exact mask's |act| mass and the part the candidates kept,
        and the counts the byte figures need. `tokens` [n]: each row's token (for department touches)."""
        c = self.counts
        mass = g_abs * keep_exact
        c["mass_exact"] += float(mass.sum())
        c["mass_kept"] += float((mass * cand).sum())
        c["candidates"] += int(cand.sum())
        c["slots"] += int(experts.numel())
        c["touches"] += int(torch.unique(tokens * self.departments + self.dept_of[experts]).numel())


def row_thresholds(tau, shape) -> torch.Tensor:
    """fp16 [E, I] thresholds from one number (every neuron) or an [E, I] tensor; negative ones are 0 (every
    |act| reaches them)."""
    t = torch.as_tensor(tau, dtype=torch.float64)
    return torch.broadcast_to(t.clamp_min(0.0), tuple(shape)).to(torch.float16).contiguous()


def predicted_reference(x, w, top_k_index, top_k_weights, tau, act_fn, pred: LayerPredictor):
    """Torch reference of the predicted sparse path (stages 1-3 above): reads B_d once per touched department, C_e,
    the candidates' gate rows and the kept rows of W_up and W_down_t only.

    x [T,H], top_k_index/top_k_weights [T,k], tau [E] -> (y [T,H] fp32, kept neuron count as a 0-d tensor)."""
    T, k = top_k_index.shape
    y = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    kept_total = torch.zeros((), dtype=torch.int64, device=x.device)
    c = pred.counts
    for t in range(T):
        xt = x[t]
        z = {}  # stage 1: department -> B_d x
        for j in range(k):
            e = int(top_k_index[t, j])
            d = int(pred.dept_of[e])
            if d not in z:
                z[d] = (pred.B[d].float() @ xt.float()) * pred.B_scale[d]
            p = act_fn((pred.C[e].float() @ z[d]) * pred.C_scale[e])
            cand = (p.abs() >= pred.tau_rows[e].float()).nonzero().squeeze(1)  # stage 2
            c["candidates"] += cand.numel()
            c["slots"] += 1
            if cand.numel() == 0:
                continue
            g = act_fn(w.w_gate[e].index_select(0, cand) @ xt)  # stage 3: the candidates' exact gate rows
            hit = g.abs() >= tau[e]
            keep = cand[hit]
            kept_total += keep.numel()
            if keep.numel() == 0:
                continue
            h = g[hit] * (w.w_up[e].index_select(0, keep) @ xt)  # [n_kept]
            y[t] += (top_k_weights[t, j].float() * (h @ w.w_down_t[e].index_select(0, keep))).float()
        c["touches"] += len(z)
    return y, kept_total


def basis_bytes(r: int, H: int) -> int:
    """Bytes of one department's B_d: int8 rows and their fp32 scales."""
    return r * H + 4 * r


def map_bytes(I: int, r: int) -> int:
    """Bytes of one expert's C_e: int8 rows, their fp32 scales and fp16 thresholds."""
    return I * r + 6 * I


def routed_gate_bytes(p: LayerPredictor, matrix: float, top_k: int) -> float:
    """Gate-side bytes one token's k routed experts read in one layer with predictor `p` (uniform routing): each
    touched department's B_d once (N (1 - (1 - 1/N)^k) of them expected), each expert's C_e, and its candidates'
    gate rows (`p.candidate_share` of a `matrix`-byte gate); without a predictor it is k * matrix."""
    N, r, H = p.B.shape
    _, I, _ = p.C.shape
    touched = N * (1.0 - (1.0 - 1.0 / N) ** top_k)
    return top_k * (p.candidate_share * matrix + map_bytes(I, r)) + touched * basis_bytes(r, H)


def device_bytes(preds: list[LayerPredictor] | None) -> int:
    """VRAM the predictors take on the device: every layer's int8 B and C with their scales and thresholds, and
    dept_of."""
    total = 0
    for p in preds or []:
        (N, r, H), (E, I, _) = p.B.shape, p.C.shape
        total += N * basis_bytes(r, H) + E * map_bytes(I, r) + p.dept_of.numel() * 8
    return total


def make_room(loaded, preds: list[LayerPredictor] | None) -> None:
    """Offloaded with a gate tier (direct misses): B and C live in VRAM in place of whole gates. The tier gives up
    as many gates as the predictors' bytes (rounded up) and takes them back when the predictor is turned off; the
    up/down slots keep their share. A predictor makes each absent gate cost only its candidates' rows, so per byte
    a resident gate still saves more host reads than an up/down row (candidate share > 1 - sparsity), and the gates
    stay first (experts/placement.py's gate_tier_split)."""
    cache = loaded.cache
    if cache is None or not cache.gate_slots:
        return
    gate_bytes = cache.row_bytes * cache.width
    need = -(-device_bytes(preds) // gate_bytes)
    cache.resize_gates(cache.planned_gate_slots - need)


def apply(loaded, preds: list[LayerPredictor] | None, *, device) -> None:
    """Predictors into the experts modules (None: off, the exact sparse path)."""
    for i, m in enumerate(loaded.experts):
        m.predictor = None if preds is None else preds[i].to(device)


def mass_recall_of(loaded) -> float | None:
    """The share of the exact mask's |act| mass the predictors kept since their counters were reset (evaluation)."""
    preds = [m.predictor for m in loaded.experts if getattr(m, "predictor", None) is not None]
    exact = sum(p.counts["mass_exact"] for p in preds)
    return None if not preds else (sum(p.counts["mass_kept"] for p in preds) / exact if exact else 1.0)
