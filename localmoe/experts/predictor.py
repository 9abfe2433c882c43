"""Department-shared gate predictor for pretrained MoEs (issue #23): grouping, closed-form fit, τ′, and the cache.

Per MoE layer, from the routed inputs x of the calibration text (the thresholds' text and token count):
  * grouping: the E routed experts in N balanced departments (sizes differ by at most one), greedy: seed with the
    expert most similar to those left, fill with its most similar. Similarity "coact" (the default): routing
    co-activation, tokens routed to both experts; "rows": the overlap ||V_a V_b^T||² of the experts' top-32 right
    singular subspaces of the whitened gates W_e Σ^½ (Σ the layer's input second moment). bench/gate_predictor.py
    measured both within 0.3 points of mass recall on localmoe-tiny.
  * fit (closed form): Σ_d from the inputs routed to department d; the top-r right singular vectors V_r of the
    stacked [W_e Σ_d^½] (e in d) give B_d = V_r^T Σ_d^-½ [r, H]; each expert's C_e [I, r] is then refit by ridge
    least squares on its own routed inputs: C_e = G Z^T (Z Z^T + λI)^-1, G = W_e X_e^T, Z = B_d X_e^T (an expert
    routed fewer than r calibration tokens is fitted on its department's inputs).
  * the maps stored as int8 rows with an fp32 scale a row (`LayerPredictor.of`; bf16 maps read 2x the bytes, fp32
    4x; fake-quantized on localmoe-tiny, N 8, r 64, int8 rows held the held-out recall at 98.0% where int4 rows,
    per row or per 32, fell to 94.7% / 96.0%);
  * the thresholds, set with the int8 maps: each neuron's prediction error σ_e,i (the RMS of |act(W_gate_e x)| -
    |act(C_e B_d x)| over its expert's calibration pairs, shrunk toward the layer's RMS by PRIOR_PAIRS pseudo-pairs)
    and, for each slack k of SLACKS, the largest τ′ such that the candidates |act(C_e B_d x)| + k σ_e,i >= τ′ hold
    at least `recall` (default DEFAULT_RECALL) of the exact mask's |act| mass (|act(W_gate_e x)| >= τ) over the
    calibration (token, expert) pairs of the layer; the k with the fewest candidates wins, and neuron i of expert e
    gets the threshold τ′ - k σ_e,i (fp16, at least 0). A neuron predicted well needs less margin, one predicted
    badly more: on localmoe-tiny (bf16, N 8, r 64, `eval`) one τ′ a layer read 0.713 / 0.734 / 0.767 of today's
    routed bytes at +0.97% / +0.86% / +0.77% perplexity (targets 0.99 / 0.991 / 0.992), a threshold a neuron 0.691
    / 0.696 / 0.708 / 0.729 at +1.03% / +0.82% / +0.91% / +0.68% (0.99 / 0.9905 / 0.991 / 0.992).
Random weights (`bench --shape`) get a synthetic predictor instead (`synthetic`: for speed only).
Fitting runs on the CPU in float64 and keeps the layers' routed inputs in host memory (tokens x H x 8 bytes per
layer). `predictors_for` reads the fitted predictors from their cache file (localmoe.experts.predictor_cache) or
fits them and writes it; an invalid or stale file is fitted again and overwritten, with a notice.

An `engine` argument is read through `.model_name`, `.resolved`, `.tokenizer`, `.model`, `.loaded.experts`,
`._device`, `._logits_kw`, `.max_positions` and `.on_notice` (this module sits below the engine).
"""

from __future__ import annotations

from pathlib import Path

import torch

from localmoe.errors import UsageError
from localmoe.events import ProgressFn
from localmoe.experts import predictor_cache
from localmoe.experts.local_experts import LocalExperts
from localmoe.experts.predicted import LayerPredictor, row_thresholds
from localmoe.experts.thresholds import CHUNK, DEFAULT_TOKENS, read_calibration_text
from localmoe.safe_text import for_line

