"""Quality under sparsity: perplexity, its ratio to dense, and top-1 agreement with the dense model, per sparsity.

Text is cut into windows and scored teacher-forced. The sparse rows apply exactly the decode path's function
(gate dense, neurons with |g| < τ dropped, per token) on every position, via the experts' grouped path with the
mask on, so a whole window is scored in one forward. Thresholds come from the same cached calibration as `run`.

`departments` (`eval --departments 0,1,4,8 [--rank R]`, issue #23): each sparse row is scored once per N, N > 0 with
the department-shared gate predictor (experts/predicted.py: a neuron is kept when the predictor made it a candidate
and |g| >= τ), with three more columns: mask recall (the share of the exact mask's |act| mass the predictor kept; 1
for N = 0), routed-expert bytes per token (the k routed experts of every layer: N = 0 the whole gate and the kept
up/down rows; N > 0 B_d once per department a token touches, C_e, the candidates' gate rows and the kept up/down
rows, at the weights' element size) and those bytes relative to whole gates with the same kept rows (today's sparse
path; bench/gate_predictor.py's count).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from localmoe.errors import UsageError
from localmoe.events import ProgressFn
from localmoe.experts import predicted, predictor

DEFAULT_TEXT = Path(__file__).parent.parent / "data" / "heldout.txt"
QUALITY_BAR = 0.05  # largest sparsity whose perplexity stays within 5% of dense


@dataclass(frozen=True)
class EvalRow:
    sparsity: float
    perplexity: float
    ratio_to_dense: float
    top1_agreement: float
    sparsity_realized: float
    departments: int = 0
    mask_recall: float | None = None
    routed_bytes_per_token: float | None = None
    bytes_vs_sparse: float | None = None


PREDICTOR_KEYS = ("departments", "mask_recall", "routed_bytes_per_token", "bytes_vs_sparse")


@dataclass(frozen=True)
class EvalReport:
    model: str
    text: str
    tokens: int
    rows: tuple[EvalRow, ...]
    rank: int | None = None  # the predictor's rank when departments were asked for, else None
    z_sparsity: float = 0.0  # DeaMoE's second threshold on the sparse rows (Engine.z_sparsity)

    @property
    def best_within_bar(self) -> float:
        ok = [r.sparsity for r in self.rows if r.ratio_to_dense <= 1.0 + QUALITY_BAR]
        return max(ok) if ok else 0.0

    def as_json(self) -> dict:
        return {
            "model": self.model,
            "text": self.text,
            "tokens": self.tokens,
            "rows": [
                {k: v for k, v in asdict(r).items() if self.rank is not None or k not in PREDICTOR_KEYS}
                for r in self.rows
            ],
            **({} if self.rank is None else {"rank": self.rank}),
            **({"z_sparsity": self.z_sparsity} if self.z_sparsity else {}),
            "best_sparsity_within_5pct": self.best_within_bar,
        }

    def table(self) -> str:
        pred = self.rank is not None
        head = f"{'sparsity':>8}  {'ppl':>9}  {'ppl/dense':>9}  {'top-1 agree':>11}  {'realised':>8}"
        if pred:
            head = f"{'depts':>5}  {head}  {'recall':>7}  {'KB/token':>9}  {'vs sparse':>9}"
        title = f"{self.model}: {self.tokens} tokens of {self.text}" + (f", rank {self.rank}" if pred else "")
        title += f", z sparsity {self.z_sparsity:.0%} on the sparse rows" if self.z_sparsity else ""
        lines = [title, head]
        for r in self.rows:
            line = (
                f"{r.sparsity:>8.0%}  {r.perplexity:>9.3f}  {r.ratio_to_dense:>9.3f}  "
                f"{r.top1_agreement:>11.1%}  {r.sparsity_realized:>8.1%}"
            )
            if pred:
                line = f"{r.departments:>5}  {line}  " + (
                    f"{'-':>7}  {'-':>9}  {'-':>9}"
                    if r.mask_recall is None
                    else f"{r.mask_recall:>7.1%}  {r.routed_bytes_per_token / 1024:>9.1f}  {r.bytes_vs_sparse:>9.3f}"
                )
            lines.append(line)
        lines.append(f"largest sparsity within {QUALITY_BAR:.0%} of dense perplexity: {self.best_within_bar:.0%}")
        return "\n".join(lines)


def read_eval_text(path: str | Path | None) -> tuple[str, str]:
    p = Path(path) if path else DEFAULT_TEXT
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read evaluation text {p}: {e.strerror}") from None
    if not text.strip():
        raise UsageError(f"evaluation text {p} is empty")
    return text, ("held-out split (bundled)" if not path else p.name)


@torch.inference_mode()
def _score(engine, windows: list[torch.Tensor], dense_top1: list[torch.Tensor] | None, progress, label):
    """(mean NLL, top-1 predictions per window, agreement with dense)."""
    nll, count, agree = 0.0, 0, 0
    preds = []
    for i, w in enumerate(windows):
        logits = engine.model(input_ids=w[None].to(engine._device), use_cache=False).logits[0, :-1].float()
        target = w[1:].to(logits.device)
        nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        count += target.numel()
        top1 = logits.argmax(-1).cpu()
        preds.append(top1)
        if dense_top1 is not None:
            agree += int((top1 == dense_top1[i]).sum())
        if progress:
            progress(label, i + 1, len(windows))
    return nll / count, preds, (agree / count if dense_top1 is not None else 1.0)


def evaluate(
    engine,
    sparsities: list[float],
    *,
    text: str | Path | None = None,
    tokens: int = 16384,
    window: int = 512,
    progress: ProgressFn | None = None,
    departments: list[int] | None = None,
    rank: int | None = None,
) -> EvalReport:
    body, name = read_eval_text(text)
    ids = engine.tokenizer(body, add_special_tokens=False)["input_ids"][:tokens]
    window = min(window, engine.max_positions or window)
    windows = [torch.tensor(ids[i : i + window]) for i in range(0, len(ids), window) if len(ids[i : i + window]) > 1]
    if not windows:
        raise UsageError("the evaluation text is too short: give at least a few hundred tokens")
    previous, before = engine.sparsity, (engine.departments, engine.rank)
    scored = sum(len(w) for w in windows)
    asked = departments is not None
    if asked:
        engine.set_departments(max(departments), rank)  # a bad N or rank refused before anything is scored
    rows = []
    try:
        engine.set_departments(0)
        engine.set_sparsity(0.0)
        dense_nll, dense_top1, _ = _score(engine, windows, None, progress, "eval dense")
        for s in sparsities:
            if s == 0.0:
                rows.append(EvalRow(0.0, math.exp(dense_nll), 1.0, 1.0, 0.0))
                continue
            for n in departments if asked else [0]:
                engine.set_departments(n, rank)
                engine.set_sparsity(s, progress)
                for m in engine.loaded.experts:
                    m.reset_counters()
                    m.mask_all_tokens = True
                label = f"eval {s:.0%}" + (f" N={n}" if asked else "")
                try:
                    nll, _, agree = _score(engine, windows, dense_top1, progress, label)
                finally:
                    for m in engine.loaded.experts:
                        m.mask_all_tokens = False
                row = EvalRow(s, math.exp(nll), math.exp(nll - dense_nll), agree, engine.realized_sparsity())
                if asked:
                    read, whole_gates = routed_bytes(engine.loaded.experts, engine.dtype.itemsize)
                    recall = predicted.mass_recall_of(engine.loaded)
                    row = replace(
                        row,
                        departments=n,
                        mask_recall=1.0 if recall is None else recall,
                        routed_bytes_per_token=read / scored,
                        bytes_vs_sparse=read / whole_gates if whole_gates else 1.0,
                    )
                rows.append(row)
    finally:
        engine.set_departments(*before)
        engine.set_sparsity(previous)
    rank_used = None
    if asked:
        rank_used = rank or predictor.default_rank(engine.loaded.experts[0].hidden_size)
    return EvalReport(
        model=engine.model_name,
        text=name,
        tokens=scored,
        rows=tuple(rows),
        rank=rank_used,
        z_sparsity=engine.z_sparsity,
    )


def routed_bytes(experts, itemsize: int) -> tuple[float, float]:
    """(the routed experts' weight bytes the sparse path read for the tokens counted since the counters were reset,
    the same with whole gates: today's sparse path at the same kept rows, as bench/gate_predictor.py counts it).
    Per layer: the whole gate, or with a predictor B_d per touched department and C_e (int8 rows and their scales)
    and the candidates' gate rows; then the kept rows of up and down (weights at `itemsize` bytes)."""
    total = whole = 0
    for m in experts:
        H, I = m.hidden_size, m.intermediate_size
        kept, slots, p = int(m.kept), m.seen // I, m.predictor
        rows = 2 * kept * H * itemsize
        if p is None:
            gate = slots * I * H * itemsize
        else:
            c = p.counts
            maps = c["touches"] * predicted.basis_bytes(p.rank, H) + c["slots"] * predicted.map_bytes(I, p.rank)
            gate = maps + c["candidates"] * H * itemsize
        total += gate + rows
        whole += slots * I * H * itemsize + rows
    return float(total), float(whole)


def direct_perplexity(model, ids: list[int], window: int) -> float:
    """Plain transformers perplexity over the same windows (for checking the sparsity-0 row)."""
    nll, count = 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(ids), window):
            w = torch.tensor(ids[i : i + window])
            if len(w) < 2:
                continue
            logits = model(input_ids=w[None]).logits[0, :-1].float()
            nll += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
            count += len(w) - 1
    return math.exp(nll / count)
