"""One reply, from the validated prompt to its last TokenEvent, as small named steps (after gpt-fast's
prefill / decode_one_token / decode_n_tokens):

    generate          the reply: prefill → the first token → capture → decode_n_tokens → final stats
    prefill           the prompt into the graph decoder's static cache, or the eager dynamic cache (prompt reuse:
                      decode/prefix.py); out of GPU memory is a one-line RuntimeFailure
    capture           the decoder's CUDA graph, captured once; a failure falls back to eager with a notice
    DecodeStep        decode_one_token: an eager forward or a graph replay, then sampling; or a greedy replay that
                      chooses the token (repetition penalty included) inside the graph
    Pipeline          CUDA steps launched ahead of the token the host reads, a pinned host slot and event each
    decode_n_tokens   the loop: EOS, stop strings, the length limit and cancel; TokenEvents by channel; live stats
    ReplyText         tokens to text: detokenizing, stop strings, the reasoning split, text held back at the end

The Engine (engine.py) checks the request and holds its lock; figures are stats.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from localmoe.decode.graph import GraphUnavailable
from localmoe.engine import prompts
from localmoe.engine import stats as figures
from localmoe.engine.detokenize import Detokenizer, StopStrings
from localmoe.engine.reasoning import HarmonySplitter, ReasoningSplitter
from localmoe.engine.sampling import Seen, make_generator, sample
from localmoe.errors import RuntimeFailure
from localmoe.events import EngineStats, GenerationSettings, TokenEvent


def cache_of(out):
    """The dynamic cache a transformers forward returned (`cache` or, before transformers 5.2x, `past_key_values`)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


class ReplyText:
    """A reply's tokens as text events: detokenized, passed through the stop strings and, for a thinking model, the
    reasoning splitter (events carry their channel). A harmony model's message markers are kept in the text (its
    other special tokens are skipped as every model's are): its splitter reads them there (a raw reply keeps them,
    as it was written)."""

    def __init__(self, tokenizer, stop, splitter: ReasoningSplitter | HarmonySplitter | None):
        self.detok = Detokenizer(tokenizer, keep=prompts.marker_ids(tokenizer))
        self.stopper = StopStrings(stop)
        self.splitter = splitter

    @property
    def stopped(self) -> bool:
        return self.stopper.stopped

    def push(self, tok: int) -> str:
        """The text token `tok` shows now (stop strings may hold some back)."""
        return self.stopper.push(self.detok.push(tok))

    def events(self, text: str, tok: int, index: int) -> list[TokenEvent]:
        """The token's events: its text by channel (one event, maybe empty, when it shows nothing now)."""
        splitter = self.splitter
        if splitter is None:
            return [TokenEvent(token_id=tok, text=text, index=index)]
        parts = splitter.push(text)
        return [TokenEvent(token_id=tok, text=t, index=index, channel=c) for c, t in parts] or [
            TokenEvent(token_id=tok, text="", index=index, channel=splitter.channel)
        ]

    def flush(self, last: int, index: int) -> list[TokenEvent]:
        """Text held back (a possible stop string or tag that never completed), which ends the reply."""
        held = self.stopper.flush()
        splitter = self.splitter
        parts = (splitter.push(held) + splitter.flush()) if splitter is not None else [("answer", held)]
        return [TokenEvent(token_id=last, text=text, index=index, channel=channel) for channel, text in parts if text]


def prefill(engine, graph, ids: torch.Tensor, stable: int):
    """The prompt ids [1, P] prefilled -> (dynamic cache or None with a graph, last logits [V], prompt tokens
    reused)."""
    try:
        if graph is not None:
            logits = graph.prefill(ids, stable)
            return None, logits, graph.reused
        return engine._prefill(ids, stable)
    except torch.OutOfMemoryError:
        raise RuntimeFailure("out of GPU memory during prefill: shorten the prompt or use --device cpu") from None


def capture(engine, graph, cache, ids: torch.Tensor, stable: int, n_prompt: int):
    """The decoder's CUDA graph captured when it has none yet (then the prompt prefilled again: capture's warm-up
    steps advanced recurrent state); a capture that fails decodes eagerly from a dynamic cache rebuilt from the
    prompt, with a notice -> (graph or None, cache)."""
    if graph is None or graph.graph is not None:
        return graph, cache
    try:
        graph.capture(n_prompt)
        graph.prefill(ids, stable)
    except GraphUnavailable as e:
        engine.use_graphs = False
        engine._drop_graph()
        engine._notice(f"CUDA graph capture failed ({e}); decoding eagerly")
        cache, _, _ = engine._prefill(ids, stable)
        return None, cache
    return graph, cache