METHODS = ("coact", "rows")
DEFAULT_RANK = 64  # capped at H: bench/gate_predictor.py, recall needs about a quarter of localmoe-tiny's H
SYNTHETIC_CANDIDATES = 0.30  # random weights: the candidate share of localmoe-tiny's predictors at the 0.98 target
SYNTHETIC_TOKENS = 256  # random weights: routed inputs that set the synthetic predictor's τ′
# share of the exact mask's |act| mass the candidates must hold on the calibration text: with a threshold a neuron,
# 0.9905 kept 98.25% on held-out text at +0.82% perplexity and 30.4% fewer routed bytes than today's path
# (localmoe-tiny, bf16, N 8, r 64; 0.99: 98.2%, +1.03%; 0.992: 98.5%, +0.68%, 27.1% fewer; RESULTS.md)
DEFAULT_RECALL = 0.9905
RIDGE = 1e-6
SLACKS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0)  # multiples of a neuron's prediction error tried for each layer
PRIOR_PAIRS = 16  # a neuron's prediction error is shrunk toward its layer's over this many pseudo-pairs
ROW_SPACE = 32  # the "rows" similarity: singular directions per expert compared


def default_rank(hidden: int) -> int:
    return min(DEFAULT_RANK, hidden)


def check_request(departments: int, rank: int | None, experts: int, hidden: int, model: str) -> None:
    """One-line usage errors for a --departments / --rank this model cannot take."""
    if departments < 0:
        raise UsageError(f"--departments must be >= 0 (0 = off), got {departments}")
    if departments > experts:
        raise UsageError(
            f"--departments {departments} is more than the {experts} routed experts per layer of "
            f"{for_line(model)}: give 0 (off) to {experts}"
        )
    if rank is not None and not 1 <= rank <= hidden:
        raise UsageError(f"--rank must be in [1, {hidden}] (the hidden size of {for_line(model)}), got {rank}")


# -- the math --------------------------------------------------------------------------------------------------
def sqrtms(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ^½, Σ^-½) from one eigendecomposition (eigenvalues floored at 1e-8 of the largest)."""
    val, vec = torch.linalg.eigh(sigma)
    val = val.clamp(min=val.max() * 1e-8)
    return (vec * val**0.5) @ vec.T, (vec * val**-0.5) @ vec.T


def second_moment(x: torch.Tensor) -> torch.Tensor:
    return x.T @ x / max(len(x), 1) + RIDGE * torch.eye(x.shape[1], dtype=x.dtype)


def similarity(method: str, w_gate: torch.Tensor, idx: torch.Tensor, sigma_half: torch.Tensor | None) -> torch.Tensor:
    """[E, E] expert similarity: "coact" routing co-activation counts, "rows" whitened gate row-space overlap."""
    E = w_gate.shape[0]
    if method == "coact":
        onehot = torch.zeros(idx.shape[0], E, dtype=torch.float64).scatter_(1, idx, 1.0)
        return onehot.T @ onehot
    if method != "rows":
        raise UsageError(f"grouping method must be one of {', '.join(METHODS)}, got {method!r}")
    bases = [torch.linalg.svd(w_gate[e] @ sigma_half, full_matrices=False)[2][:ROW_SPACE] for e in range(E)]
    return torch.tensor([[float((bases[a] @ bases[b].T).norm() ** 2) for b in range(E)] for a in range(E)])


def group(sim: torch.Tensor, n_groups: int) -> list[list[int]]:
    """Balanced greedy grouping (sizes differ by at most one): seed with the expert most similar to the rest, fill
    with its most similar."""
    E = sim.shape[0]
    left, groups = set(range(E)), []
    for i in range(n_groups):
        size = E // n_groups + (1 if i < E % n_groups else 0)
        seed = max(sorted(left), key=lambda e: float(sum(sim[e, f] for f in left if f != e)))
        rest = sorted((f for f in left if f != seed), key=lambda f: (-float(sim[seed, f]), f))
        members = [seed] + rest[: size - 1]
        groups.append(members)
        left -= set(members)
    return groups


def fit_layer(w_gate: torch.Tensor, x: torch.Tensor, idx: torch.Tensor, departments: int, rank: int, method: str):
    """(B [N, r, H], C [E, I, r], dept_of [E]) of one layer, float64; w_gate [E, I, H], x [n, H] the routed
    inputs, idx [n, k] their experts."""
    E, I, H = w_gate.shape
    half = sqrtms(second_moment(x))[0] if method == "rows" else None
    groups = group(similarity(method, w_gate, idx, half), departments)
    dept_of = torch.empty(E, dtype=torch.long)
    for d, g in enumerate(groups):
        dept_of[g] = d
    B = torch.zeros(departments, rank, H, dtype=torch.float64)
    C = torch.zeros(E, I, rank, dtype=torch.float64)
    eye = RIDGE * torch.eye(rank, dtype=torch.float64)
    for d, g in enumerate(groups):
        xd = x[(dept_of[idx] == d).any(1)]
        xd = xd if len(xd) >= rank else x
        half, inv_half = sqrtms(second_moment(xd))
        _, _, vh = torch.linalg.svd(torch.cat([w_gate[e] @ half for e in g]), full_matrices=False)
        n = min(rank, vh.shape[0])
        B[d, :n] = vh[:n] @ inv_half
        for e in g:
            xe = x[(idx == e).any(1)]
            xe = xe if len(xe) >= rank else xd
            Z, G = B[d] @ xe.T, w_gate[e] @ xe.T  # [r, n], [I, n]
            C[e] = G @ Z.T @ torch.linalg.inv(Z @ Z.T + eye)
    return B, C, dept_of


def exact_and_predicted(w_gate, x, idx, B, C, dept_of, act_fn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(|act(W_e x)|, |act(C_e B_d x)|, each [pairs, I], the pairs' experts [pairs]) over the (token, expert) pairs
    of x's routing."""
    exact, pred, experts = [], [], []
    for e in range(w_gate.shape[0]):
        xe = x[(idx == e).any(1)]
        exact.append(act_fn(xe @ w_gate[e].T).abs())
        pred.append(act_fn(xe @ B[int(dept_of[e])].T @ C[e].T).abs())
        experts.append(torch.full((len(xe),), e, dtype=torch.long))
    return torch.cat(exact), torch.cat(pred), torch.cat(experts)


