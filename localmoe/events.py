"""What the Engine streams to its consumers (CLI, TUI, bench, eval), and the protocol they rely on.

Nothing here imports torch, so front ends can type against it cheaply.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class GenerationSettings:
    """Sampling and stopping for one reply. temperature 0 means greedy.

    `repetition_penalty` as transformers' RepetitionPenaltyLogitsProcessor: every token of the prompt and the reply so
    far has its logit divided by it when positive, multiplied when not (1.0 = off); applied before temperature, top-k
    and top-p, greedy included. `stop`: strings that end the reply (finish_reason "stop"); the stop string and what
    follows it are not part of the reply's text. `frequency_penalty` / `presence_penalty` as OpenAI's API defines
    them: subtracted from the logits of tokens the reply has produced (count times frequency, plus presence once),
    after the repetition penalty; 0 = off. `Engine.default_settings()` gives the checkpoint's own values."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    frequency_penalty: float = 0.0  # OpenAI's: minus this times a token's count in the reply so far
    presence_penalty: float = 0.0  # OpenAI's: minus this once a token is in the reply so far


@dataclass(frozen=True)
class TokenEvent:
    """One generated token: its id, the text it adds to the reply (may be empty mid-codepoint, inside a tag or while
    it may begin a stop string), its index, and the channel that text belongs to: "reasoning" inside a thinking
    model's `<think>…</think>` block (the tags themselves are never in `text`), else "answer".

    Every token gives at least one event. A token whose text falls in both channels gives one event per channel, and
    text held back to the end of the reply comes in a last event; those extra events repeat the token's id and index,
    so count tokens by index."""

    token_id: int
    text: str
    index: int
    channel: str = "answer"


@dataclass
class EngineStats:
    """Figures for the reply in flight (updated per token) or the last finished one."""

    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0  # of prompt_tokens, those the cache held from the turn before (not prefilled)
    generated_tokens: int = 0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    sparsity_target: float = 0.0
    sparsity_realized: float = 0.0
    peak_gpu_mem_gb: float = 0.0
    cache_hit_rate: float | None = None  # None until expert offloading is active
    h2d_bytes_per_token: float | None = None
    # offloaded DeaMoE only (None otherwise): the department cache's two pools, hit rates over decode lookups
    department_hit_rate: float | None = None  # departments' shared projections found resident
    private_hit_rate: float | None = None  # experts' private parts found resident
    finish_reason: str = ""  # "stop" (EOS or a stop string), "length", "cancelled", or "" while running
    load_s: float = 0.0  # seconds the engine took to load (resolve, weights, thresholds)
    ttft_s: float = 0.0  # the last reply's time to first token: from the generate call to its first token
    wall_s: float = 0.0  # the last reply's wall time, from the generate call to its end (so far, while running)
    extra: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        d.update(self.extra)
        return d


# Progress callback for long work: (stage, done, total). stage is e.g. "download", "load", "calibrate".
ProgressFn = Callable[[str, int, "int | None"], None]

Message = dict  # {"role": "system"|"user"|"assistant", "content": str}


class ChatEngine(Protocol):
    """What a front end needs from an engine. `localmoe.engine.engine.Engine` implements it; tests script fakes."""

    model_name: str
    device: str

    def chat(self, messages: Sequence[Message], settings: GenerationSettings) -> Iterator[TokenEvent]:
        """Format `messages` with the chat template and stream the reply. Blocking; run it off the UI thread."""
        ...

    def cancel(self) -> None:
        """Ask the reply in flight to stop after the current token (thread-safe)."""
        ...

    @property
    def stats(self) -> EngineStats: ...

    def set_sparsity(self, sparsity: float, progress: ProgressFn | None = None) -> None:
        """Switch the decode sparsity target (0 = dense); may calibrate first."""
        ...