class DecodeStep:
    """decode_one_token at a position: an eager forward on the dynamic cache or a graph replay, the token sampled on
    the device; or, greedy with a graph that chooses, a replay whose captured argmax picks it (reading and marking
    the seen mask for the repetition penalty) and also writes it to the host (decode/graph.py)."""

    def __init__(self, engine, graph, settings: GenerationSettings, gen, seen: Seen):
        self.engine, self.graph, self.settings, self.gen, self.seen = engine, graph, settings, gen, seen
        self.greedy = (
            graph is not None
            and graph.chooses
            and engine.graph_greedy
            and settings.temperature <= 0
            and (graph.penalizes or not seen.active)
            and not seen.additive  # frequency/presence penalties: chosen on the step's logits (sampling.penalize)
        )
        if graph is not None:  # the captured argmax applies the penalty only when it chooses the token
            graph.set_penalty(seen.value if self.greedy else 1.0)

    def __call__(self, token: torch.Tensor, cache, position: int):
        """-> (device token, the same on the host once the step is done or None, cache)."""
        if self.greedy:
            return *self.graph.step_greedy(token, position), cache
        if self.graph is not None:
            logits = self.graph.step(token, position)
        else:
            engine = self.engine
            out = engine.model(
                input_ids=token.view(1, 1), use_cache=True, **{engine._cache_kw: cache}, **engine._logits_kw
            )
            cache, logits = cache_of(out), out.logits[0, -1]
        return sample(logits, self.settings, self.gen, self.seen), None, cache


class Pipeline:
    """Up to `depth` steps launched ahead (each one's input, the token before, is already on the device) before the
    host reads their tokens, so detokenising, streaming, stats and the launches themselves overlap the GPU's work and
    the GPU never waits for the host between steps. On CUDA each step in flight has a pinned host slot and an event,
    reused round-robin. A step launched past an EOS the host has not read yet is thrown away: the next turn prefills
    its prompt again."""

    def __init__(self, depth: int, cuda: bool):
        self.depth, self.cuda = depth, cuda
        self.slots = (
            [(torch.empty((), dtype=torch.long, pin_memory=True), torch.cuda.Event()) for _ in range(depth)]
            if depth and cuda
            else []
        )
        self.inflight: list[tuple[torch.Tensor, int, torch.Tensor | None]] = []  # (device token, slot, host token)
        self.launched = 0

    def fill(self, step: DecodeStep, token, cache, done: int, limit: int, first_position: int, cancelled):
        """Launch ahead from the `done`-th token (`token`, or the last in flight): the step producing token index
        done + in flight, input at that minus one (position `first_position` + that), up to `limit` tokens and not
        once `cancelled()` -> cache."""
        inflight = self.inflight
        while len(inflight) < self.depth and done + len(inflight) < limit and not cancelled():
            src = inflight[-1][0] if inflight else token
            nxt, on_host, cache = step(src, cache, first_position + done + len(inflight) - 1)
            slot = self.launched % self.depth
            if self.cuda:
                host, event = self.slots[slot]
                if on_host is None:
                    host.copy_(nxt.reshape(()), non_blocking=True)
                event.record()
            inflight.append((nxt, slot, on_host))
            self.launched += 1
        return cache

    def pop(self) -> tuple[torch.Tensor, int]:
        """The oldest step in flight -> (its device token, the token), waiting for that step (or copy) only, not the
        steps launched behind it."""
        token, slot, on_host = self.inflight.pop(0)
        if not self.cuda:
            return token, int(token)
        host, event = self.slots[slot]
        event.synchronize()
        return token, int(host if on_host is None else on_host)


def launch_depth(engine, expert_cache) -> int:
    """Steps launched ahead: the engine's pipeline depth, but none while direct/cpu misses admit experts (each step's
    routing is read back before the next one)."""
    if expert_cache is None or expert_cache.mode == "copy" or not expert_cache.admits:
        return engine.pipeline_depth
    return 0