def tau_for_recall(exact: torch.Tensor, pred: torch.Tensor, tau: float, recall: float) -> float:
    """The largest τ′ whose candidates (pred >= τ′) hold `recall` of the exact mask's |act| mass (exact >= τ)."""
    mass = (exact * (exact >= tau)).reshape(-1)
    total = float(mass.sum())
    if total == 0.0 or recall <= 0.0:
        return float(pred.max()) if recall <= 0.0 and pred.numel() else 0.0
    p = pred.reshape(-1)
    order = torch.argsort(p, descending=True)
    cum = torch.cumsum(mass[order], 0)
    i = int(torch.searchsorted(cum, torch.tensor(min(recall, 1.0) * total, dtype=cum.dtype) * (1 - 1e-12)))
    return float(p[order[min(i, len(p) - 1)]])


def mass_recall(exact: torch.Tensor, pred: torch.Tensor, tau: float, tau_prime) -> float:
    """The share of the exact mask's |act| mass whose predictions reach `tau_prime` (a number or [pairs, I])."""
    mass = exact * (exact >= tau)
    total = float(mass.sum())
    return float((mass * (pred >= tau_prime)).sum()) / total if total else 1.0


def row_errors(exact: torch.Tensor, pred: torch.Tensor, experts: torch.Tensor, E: int) -> torch.Tensor:
    """σ [E, I] float64: each neuron's RMS prediction error over its expert's pairs, shrunk toward the layer's RMS
    by PRIOR_PAIRS pseudo-pairs (a rarely routed expert's errors are mostly the layer's)."""
    sq = (exact - pred).double().pow(2)
    sums = torch.zeros(E, sq.shape[1], dtype=torch.float64).index_add_(0, experts, sq)
    n = torch.bincount(experts, minlength=E).double()[:, None]
    prior = float(sq.mean()) if sq.numel() else 0.0
    return ((sums + PRIOR_PAIRS * prior) / (n + PRIOR_PAIRS)).sqrt()


