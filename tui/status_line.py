"""The status bar's figures of `localmoe chat`, as plain text (no Textual here, so the engine's figures can be
checked without a terminal): model and device first, then the last reply's speed, tokens, sparsity, GPU memory and
offloading hit rates; `wrap_parts` lays them onto at most two lines of a given width.
"""

from __future__ import annotations

from localmoe.events import EngineStats
from localmoe.safe_text import for_line

MODEL_LABEL_MAX = 32  # a local checkpoint's path in the status bar: its end, with an ellipsis


def short_model(model: str) -> str:
    """A model label for the status bar: a long path keeps its end."""
    model = for_line(model)
    return model if len(model) <= MODEL_LABEL_MAX else "…" + model[-(MODEL_LABEL_MAX - 1) :]


def status_parts(model: str, device: str, stats: EngineStats | None) -> list[str]:
    """The status bar's figures, most important first (model and device names made safe). Figures of a reply
    appear once there has been one."""
    parts = [short_model(model), for_line(device)]
    if stats is not None:
        if stats.decode_tok_s:
            parts.append(f"{stats.decode_tok_s:.1f} tok/s")
        if stats.prompt_tokens or stats.generated_tokens:
            cached = f" ({stats.reused_prompt_tokens} cached)" if stats.reused_prompt_tokens else ""
            parts.append(f"{stats.prompt_tokens} in{cached} / {stats.generated_tokens} out")
        if not stats.sparsity_target:
            parts.append("dense")
        elif stats.generated_tokens:
            parts.append(f"sparsity {stats.sparsity_realized:.0%}/{stats.sparsity_target:.0%}")
        else:
            parts.append(f"sparsity {stats.sparsity_target:.0%}")
        if stats.peak_gpu_mem_gb:
            parts.append(f"GPU {stats.peak_gpu_mem_gb:.1f}G")
        if stats.cache_hit_rate is not None:
            parts.append(f"cache {stats.cache_hit_rate:.0%}")
        dept, priv = getattr(stats, "department_hit_rate", None), getattr(stats, "private_hit_rate", None)
        if dept is not None and priv is not None:  # an offloaded DeaMoE's two pools
            parts.append(f"dept {dept:.0%} / private {priv:.0%}")
        if stats.h2d_bytes_per_token is not None:
            parts.append(f"host→GPU {stats.h2d_bytes_per_token / 1e6:.0f} MB/tok")
    return [p for p in parts if p]


def format_status(model: str, device: str, stats: EngineStats | None) -> str:
    """The status bar's figures on one line."""
    return " · ".join(status_parts(model, device, stats))


def wrap_parts(parts: list[str], width: int, max_lines: int = 2, sep: str = " · ") -> list[str]:
    """`parts` joined with `sep` into lines of at most `width` cells, breaking only between parts; what does not
    fit in `max_lines` is left out from the end (the least important figures), a part longer than a line cut."""
    lines: list[str] = []
    for part in parts:
        part = part if len(part) <= width else part[: max(1, width - 1)] + "…"
        if lines and len(lines[-1]) + len(sep) + len(part) <= width:
            lines[-1] += sep + part
        elif len(lines) < max_lines:
            lines.append(part)
        else:
            break
    return lines
