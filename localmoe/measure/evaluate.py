"""Quality under sparsity: perplexity, its ratio to dense, and top-1 agreement with the dense model, per sparsity.

Text is cut into windows and scored teacher-forced. The sparse rows apply exactly the decode path's function
(gate dense, neurons with |g| < τ dropped, per token) on every position, via the experts' grouped path with the
mask on, so a whole window is scored in one forward. Thresholds come from the same cached calibration as `run`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from localmoe.errors import UsageError
from localmoe.events import ProgressFn

DEFAULT_TEXT = Path(__file__).parent.parent / "data" / "heldout.txt"
QUALITY_BAR = 0.05  # largest sparsity whose perplexity stays within 5% of dense


@dataclass(frozen=True)
class EvalRow:
    sparsity: float
    perplexity: float
    ratio_to_dense: float
    top1_agreement: float
    sparsity_realized: float


@dataclass(frozen=True)
class EvalReport:
    model: str
    text: str
    tokens: int
    rows: tuple[EvalRow, ...]

    @property
    def best_within_bar(self) -> float:
        ok = [r.sparsity for r in self.rows if r.ratio_to_dense <= 1.0 + QUALITY_BAR]
        return max(ok) if ok else 0.0

    def as_json(self) -> dict:
        return {
            "model": self.model,
            "text": self.text,
            "tokens": self.tokens,
            "rows": [asdict(r) for r in self.rows],
            "best_sparsity_within_5pct": self.best_within_bar,
        }

    def table(self) -> str:
        lines = [
            f"{self.model}: {self.tokens} tokens of {self.text}",
            f"{'sparsity':>8}  {'ppl':>9}  {'ppl/dense':>9}  {'top-1 agree':>11}  {'realised':>8}",
        ]
        for r in self.rows:
            lines.append(
                f"{r.sparsity:>8.0%}  {r.perplexity:>9.3f}  {r.ratio_to_dense:>9.3f}  "
                f"{r.top1_agreement:>11.1%}  {r.sparsity_realized:>8.1%}"
            )
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
) -> EvalReport:
    body, name = read_eval_text(text)
    ids = engine.tokenizer(body, add_special_tokens=False)["input_ids"][:tokens]
    window = min(window, engine.max_positions or window)
    windows = [torch.tensor(ids[i : i + window]) for i in range(0, len(ids), window) if len(ids[i : i + window]) > 1]
    if not windows:
        raise UsageError("the evaluation text is too short: give at least a few hundred tokens")
    previous = engine.sparsity
    rows = []
    try:
        engine.set_sparsity(0.0)
        dense_nll, dense_top1, _ = _score(engine, windows, None, progress, "eval dense")
        for s in sparsities:
            if s == 0.0:
                rows.append(EvalRow(0.0, math.exp(dense_nll), 1.0, 1.0, 0.0))
                continue
            engine.set_sparsity(s, progress)
            for m in engine.loaded.experts:
                m.reset_counters()
                m.mask_all_tokens = True
            try:
                nll, _, agree = _score(engine, windows, dense_top1, progress, f"eval {s:.0%}")
            finally:
                for m in engine.loaded.experts:
                    m.mask_all_tokens = False
            rows.append(EvalRow(s, math.exp(nll), math.exp(nll - dense_nll), agree, engine.realized_sparsity()))
    finally:
        engine.set_sparsity(previous)
    return EvalReport(model=engine.model_name, text=name, tokens=sum(len(w) for w in windows), rows=tuple(rows))


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
