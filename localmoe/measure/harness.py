"""lm-eval adapter: run EleutherAI's evaluation harness through localmoe's Engine, at each requested sparsity.

Optional: needs the `lm-eval` extra (`pip install "localmoe[eval]"`). Loglikelihood requests score the whole
sequence in one forward with the sparse mask applied per token (the decode path's function); generation requests
go through `Engine.generate`, i.e. the real decode loop.
"""

from __future__ import annotations

import torch

from localmoe.errors import UsageError
from localmoe.events import GenerationSettings, ProgressFn


def _lm_class():
    try:
        from lm_eval.api.model import LM
    except ImportError:
        raise UsageError('--tasks needs lm-eval: pip install "localmoe[eval]"') from None

    class LocalmoeLM(LM):
        def __init__(self, engine):
            super().__init__()
            self.engine = engine
            self.tok = engine.tokenizer
            self.max_len = engine.max_positions or 4096

        @torch.inference_mode()
        def _logprobs(self, ids: list[int], n_cont: int) -> tuple[float, bool]:
            ids = ids[-self.max_len :]
            x = torch.tensor([ids], device=self.engine._device)
            logits = self.engine.model(input_ids=x, use_cache=False).logits[0].float()
            logp = torch.log_softmax(logits[-n_cont - 1 : -1], dim=-1)
            cont = x[0, -n_cont:]
            ll = float(logp.gather(1, cont[:, None]).sum())
            greedy = bool((logp.argmax(-1) == cont).all())
            return ll, greedy

        def loglikelihood(self, requests):
            out = []
            for req in requests:
                context, continuation = req.args
                ctx = self.tok(context, add_special_tokens=False)["input_ids"] if context else []
                whole = self.tok(context + continuation, add_special_tokens=False)["input_ids"]
                if not ctx:
                    bos = self.tok.bos_token_id if self.tok.bos_token_id is not None else self.tok.eos_token_id
                    whole, ctx = [bos] + whole, [bos]
                n_cont = max(1, len(whole) - len(ctx))
                out.append(self._logprobs(whole, n_cont))
            return out

        def loglikelihood_rolling(self, requests):
            out = []
            for req in requests:
                (text,) = req.args
                ids = self.tok(text, add_special_tokens=False)["input_ids"]
                bos = self.tok.bos_token_id if self.tok.bos_token_id is not None else self.tok.eos_token_id
                total = 0.0
                for i in range(0, len(ids), self.max_len - 1):
                    chunk = ids[i : i + self.max_len - 1]
                    prefix = [bos] if i == 0 else ids[i - 1 : i]
                    total += self._logprobs(prefix + chunk, len(chunk))[0]
                out.append(total)
            return out

        def generate_until(self, requests):
            out = []
            for req in requests:
                context, kwargs = req.args
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                settings = GenerationSettings(
                    max_new_tokens=int(kwargs.get("max_gen_toks", 256)),
                    temperature=float(kwargs.get("temperature", 0.0)),
                )
                text = ""
                for ev in self.engine.generate(self.engine.encode_raw(context), settings):
                    if ev.channel != "answer":  # a thinking or harmony model's reasoning is not its answer
                        continue
                    text += ev.text
                    if any(u in text for u in until):
                        self.engine.cancel()
                for u in until:
                    text = text.split(u)[0]
                out.append(text)
            return out

    return LocalmoeLM


def run_tasks(
    engine,
    tasks: list[str],
    sparsities: list[float],
    *,
    limit: int | None = None,
    include_path: str | None = None,
    progress: ProgressFn | None = None,
    departments: list[int] | None = None,
    rank: int | None = None,
) -> dict:
    """{"results": {key: {task: {metric: value}}}, "table": str}; key is the sparsity ("0.85"), or with the gate
    predictor's `departments` (a list of counts, 0 = the exact mask) "0.85@d8" for each count > 0 at each sparsity
    > 0 (the predictor acts on the sparse mask only; its candidates gate the mask on every scored token)."""
    LocalmoeLM = _lm_class()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    lm = LocalmoeLM(engine)
    previous = engine.sparsity, engine.departments, engine.rank
    runs = [(s, n) for n in (departments or [0]) for s in sparsities if s > 0 or not n]
    results: dict[str, dict] = {}
    try:
        for i, (s, n) in enumerate(runs):
            engine.set_departments(n, rank)
            engine.set_sparsity(s, progress)
            for m in engine.loaded.experts:
                m.mask_all_tokens = s > 0
                m.reset_counters()
            try:
                res = simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=manager, log_samples=False)
            finally:
                for m in engine.loaded.experts:
                    m.mask_all_tokens = False
            results[f"{s:g}@d{n}" if n else f"{s:g}"] = {
                t: {k: v for k, v in r.items() if isinstance(v, (int, float))} for t, r in res["results"].items()
            }
            if progress:
                progress("lm-eval", i + 1, len(runs))
    finally:
        engine.set_departments(*previous[1:])
        engine.set_sparsity(previous[0])
    lines = [f"{'sparsity':>8}  {'departments':>11}  {'task':<20} metrics"]
    for key, per_task in results.items():
        s, _, n = key.partition("@d")
        for t, metrics in per_task.items():
            shown = ", ".join(f"{k.split(',')[0]}={v:.4f}" for k, v in metrics.items() if "stderr" not in k)
            lines.append(f"{float(s):>8.0%}  {n or '–':>11}  {t:<20} {shown}")
    return {"model": engine.model_name, "results": results, "table": "\n".join(lines)}