def fit_thresholds(exact, pred, experts, E: int, tau: float, recall: float) -> tuple[torch.Tensor, float, float]:
    """(tau_rows fp16 [E, I], the slack k, the share of these pairs' neurons that are candidates): of the slacks k in
    SLACKS, the one whose thresholds τ′ - k σ (τ′ set for `recall` on these pairs) make the fewest candidates."""
    err = row_errors(exact, pred, experts, E)
    best = None
    for k in SLACKS:
        tp = tau_for_recall(exact, pred + k * err[experts], tau, recall)
        rows = row_thresholds(tp - k * err, err.shape)
        share = float((pred >= rows.double()[experts]).double().mean()) if pred.numel() else 0.0
        if best is None or share < best[0]:
            best = (share, rows, k)
    return best[1], best[2], best[0]


# -- calibration activations -----------------------------------------------------------------------------------
@torch.inference_mode()
def routed_inputs(engine, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per MoE layer (engine.loaded.experts order): (x [n, H] float64 on the CPU, top_k_index [n, k]) of `ids`."""
    mods = engine.loaded.experts
    got = [([], []) for _ in mods]

    def recorder(i: int):
        def record(_mod, args):  # returns None: the call's arguments are left as they are
            got[i][0].append(args[0].detach().double().cpu())
            got[i][1].append(args[1].detach().cpu())

        return record

    hooks = [m.register_forward_pre_hook(recorder(i)) for i, m in enumerate(mods)]
    chunk = min(CHUNK, engine.max_positions or CHUNK)
    try:
        for s in range(0, len(ids), chunk):
            engine.model(
                input_ids=torch.tensor([ids[s : s + chunk]], device=engine._device),
                use_cache=False,
                **engine._logits_kw,
            )
    finally:
        for h in hooks:
            h.remove()
    return [(torch.cat(x), torch.cat(k)) for x, k in got]


def fit(
    engine,
    ids: list[int],
    taus: list[float],
    departments: int,
    rank: int,
    *,
    method: str = "coact",
    recall: float = DEFAULT_RECALL,
    progress: ProgressFn | None = None,
) -> tuple[list[LayerPredictor], list[float], list[float]]:
    """(one CPU LayerPredictor per MoE layer, the calibration mass recall of each with its thresholds, the slack k
    each layer took)."""
    acts = routed_inputs(engine, ids)
    out, recalls, slacks = [], [], []
    for i, (m, (x, idx), tau) in enumerate(zip(engine.loaded.experts, acts, taus)):
        w = m.weights.dequantized(0, m.num_experts)[0].detach().double().cpu()
        B, C, dept_of = fit_layer(w, x, idx, departments, rank, method)
        p = LayerPredictor.of(B, C, dept_of)
        exact, pred, experts = exact_and_predicted(w, x, idx, *p.maps(torch.float64), dept_of, m.act_fn)  # as stored
        p.tau_rows, k, share = fit_thresholds(exact, pred, experts, m.num_experts, tau, recall)
        p.candidate_share = share if pred.numel() else None
        out.append(p)
        recalls.append(mass_recall(exact, pred, tau, p.tau_rows.double()[experts]))
        slacks.append(k)
        if progress:
            progress("fit predictor", i + 1, len(acts))
    return out, recalls, slacks


def synthetic(
    engine,
    ids: list[int],
    departments: int,
    rank: int,
    *,
    candidates: float | None = None,
    progress: ProgressFn | None = None,
) -> list[LayerPredictor]:
    """Random weights (bench --shape, speed only): the closed-form fit costs minutes of CPU per layer at real shapes
    and random gates have nothing to predict, so each layer gets contiguous balanced departments, an orthonormal
    random basis B_d [r, H] and C_e = W_gate_e B_d^T (the gate seen through the basis), with one τ′ for every
    neuron, the quantile that makes `candidates` (default SYNTHETIC_CANDIDATES, the share localmoe-tiny's fitted
    predictors let through at ~98% recall) of the routed neurons candidates on the routed inputs of `ids`. C is
    computed on the engine's device, a few experts at a time."""
    frac = SYNTHETIC_CANDIDATES if candidates is None else candidates
    acts = routed_inputs(engine, ids)
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, (m, (x, idx)) in enumerate(zip(engine.loaded.experts, acts)):
        E, I, H = m.num_experts, m.intermediate_size, m.hidden_size
        dept_of = torch.arange(E) * departments // E  # balanced: sizes differ by at most one
        B = torch.stack([torch.linalg.qr(torch.randn(H, rank, generator=gen))[0].T for _ in range(departments)])
        C = torch.empty(E, I, rank)
        dev = engine._device
        Bd = B.to(dev)
        step = max(1, (64 << 20) // max(1, I * H * 4))  # experts per chunk: ~64 MiB of float32 gates at a time
        for a in range(0, E, step):
            b = min(E, a + step)
            g = m.weights.dequantized(a, b)[0].to(dev, torch.float32)  # [n, I, H]
            C[a:b] = (g @ Bd[dept_of[a:b].to(dev)].transpose(1, 2)).cpu()  # [n, I, r]
        lp = LayerPredictor.of(B, C, dept_of)
        B, C = lp.maps()
        pred = []
        for e in torch.unique(idx).tolist():
            xe = x[(idx == e).any(1)].float()
            pred.append(m.act_fn(xe @ B[int(dept_of[e])].T @ C[e].T).abs().reshape(-1))
        p = torch.cat(pred)
        tp = float(torch.quantile(p[: 1 << 24], 1.0 - frac)) if p.numel() else 0.0
        lp.tau_rows = row_thresholds(tp, lp.tau_rows.shape)
        lp.candidate_share = float((p >= tp).float().mean()) if p.numel() else frac
        out.append(lp)
        if progress:
            progress("synthetic predictor", i + 1, len(acts))
    return out


def predictors_for(
    engine,
    table,
    departments: int,
    rank: int | None = None,
    *,
    method: str = "coact",
    recall: float = DEFAULT_RECALL,
    text: str | Path | None = None,
    tokens: int = DEFAULT_TOKENS,
    progress: ProgressFn | None = None,
    force: bool = False,
) -> tuple[list[LayerPredictor], Path | None]:
    """Cached predictors for (model, revision, the thresholds `table`'s sparsity, N, r, method, calibration set);
    fitted when absent, stale or invalid (with a notice through `engine.on_notice`). Returns (CPU predictors, the
    cache file or None when it could not be written or the engine has random weights)."""
    mods = engine.loaded.experts
    if not mods or not all(isinstance(m, LocalExperts) for m in mods):
        raise UsageError(f"--departments needs routed experts of a vanilla MoE; {engine.model_name} has none")
    H = mods[0].hidden_size
    check_request(departments, rank, mods[0].num_experts, H, engine.model_name)
    rank = rank or default_rank(H)
    taus = [float(max(t)) if isinstance(t, (tuple, list)) else float(t) for t in table.taus]
    notice = getattr(engine, "on_notice", None) or (lambda _text: None)
    if engine.tokenizer is None:  # random weights (bench --shape): a synthetic predictor, nothing cached
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, engine.loaded.config.vocab_size, (min(tokens, SYNTHETIC_TOKENS),), generator=gen)
        notice(
            f"random weights: a synthetic gate predictor ({departments} departments, rank {rank}, "
            f"{SYNTHETIC_CANDIDATES:.0%} of neurons candidates), for speed only: its recall means nothing"
        )
        return synthetic(engine, ids.tolist(), departments, rank, progress=progress), None
    body, name = read_calibration_text(text)
    meta = predictor_cache.metadata(engine, table.sparsity, departments, rank, method, recall, body, name, tokens)
    path = predictor_cache.cache_path(
        engine.model_name, engine.resolved.revision, table.sparsity, departments, rank, method, engine.experts_format
    )
    shapes = [(m.num_experts, m.intermediate_size, m.hidden_size) for m in mods]
    why = ""
    if not force:
        preds, why = predictor_cache.read(path, meta, shapes)
        if preds is not None:
            return preds, path
    ids = engine.tokenizer(body, add_special_tokens=False)["input_ids"][:tokens]
    preds, recalls, slacks = fit(engine, ids, taus, departments, rank, method=method, recall=recall, progress=progress)
    if why:
        notice(why)
    meta = {**meta, "tokens": len(ids), "calibration_recall": [round(v, 6) for v in recalls], "slack": slacks}
    failed = predictor_cache.write(path, preds, {k: v for k, v in meta.items()})
    if failed is None:
        return preds, path
    notice(f"could not save the gate predictor to {for_line(path)} ({for_line(failed)}); using it for this run only")
    return preds, None
