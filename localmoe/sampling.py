"""Next-token sampling on the device: greedy at temperature 0, else temperature, top-k, top-p (nucleus).

Shapes: V = vocabulary. Everything stays on the logits' device; the chosen id is a 0-d tensor so the
caller decides when to synchronise.
"""

from __future__ import annotations

import torch

from localmoe.events import GenerationSettings


def make_generator(settings: GenerationSettings, device: torch.device) -> torch.Generator | None:
    if settings.temperature <= 0:
        return None
    gen = torch.Generator(device=device)
    if settings.seed is not None:
        gen.manual_seed(settings.seed)
    else:
        gen.seed()
    return gen


def sample(logits: torch.Tensor, settings: GenerationSettings, generator: torch.Generator | None) -> torch.Tensor:
    """logits [V] -> token id (0-d int64 tensor)."""
    if settings.temperature <= 0:
        return torch.argmax(logits)
    scores = logits.float() / settings.temperature
    if settings.top_k and settings.top_k > 0:
        k = min(settings.top_k, scores.numel())
        kth = torch.topk(scores, k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if 0.0 < settings.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cum = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_scores, dim=-1) >= settings.top_p  # keep the first token past top_p
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(0)
