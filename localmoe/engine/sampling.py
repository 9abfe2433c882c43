"""Next-token sampling on the device: the repetition penalty, then greedy at temperature 0, else temperature, top-k,
top-p (nucleus), in transformers' order.

The repetition penalty (transformers' RepetitionPenaltyLogitsProcessor) acts on the tokens of the prompt and the
reply so far, kept as a seen-token mask on the logits' device (`Seen`): each step's logits are penalised where the
mask is set (divided by the penalty when positive, multiplied when not) and the chosen token is marked, with no
host round trip. The CUDA-graph greedy step does the same inside its argmax kernel (kernels/argmax.py) on the same
mask, so eager and graph steps give the same tokens. OpenAI's frequency and presence penalties act on the reply's
tokens only, through a count per token beside the mask (`Seen.counts`), after the repetition penalty; while they
are on, a graph's step returns its logits and the token is chosen here (the captured argmax does not know them).

Shapes: V = vocabulary. Everything stays on the logits' device; the chosen id is a 0-d tensor so the
caller decides when to synchronise.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import torch

from localmoe.events import GenerationSettings
from localmoe.safe_text import for_line


def make_generator(settings: GenerationSettings, device: torch.device) -> torch.Generator | None:
    if settings.temperature <= 0:
        return None
    gen = torch.Generator(device=device)
    if settings.seed is not None:
        gen.manual_seed(settings.seed)
    else:
        gen.seed()
    return gen


class Seen:
    """The tokens of the prompt and the reply so far, for the repetition penalty: `mask` uint8 [V] on the device
    (1 = seen) and `penalty`, a float32 [1] tensor beside it (the CUDA graph's argmax reads both at replay time).
    Ids outside [0, V) are ignored, as transformers ignores ids past the logits' width."""

    def __init__(self, vocab: int, device: torch.device):
        self.mask = torch.zeros(vocab, dtype=torch.uint8, device=device)
        self.penalty = torch.ones(1, dtype=torch.float32, device=device)
        self.value = 1.0  # the penalty as a Python float (1.0: off)
        self.counts: torch.Tensor | None = None  # float32 [V]: each token's count in the reply (made when needed)
        self.frequency = 0.0  # OpenAI's frequency and presence penalties (0.0: off)
        self.presence = 0.0

    @property
    def active(self) -> bool:
        """The repetition penalty is on."""
        return self.value != 1.0

    @property
    def additive(self) -> bool:
        """The frequency or presence penalty is on."""
        return self.frequency != 0.0 or self.presence != 0.0

    def start(self, prompt_ids, penalty: float, frequency: float = 0.0, presence: float = 0.0) -> None:
        """A new reply: the mask holds the prompt's tokens (a list of ids, filtered on the host and copied once);
        `penalty` set; the reply's counts zeroed when the frequency or presence penalty is on."""
        self.value = float(penalty)
        self.penalty.fill_(self.value)
        self.frequency, self.presence = float(frequency), float(presence)
        if self.additive:
            if self.counts is None:
                self.counts = torch.zeros(self.mask.numel(), dtype=torch.float32, device=self.mask.device)
            self.counts.zero_()
        self.mask.zero_()
        V = self.mask.numel()
        ids = sorted({int(i) for i in prompt_ids if 0 <= int(i) < V})
        if ids:
            self.mask.index_fill_(0, torch.tensor(ids, dtype=torch.long).to(self.mask.device, non_blocking=True), 1)

    def mark(self, token: torch.Tensor) -> None:
        """Token (0-d device tensor) seen: marked (and counted, with the frequency or presence penalty on) on the
        device, no synchronisation."""
        self.mask.index_fill_(0, token.reshape(1), 1)
        if self.additive:
            self.counts.index_add_(0, token.reshape(1), torch.ones(1, dtype=torch.float32, device=token.device))


def penalize(logits: torch.Tensor, seen: Seen | None) -> torch.Tensor:
    """logits [V] -> float32 [V] with the repetition penalty applied where `seen.mask` is set (a copy when applied),
    then the frequency and presence penalties over the reply's counts. The repetition penalty divides as a float32
    tensor (IEEE division, as the argmax kernel's div_rn and transformers' `/`)."""
    x = logits.float()
    if seen is None:
        return x
    if seen.active:
        p = seen.penalty[0]
        x = torch.where(seen.mask.bool(), torch.where(x < 0, x * p, x / p), x)
    if seen.additive:
        x = x - seen.frequency * seen.counts - seen.presence * (seen.counts > 0).float()
    return x


def sample(
    logits: torch.Tensor, settings: GenerationSettings, generator: torch.Generator | None, seen: Seen | None = None
) -> torch.Tensor:
    """logits [V] -> token id (0-d int64 tensor); with `seen`, the penalties first, and the token marked."""
    on = seen is not None and (seen.active or seen.additive)
    token = _choose(penalize(logits, seen) if on else logits, settings, generator)
    if on:
        seen.mark(token)
    return token


def _choose(logits: torch.Tensor, settings: GenerationSettings, generator: torch.Generator | None) -> torch.Tensor:
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


# generation_config.json keys localmoe takes as the model's sampling defaults, with the range each must be in
GENERATION_KEYS = {
    "temperature": (0.0, 10.0),
    "top_p": (0.0, 1.0),
    "top_k": (0, 1 << 30),
    "repetition_penalty": (0.0, 10.0),
}


def generation_defaults(path, on_notice=None) -> GenerationSettings:
    """The checkpoint's sampling defaults from `path`/generation_config.json, as transformers' generate would use
    them: temperature, top_k, top_p and repetition_penalty where set; do_sample false or absent means greedy (the
    penalty still applies). What the file does not set, or sets out of range (said through `on_notice`), keeps
    GenerationSettings' default. No file (or an unreadable one): GenerationSettings()."""
    try:
        data = json.loads((Path(path) / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return GenerationSettings()
    if not isinstance(data, dict):
        return GenerationSettings()
    got: dict = {}
    for key, (lo, hi) in GENERATION_KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if key == "top_k":
            ok = ok and float(value).is_integer()
        ok = ok and (lo <= value <= hi if key in ("temperature", "top_k") else lo < value <= hi)
        if not ok:
            if on_notice is not None:
                on_notice(
                    f"generation_config.json: {key} {for_line(json.dumps(value))} is out of range; "
                    "using localmoe's default"
                )
            continue
        got[key] = int(value) if key == "top_k" else float(value)
    if data.get("do_sample") is not True:
        got["temperature"] = 0.0
    else:
        got.setdefault("temperature", 1.0)
    return replace(GenerationSettings(), **got)