@dataclass
class Reply:
    """One reply's state between the steps."""

    engine: object
    stats: EngineStats
    text: ReplyText
    n_prompt: int
    max_new: int
    t_call: float
    graph: object = None
    expert_cache: object = None
    t_decode: float = 0.0
    generated: list[int] = field(default_factory=list)
    cancelled: Callable[[], bool] | None = None  # the reply's own cancel check (Engine.generate's `cancelled`)

    def stopping(self) -> bool:
        """cancel() was called, or the reply's own cancel check says so."""
        return self.engine._cancel.is_set() or (self.cancelled is not None and self.cancelled())

    def sparsity(self) -> float:
        return self.engine.realized_sparsity(self.graph)


def seen_mask(engine, logits: torch.Tensor, prompt_ids: Sequence[int], settings: GenerationSettings) -> Seen:
    """The penalties' seen-token mask, started from the prompt (made once, before the first capture: the graph's
    argmax reads and marks it), with the reply's counts for the frequency and presence penalties."""
    if engine._seen is None:
        engine._seen = Seen(logits.numel(), engine._device)
    s = settings
    engine._seen.start(prompt_ids, s.repetition_penalty, s.frequency_penalty, s.presence_penalty)
    return engine._seen


def generate(
    engine,
    prompt_ids: Sequence[int],
    settings: GenerationSettings,
    stable: int,
    n_prompt: int,
    max_new: int,
    t_call,
    cancelled: Callable[[], bool] | None = None,
    splitter: ReasoningSplitter | HarmonySplitter | None = None,
) -> Iterator[TokenEvent]:
    """Stream the reply to prompt_ids (checked by Engine.generate, under its lock); `engine.stats` is this reply's
    from the start and updated as it goes. `cancelled`: the reply's own cancel check, beside `engine.cancel()`;
    `splitter`: a thinking model's reasoning splitter (None: all text on the answer channel)."""
    engine._cancel.clear()
    stats = EngineStats(prompt_tokens=n_prompt, sparsity_target=engine.sparsity, load_s=engine.load_s)
    engine._stats = stats
    device = engine._device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    gen = make_generator(settings, device)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    text = ReplyText(engine.tokenizer, settings.stop, splitter)
    reply = Reply(engine, stats, text, n_prompt, max_new, t_call, graph=engine._graph_decoder(), cancelled=cancelled)
    engine._reset_counters(reply.graph)
    t0 = time.perf_counter()
    cache, logits, reused = prefill(engine, reply.graph, ids, stable)
    seen = seen_mask(engine, logits, prompt_ids, settings)
    token = sample(logits, settings, gen, seen)
    tok = int(token)  # synchronises: prefill done
    figures.prefilled(stats, n_prompt, reused, time.perf_counter() - t0)
    reply.graph, cache = capture(engine, reply.graph, cache, ids, stable, n_prompt)
    engine._reset_counters(reply.graph)  # realised sparsity counts decode steps only
    reply.expert_cache = engine.loaded.cache
    if reply.expert_cache is not None:
        reply.expert_cache.reset_stats()
    reply.t_decode = time.perf_counter()
    pipeline = Pipeline(launch_depth(engine, reply.expert_cache), cuda)
    step = DecodeStep(engine, reply.graph, settings, gen, seen)
    finish = yield from decode_n_tokens(reply, step, pipeline, token, tok, cache)
    if reply.generated:
        yield from text.flush(reply.generated[-1], len(reply.generated) - 1)
    n = len(reply.generated)
    figures.final(stats, reply.sparsity, reply.expert_cache, n, t_call, reply.t_decode, finish, device)


def decode_n_tokens(reply: Reply, step: DecodeStep, pipeline: Pipeline, token: torch.Tensor, tok: int, cache):
    """From the first token (`token` on the device, `tok` read): each token's events, until EOS or a stop string
    ("stop"), `max_new` tokens ("length") or `cancel()` ("cancelled") -> the finish reason."""
    engine, generated = reply.engine, reply.generated
    cancelled = reply.stopping
    while True:
        if tok in engine.eos_ids:
            return "stop"
        generated.append(tok)
        cache = pipeline.fill(step, token, cache, len(generated), reply.max_new, reply.n_prompt, cancelled)
        delta = reply.text.push(tok)
        figures.live(reply.stats, reply.sparsity, reply.expert_cache, len(generated), reply.t_call, reply.t_decode)
        yield from reply.text.events(delta, tok, len(generated) - 1)
        if reply.text.stopped:
            return "stop"
        if len(generated) >= reply.max_new:
            return "length"
        if cancelled():
            return "cancelled"
        if pipeline.inflight:
            token, tok = pipeline.pop()
        else:
            token, _, cache = step(token, cache, reply.n_prompt + len(generated) - 1)
            tok = int(token)
        engine._after_step()
