"""`/stats` of `localmoe chat`: the engine's figures and the chat's settings, written for people.

No raw keys and no `None`: each figure has a label and a unit, and a figure the engine does not report (an
older engine, or nothing measured yet: 0) reads "—". The engine's timings `load_s`, `ttft_s` and `wall_s` are read
with getattr, so engines without them still work.
"""

from __future__ import annotations

import re

from localmoe.events import EngineStats, GenerationSettings
from localmoe.safe_text import for_line

DASH = "—"
FINISH = {
    "stop": "the model ended it",
    "length": "it reached the token limit",
    "cancelled": "cancelled",
    "": "in progress",
}


def seconds(value: object) -> str:
    """A duration for people: 380 ms, 2.4 s, 31 s, 1 min 12 s; "—" when unknown."""
    if not isinstance(value, (int, float)) or value != value or value < 0:
        return DASH
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 10:
        return f"{value:.1f} s"
    if value < 60:
        return f"{value:.0f} s"
    minutes, rest = divmod(round(value), 60)
    return f"{minutes} min {rest} s"


def measured(value: object) -> str:
    """A timing the engine reports: "—" when it does not, or has not measured it (0)."""
    return seconds(value) if isinstance(value, (int, float)) and value > 0 else DASH


def sampling_line(settings: GenerationSettings) -> str:
    """The sampling settings in words (repetition penalty and stop strings when the settings carry them)."""
    if settings.temperature == 0:
        parts = ["greedy (temperature 0)"]
    else:
        parts = [f"temperature {settings.temperature:g}"]
        parts.append(f"top-p {settings.top_p:g}" if settings.top_p < 1 else "top-p off")
        parts.append(f"top-k {settings.top_k}" if settings.top_k else "top-k off")
    penalty = getattr(settings, "repetition_penalty", None)
    if penalty is not None:
        parts.append(f"repetition penalty {penalty:g}" if penalty != 1 else "no repetition penalty")
    stop = tuple(getattr(settings, "stop", ()) or ())
    if stop:
        parts.append("stops at " + ", ".join(repr(for_line(s)) for s in stop))
    parts.append(f"at most {settings.max_new_tokens} tokens")
    return " · ".join(parts)


def _value(value: object) -> str:
    if value is None:
        return DASH
    if isinstance(value, float):
        return f"{value:.3g}"
    return for_line(str(value))


def stats_rows(
    engine: object,
    settings: GenerationSettings,
    *,
    model: str,
    think: str | None = None,
    context: int = 0,
    dropped: int = 0,
) -> list[tuple[str, str]]:
    """(label, value) rows for /stats."""
    stats: EngineStats = engine.stats
    device = for_line(str(getattr(engine, "device", "") or ""))
    where = f" on {device}" if device else ""
    if getattr(engine, "experts_format", "full") == "int4":
        where += ", 4-bit experts"
    rows = [("Model", f"{for_line(model)}{where}"), ("Load time", measured(getattr(stats, "load_s", None)))]
    if stats.generated_tokens or stats.prompt_tokens:
        reused = getattr(stats, "reused_prompt_tokens", 0)
        prompt = f"{stats.prompt_tokens} tokens" + (f" ({reused} already in the cache)" if reused else "")
        rows += [
            ("Last reply", f"{stats.generated_tokens} tokens, {FINISH.get(stats.finish_reason, stats.finish_reason)}"),
            ("Time to first token", measured(getattr(stats, "ttft_s", None))),
            ("Reply time", measured(getattr(stats, "wall_s", None))),
            ("Prompt", prompt),
            ("Speed", f"prefill {stats.prefill_tok_s:.0f} tok/s · decode {stats.decode_tok_s:.1f} tok/s"),
            (
                "Sparsity",
                f"{stats.sparsity_realized:.0%} of neurons skipped (target {stats.sparsity_target:.0%})"
                if stats.sparsity_target
                else "off (dense experts)",
            ),
        ]
    else:
        rows += [
            ("Last reply", "none yet"),
            ("Sparsity", f"target {stats.sparsity_target:.0%}" if stats.sparsity_target else "off (dense)"),
        ]
    rows.append(("Peak GPU memory", f"{stats.peak_gpu_mem_gb:.2f} GB" if stats.peak_gpu_mem_gb else DASH))
    rows.append(
        (
            "Expert cache",
            "all experts resident"
            if stats.cache_hit_rate is None
            else f"{stats.cache_hit_rate:.0%} of expert reads hit the GPU cache",
        )
    )
    dept, priv = getattr(stats, "department_hit_rate", None), getattr(stats, "private_hit_rate", None)
    if dept is not None and priv is not None:  # an offloaded DeaMoE: its department and private pools
        rows.append(("Department cache", f"{dept:.0%} of departments · {priv:.0%} of private parts hit the GPU"))
    if stats.h2d_bytes_per_token is not None:
        rows.append(("Host to GPU", f"{stats.h2d_bytes_per_token / 1e6:.0f} MB per token"))
    rows.append(("Sampling", sampling_line(settings)))
    if think is not None:
        rows.append(("Thinking", think))
    if context:
        rows.append(
            (
                "Context",
                f"{context} tokens"
                + (f" (the oldest {dropped} messages left out of the last prompt)" if dropped else ""),
            )
        )
    for key, value in (stats.extra or {}).items():
        rows.append((for_line(str(key)).replace("_", " ").capitalize(), _value(value)))
    return rows


def md_escape(text: str) -> str:
    """Text shown literally inside Markdown (a model name's underscores are not emphasis)."""
    return re.sub(r"([\\`*_\[\]<>#|~])", r"\\\1", text)


def stats_markdown(rows: list[tuple[str, str]]) -> str:
    return "\n".join(["**Stats**", ""] + [f"- {label}: **{md_escape(value)}**" for label, value in rows])
