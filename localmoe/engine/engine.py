"""The Engine: owns everything from loading a model to streaming its reply, at batch 1.

    Engine.load(MODEL) → resolve (hub) → tokenizer → load (loader: experts into localmoe's store)
                       → sparsity thresholds (sparsity: cached calibration) → ready
    engine.chat(messages) / engine.generate(ids) → prefill (dense path, 2048-token chunks; a chat's history the
                       cache already holds is not prefilled again: prefix.py) → decode loop (sparse
                       path; on CUDA one captured graph per step, steps N+1, N+2 launched before token N is streamed)
                       → TokenEvent per token; `stats` updated as it goes; `cancel()` from any thread.

Sampling: `default_settings()` is the checkpoint's generation_config.json; the repetition penalty keeps a seen-token
mask on the device (sampling.Seen), read and updated inside the CUDA graph's greedy step. A reply's text passes
stop strings (detokenize.StopStrings) and, for a thinking model, the reasoning splitter (reasoning.py): events carry
their channel, "reasoning" or "answer".

It knows nothing about terminals: the CLI, the Textual app, bench and eval consume its events and stats.
"""

from __future__ import annotations

import inspect
import math
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from localmoe.decode.prefix import PromptReuse, prefill, render_chat, repeated_prefix, reply_prefix
from localmoe.devices import pick_device, pick_dtype, vram_budget
from localmoe.engine import plan
from localmoe.engine.detokenize import Detokenizer, StopStrings
from localmoe.engine.reasoning import CLOSE, OPEN, ReasoningSplitter, opens_reasoning
from localmoe.engine.sampling import Seen, generation_defaults, make_generator, sample
from localmoe.errors import RuntimeFailure, UsageError
from localmoe.events import EngineStats, GenerationSettings, Message, ProgressFn, TokenEvent
from localmoe.models import hub
from localmoe.models.checkpoint import check_tokenizer, read_config
from localmoe.models.loaded import LoadedModel, int4_hint
from localmoe.models.loader import LoadOptions, load_model
from localmoe.models.registry import DEFAULT_CONTEXT, UNKNOWN_MODEL_SPARSITY
from localmoe.models.shapes import shape_config

LIVE_STATS_EVERY = 8  # tokens between live updates of realised sparsity / cache hit rate
PIPELINE_DEPTH = 2  # CUDA decode steps in flight ahead of the host: the GPU never waits for Python between steps
PREFILL_CHUNK = 2048  # prompt tokens per prefill forward: long prompts are prefilled piece by piece into the cache


class _TemplateArgs:
    """A tokenizer whose apply_chat_template gets extra template variables (enable_thinking), so that prefix.py's
    renders (the prompt, the next turn's, the reply's) all see the same thinking switch."""

    def __init__(self, tokenizer, **kwargs):
        self._tokenizer, self._kwargs = tokenizer, kwargs

    def apply_chat_template(self, *args, **kwargs):
        return self._tokenizer.apply_chat_template(*args, **{**self._kwargs, **kwargs})

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def load_tokenizer(path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as e:
        raise RuntimeFailure(f"cannot load the tokenizer from {path}: {str(e).splitlines()[0]}") from None


class Engine:
    def __init__(self, resolved: hub.ResolvedModel, loaded: LoadedModel, tokenizer, device, dtype):
        self.resolved = resolved
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = tokenizer
        self.device = str(device)
        self._device = device
        self.dtype = dtype
        self.model_name = resolved.name
        self.experts_format = "int4" if loaded.experts and loaded.experts[0].weights.int4 else "full"
        self.sparsity = 0.0
        self.threshold_mode = "layer"
        self._cancel = threading.Event()
        self._stats = EngineStats()
        self.eos_ids = self._eos_ids()
        self.max_positions = int(getattr(loaded.config, "max_position_embeddings", 0) or 0)
        # transformers >= 5.2x renamed the forward's `past_key_values` to `cache`; use whichever this one takes
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # prefill and decode need the last position's logits only (a 2048-token prompt's full logits at a 248k vocab
        # would be 2 GB)
        self._logits_kw = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.prefill_chunk = PREFILL_CHUNK
        self.context = min(DEFAULT_CONTEXT, self.max_positions) if self.max_positions else DEFAULT_CONTEXT
        self.use_graphs = device.type == "cuda"  # CUDA-graph decode (falls back to eager with a notice)
        # decode steps launched ahead of the token the host reads (see generate): 0 = one step at a time
        self.pipeline_depth = PIPELINE_DEPTH if device.type == "cuda" else 0
        self.graph_greedy = True  # greedy decode chooses its token inside the CUDA graph (graph.py step_greedy)
        self.compile = False  # torch.compile the decode step before capture (bench --compile; experimental)
        self.on_notice = None  # callable(str) for one-line notices (the CLI prints them on stderr)
        self._graph = None
        self.reuse_prompts = True  # rewind the cache to the prompt prefix it holds (a chat's history) instead of
        self._eager_cache = None  # prefilling it again; eager decoding keeps its dynamic cache here between turns
        self._eager_reuse = PromptReuse()
        self._busy = threading.RLock()  # one prefill or reply at a time (prepare_next_turn runs beside the app)
        self._seen: Seen | None = None  # the repetition penalty's seen-token mask (made at the first reply)
        self.load_s = 0.0
        self.notes: list[str] = []  # every notice of the load, in order (the plan line first); the chat can show them
        self.plan_line = ""  # the one-line plan (plan.py), also the load's first notice
        self._plan_shown = False
        self._defaults = generation_defaults(resolved.path) if tokenizer is not None else GenerationSettings()
        template = getattr(tokenizer, "chat_template", None)
        template = (
            template if isinstance(template, str) else " ".join(template.values()) if isinstance(template, dict) else ""
        )
        self.supports_thinking = "enable_thinking" in template
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        # a thinking model: its replies are split into reasoning and answer (reasoning.py)
        self.reasoning_tags = (OPEN, CLOSE) if (OPEN in vocab and CLOSE in vocab) or CLOSE in template else None

    # -- construction ---------------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        model: str,
        *,
        device: str | None = None,
        dtype: str | None = None,
        sparsity: float | None = None,
        progress: ProgressFn | None = None,
        calibration_text: str | None = None,
        vram_gib: float | None = None,
        context: int | None = None,
        on_notice=None,
        fused: bool = True,
        offload_miss: str = "auto",
        host_storage: str = "auto",
        experts: str = "full",
        show_plan: bool = False,
    ) -> Engine:
        """Resolve, load and calibrate MODEL. Notices go to `on_notice` and `engine.notes`; the plan line
        (`plan_line`, `localmoe show`'s one-line plan) is the first of `notes`, and goes to `on_notice` too with
        `show_plan` (the CLI's run on a terminal)."""
        t0 = time.perf_counter()
        notes: list[str] = []
        notice = _recording(notes, on_notice)
        dev = pick_device(device)
        dt = pick_dtype(dtype, dev)
        resolved = hub.resolve(model, progress=progress)
        read_config(resolved.path)  # a bad config.json or a folder without a tokenizer: the loader's own messages
        check_tokenizer(resolved.path)
        tokenizer = load_tokenizer(resolved.path)
        budget = vram_budget(dev, vram_gib)
        try:
            options = LoadOptions(
                vram_bytes=budget,
                context=context or DEFAULT_CONTEXT,
                fused=fused,
                offload_miss=offload_miss,
                host_storage=host_storage,
                store_key=(resolved.name, resolved.revision),
                experts_format=experts,
            )
            loaded = load_model(
                resolved.path, device=dev, dtype=dt, options=options, progress=progress, on_notice=notice
            )
        except torch.OutOfMemoryError:
            raise RuntimeFailure(
                f"out of GPU memory loading {resolved.name}: free the GPU, use a smaller --dtype, or --device cpu"
            ) from None
        engine = cls(resolved, loaded, tokenizer, dev, dt)
        engine.on_notice = notice
        engine.notes = notes
        if context:
            engine.set_context(context)
        if sparsity is None:
            d = resolved.default_sparsity
            sparsity = UNKNOWN_MODEL_SPARSITY if d is None else d
        engine._plan_notice(sparsity, show_plan)
        engine._defaults = generation_defaults(resolved.path, notice)
        engine._offload_notices()
        engine.set_sparsity(sparsity, progress, calibration_text=calibration_text)
        engine.on_notice = on_notice  # later notices (recalibration, graph fallbacks) go to the caller only
        engine.load_s = time.perf_counter() - t0
        engine._stats = replace(engine._stats, load_s=engine.load_s)
        return engine

    @classmethod
    def random(
        cls,
        shape: str,
        *,
        device: torch.device,
        dtype: torch.dtype,
        vram_gib: float | None = None,
        context: int | None = None,
        on_notice=None,
        fused: bool = True,
        offload_miss: str = "auto",
        routing: str = "uniform",
        experts: str = "full",
    ) -> Engine:
        """A random-weight engine with a registry model's real config (for `bench --shape`); `routing` as in
        `random_weights.build_random`."""
        from localmoe.models.random_weights import build_random
        from localmoe.models.registry import load_registry

        t0 = time.perf_counter()
        config = shape_config(shape)
        options = LoadOptions(
            vram_bytes=vram_budget(device, vram_gib),
            context=context or DEFAULT_CONTEXT,
            fused=fused,
            offload_miss=offload_miss,
            experts_format=experts,
        )
        loaded = build_random(config, device=device, dtype=dtype, options=options, routing=routing, on_notice=on_notice)
        spec = load_registry().get(shape)
        resolved = hub.ResolvedModel(name=f"{shape} (random weights)", path=Path("."), spec=spec, revision="random")
        engine = cls(resolved, loaded, None, device, dtype)
        engine.on_notice = on_notice
        if context:
            engine.set_context(context)
        engine._offload_notices()
        engine.set_sparsity(0.0)
        engine.load_s = time.perf_counter() - t0
        engine._stats = replace(engine._stats, load_s=engine.load_s)
        return engine

    def _plan_notice(self, sparsity: float, show: bool = True) -> None:
        """The one-line plan (`localmoe show`'s), as the load's first notice (only recorded in `notes` unless
        `show`)."""
        try:
            self.plan_line = plan.engine_plan(self, sparsity).line()
        except Exception:  # noqa: BLE001 - a plan it cannot describe is no reason to fail a load that worked
            return
        if show:
            self._notice(self.plan_line)
            self._plan_shown = True
        else:
            self.notes.append(self.plan_line)

    def _offload_notices(self) -> None:
        loaded = self.loaded
        if loaded.cache is None:
            return
        pin_failed = self._device.type == "cuda" and not loaded.host_pinned and loaded.host_storage != "mmap"
        if not self._plan_shown:  # else the plan line has said what the VRAM holds
            self._notice(loaded.offload.summary())
        if pin_failed:
            self._notice("pinning host memory failed, using pageable memory (slower misses)")
        hint = int4_hint(loaded)
        if hint:
            self._notice(hint)
        if loaded.offload.spills and self._device.type == "cuda":
            self.use_graphs = False  # accelerate's hooks copy the host-resident units' weights in on every forward
            self._notice(
                "non-expert modules that do not fit run through accelerate's offload hooks: decoding eagerly "
                "(no CUDA graph, no fused modules); a larger --vram keeps them on the GPU"
            )
        if loaded.cache.mode == "direct":
            if self._device.type == "cuda" and not loaded.host_pinned:
                why = (
                    "the expert master copies are memory-mapped files"
                    if loaded.host_storage == "mmap"
                    else "pinned host memory could not be allocated"
                )
                raise RuntimeFailure(
                    f"--offload-miss direct needs pinned host memory and {why}: use --offload-miss "
                    "copy (or auto), or free RAM"
                )
            cache = loaded.cache
            tier = (
                f"; VRAM holds {cache.gate_slots} of {cache.num_experts * len(cache.masters)} experts' gates "
                f"and {cache.slots} experts' up/down rows (gates first: read whole for every routed expert)"
                if cache.gate_slots
                else ""
            )
            self._notice("expert misses are read straight from pinned host memory inside the CUDA graph" + tier)
        elif loaded.cache.mode == "cpu":
            self.use_graphs = False
            self._notice("expert misses are computed on the CPU; decoding eagerly (no CUDA graph)")
        else:
            self.use_graphs = False
            self._notice("copy-then-compute offloading decodes eagerly (no CUDA graph)")

    def _after_step(self) -> None:
        """Direct-miss offloading: let the expert cache see what the step routed to (and admit some misses)."""
        cache = self.loaded.cache
        if cache is not None and cache.admits:
            cache.observe_step(self.loaded.experts)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for src in (
            getattr(gen, "eos_token_id", None),
            getattr(self.loaded.config, "eos_token_id", None),
            self.tokenizer.eos_token_id if self.tokenizer is not None else None,
        ):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(i) for i in src)
        return ids

    # -- sparsity -------------------------------------------------------------------------------------
    def set_sparsity(self, sparsity: float, progress: ProgressFn | None = None, calibration_text: str | None = None):
        if not 0.0 <= sparsity < 1.0:
            raise UsageError(f"sparsity must be in [0, 1), got {sparsity}")
        with self._busy:  # not while a reply or the next turn's prefill runs in another thread
            self._set_sparsity(sparsity, progress, calibration_text)

    def _set_sparsity(self, sparsity: float, progress: ProgressFn | None, calibration_text: str | None) -> None:
        from localmoe.experts import thresholds

        if sparsity == 0.0:
            thresholds.disable(self.loaded, device=self._device)
        else:
            table = thresholds.thresholds_for(
                self, sparsity, progress=progress, text=calibration_text, mode=self.threshold_mode
            )
            thresholds.apply(self.loaded, table, device=self._device)
        self.sparsity = sparsity
        self._drop_graph()  # captured against the old thresholds / path: capture again
        self._forget_prompt()
        self._stats = replace(self._stats, sparsity_target=sparsity)

    # -- prompts ----------------------------------------------------------------------------------------
    def default_settings(self) -> GenerationSettings:
        """The checkpoint's sampling defaults (generation_config.json: temperature, top_k, top_p,
        repetition_penalty; do_sample false or absent = greedy), GenerationSettings' defaults for the rest."""
        return self._defaults

    def override_defaults(self, **fields) -> GenerationSettings:
        """Fields (a front end's sampling flags) over the checkpoint's defaults: `default_settings()` returns the
        result from now on. Unknown fields are a TypeError, as GenerationSettings' own."""
        self._defaults = replace(self._defaults, **fields)
        return self._defaults

    def _template(self, think: bool | None):
        """The tokenizer, rendering with `enable_thinking=think` when given and the template has the switch."""
        if think is None or not self.supports_thinking:
            return self.tokenizer
        return _TemplateArgs(self.tokenizer, enable_thinking=bool(think))

    def encode_chat(self, messages: Sequence[Message], think: bool | None = None) -> list[int]:
        """The prompt for `messages` through the chat template, with its generation header. `think`: the template's
        thinking switch (`enable_thinking`), None = the template's default. An assistant message may carry its
        reasoning as `reasoning_content`: the template renders it where (and if) it wants it."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise UsageError(f"{self.model_name} has no chat template: use --raw to send the prompt as is")
        for m in messages:
            _check_unicode(m.get("content"), f"the {m.get('role', 'message')} message")
            _check_unicode(m.get("reasoning_content"), f"the {m.get('role', 'message')} message's reasoning")
        return render_chat(self._template(think), messages, True)

    def encode_raw(self, prompt: str) -> list[int]:
        _check_unicode(prompt, "the prompt")
        return list(self.tokenizer(prompt)["input_ids"])

    def chat(
        self, messages: Sequence[Message], settings: GenerationSettings, think: bool | None = None
    ) -> Iterator[TokenEvent]:
        ids = self.encode_chat(messages, think)
        return self.generate(ids, settings, stable=repeated_prefix(self._template(think), messages, ids))

    @torch.inference_mode()
    def prepare_next_turn(self, messages: Sequence[Message], think: bool | None = None) -> int:
        """After a reply, while the user writes the next message: prefill the conversation (its last message the
        reply) up to where any next prompt continues, so that turn prefills only its new message. The cache already
        holds the prompt before the reply; this adds the reply (its decode steps ran past it, so the recurrent state
        is recomputed from the turn's prompt end). `think` as the next turn's encode_chat will have it.
        -> tokens prefilled (0: nothing to do)."""
        if not self.reuse_prompts or not getattr(self.tokenizer, "chat_template", None):
            return 0
        ids = reply_prefix(self._template(think), messages)
        if not ids or len(ids) >= self.context:
            return 0
        with self._busy:
            graph = self._graph if self.use_graphs else None
            if self.use_graphs and (graph is None or graph.graph is None):
                return 0  # no captured decoder (settings changed since the reply): its cache is gone
            x = torch.tensor([ids], dtype=torch.long, device=self._device)
            if graph is not None:
                graph.prefill(x, len(ids))
                reused = graph.reused
            else:
                _, _, reused = self._prefill(x, len(ids))
        return len(ids) - reused

    def set_context(self, tokens: int) -> None:
        if tokens < 16:
            raise UsageError(f"--context must be at least 16 tokens, got {tokens}")
        if self.max_positions and tokens > self.max_positions:
            raise UsageError(f"--context {tokens} is more than {self.model_name} supports ({self.max_positions})")
        with self._busy:  # the decoder a reply runs on is not released under it
            self.context = tokens
            self._drop_graph()
            self._forget_prompt()

    def _forget_prompt(self) -> None:
        """The next prompt is prefilled whole (a short prompt's prefill can take the sparse path: a cache filled
        under other settings is not reused)."""
        self._eager_cache = None
        self._eager_reuse.forget()

    def _notice(self, text: str) -> None:
        if self.on_notice is not None:
            self.on_notice(text)

    def _drop_graph(self) -> None:
        """The next reply captures a new decoder; this one's CUDA graph is destroyed now (graph.py: never during
        a later capture, when the collector would reach it)."""
        if self._graph is not None:
            self._graph.release()
        self._graph = None

    def _graph_decoder(self):
        from localmoe.decode.graph import GraphDecoder, GraphUnavailable

        if self._graph is None and self.use_graphs:
            try:
                self._graph = GraphDecoder(self, self.context, compile=self.compile)
            except GraphUnavailable as e:
                self.use_graphs = False
                self._notice(f"CUDA graph decode unavailable ({e}); decoding eagerly")
        return self._graph

    # -- control ----------------------------------------------------------------------------------------
    def cancel(self) -> None:
        self._cancel.set()

    @property
    def stats(self) -> EngineStats:
        return self._stats

    # -- the loop ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self, prompt_ids: Sequence[int], settings: GenerationSettings, *, stable: int = 0
    ) -> Iterator[TokenEvent]:
        """Stream the reply to prompt_ids. `stable`: how many of its first tokens the next prompt will repeat (a chat's
        history): the cache state there is kept, and a later prompt starting with them prefills only the rest."""
        t_call = time.perf_counter()
        if not prompt_ids:
            raise UsageError("the prompt is empty: give some text")
        n_prompt = len(prompt_ids)
        if self.max_positions and n_prompt >= self.max_positions:
            raise UsageError(f"the prompt has {n_prompt} tokens; {self.model_name} takes at most {self.max_positions}")
        if n_prompt >= self.context:
            raise UsageError(
                f"the prompt has {n_prompt} tokens but the context is {self.context}: "
                "shorten the prompt or raise --context"
            )
        if not (settings.repetition_penalty > 0 and math.isfinite(settings.repetition_penalty)):
            raise UsageError(f"the repetition penalty must be a positive number, got {settings.repetition_penalty}")
        max_new = min(settings.max_new_tokens, self.context - n_prompt)
        with self._busy:
            yield from self._generate(prompt_ids, settings, stable, n_prompt, max_new, t_call)

    def _splitter(self, prompt_ids) -> ReasoningSplitter | None:
        """A thinking model's reasoning splitter, starting inside the block when the prompt leaves one open."""
        if self.reasoning_tags is None or self.tokenizer is None:
            return None
        tail = self.tokenizer.decode(list(prompt_ids[-64:]), skip_special_tokens=False)
        open_tag, close_tag = self.reasoning_tags
        return ReasoningSplitter(
            in_reasoning=opens_reasoning(tail, open_tag, close_tag), open_tag=open_tag, close_tag=close_tag
        )

    def _generate(self, prompt_ids, settings, stable, n_prompt, max_new, t_call) -> Iterator[TokenEvent]:
        self._cancel.clear()
        stats = EngineStats(prompt_tokens=n_prompt, sparsity_target=self.sparsity, load_s=self.load_s)
        self._stats = stats
        cuda = self._device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self._device)
        gen = make_generator(settings, self._device)
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self._device)
        generated: list[int] = []
        detok = Detokenizer(self.tokenizer)
        stopper = StopStrings(settings.stop)
        splitter = self._splitter(prompt_ids)
        graph = self._graph_decoder()
        self._reset_counters(graph)
        t0 = time.perf_counter()
        try:
            if graph is not None:
                cache, logits = None, graph.prefill(ids, stable)
                reused = graph.reused
            else:
                cache, logits, reused = self._prefill(ids, stable)
        except torch.OutOfMemoryError:
            raise RuntimeFailure("out of GPU memory during prefill: shorten the prompt or use --device cpu") from None
        if self._seen is None:  # made before the first capture: the graph's argmax reads and marks it
            self._seen = Seen(logits.numel(), self._device)
        seen = self._seen
        seen.start(prompt_ids, settings.repetition_penalty)
        token = sample(logits, settings, gen, seen)
        tok = int(token)  # synchronises: prefill done
        t1 = time.perf_counter()
        stats.reused_prompt_tokens = reused
        stats.prefill_tok_s = (n_prompt - reused) / max(t1 - t0, 1e-9)  # tokens computed, not those reused
        if graph is not None and graph.graph is None:
            from localmoe.decode.graph import GraphUnavailable

            try:
                graph.capture(n_prompt)
                graph.prefill(ids, stable)  # capture's warm-up steps advanced recurrent state: redo the prompt
            except GraphUnavailable as e:
                self.use_graphs = False
                self._drop_graph()
                self._notice(f"CUDA graph capture failed ({e}); decoding eagerly")
                cache, _, _ = self._prefill(ids, stable)  # rebuild a dynamic cache from the prompt
                graph = None
        self._reset_counters(graph)  # realised sparsity counts decode steps only
        expert_cache = self.loaded.cache
        if expert_cache is not None:
            expert_cache.reset_stats()
        t_decode = time.perf_counter()
        finish = "length"
        # pipelined: up to `pipeline_depth` steps are launched ahead (each one's input, the token before, is already
        # on the device) before the host reads their tokens, so detokenising, streaming, stats and the launches
        # themselves overlap the GPU's work and the GPU never waits for the host between steps; not while
        # direct/cpu misses admit experts, which reads each step's routing back before the next one. A step
        # launched past an EOS the host has not read yet is thrown away: the next turn prefills its prompt again.
        depth = (
            self.pipeline_depth
            if (expert_cache is None or expert_cache.mode == "copy" or not expert_cache.admits)
            else 0
        )
        if depth and cuda:  # a pinned host slot and an event per step in flight, reused round-robin
            slots = [(torch.empty((), dtype=torch.long, pin_memory=True), torch.cuda.Event()) for _ in range(depth)]
        inflight: list[tuple[torch.Tensor, int, torch.Tensor | None]] = []  # (device token, slot, host token)
        launched = 0
        # greedy with a graph: the token is chosen inside the graph (repetition penalty included: its argmax reads
        # and marks the seen mask), which also writes it to the host (graph.py)
        greedy_graph = (
            graph is not None
            and graph.chooses
            and self.graph_greedy
            and settings.temperature <= 0
            and (graph.penalizes or not seen.active)
        )
        if graph is not None:  # the captured argmax applies the penalty only when it chooses the token
            graph.set_penalty(seen.value if greedy_graph else 1.0)

        def launch(token, cache, position):
            """-> (device token, the same on the host once the step is done or None, cache)."""
            if greedy_graph:
                return *graph.step_greedy(token, position), cache
            if graph is not None:
                logits = graph.step(token, position)
            else:
                out = self.model(
                    input_ids=token.view(1, 1), use_cache=True, **{self._cache_kw: cache}, **self._logits_kw
                )
                cache, logits = _cache_of(out), out.logits[0, -1]
            return sample(logits, settings, gen, seen), None, cache

        def events(text: str, tok: int, index: int) -> list[TokenEvent]:
            """The token's events: its text by channel (one event, maybe empty, when it shows nothing now)."""
            if splitter is None:
                return [TokenEvent(token_id=tok, text=text, index=index)]
            parts = splitter.push(text)
            return [TokenEvent(token_id=tok, text=t, index=index, channel=c) for c, t in parts] or [
                TokenEvent(token_id=tok, text="", index=index, channel=splitter.channel)
            ]

        while True:
            if tok in self.eos_ids:
                finish = "stop"
                break
            generated.append(tok)
            # launch ahead: the step producing token index len(generated) + len(inflight), input at that minus one
            while len(inflight) < depth and len(generated) + len(inflight) < max_new and not self._cancel.is_set():
                src = inflight[-1][0] if inflight else token
                nxt, on_host, cache = launch(src, cache, n_prompt + len(generated) + len(inflight) - 1)
                slot = launched % depth
                if cuda:
                    host, done = slots[slot]
                    if on_host is None:
                        host.copy_(nxt.reshape(()), non_blocking=True)
                    done.record()
                inflight.append((nxt, slot, on_host))
                launched += 1
            delta = stopper.push(detok.push(tok))
            stats.generated_tokens = len(generated)
            if len(generated) % LIVE_STATS_EVERY == 0:  # live figures for the status bar (a few device reads)
                stats.sparsity_realized = self.realized_sparsity(graph)
                if expert_cache is not None:
                    stats.cache_hit_rate, moved = expert_cache.figures()
                    stats.h2d_bytes_per_token = moved / (len(generated) - 1)
            now = time.perf_counter()
            if len(generated) > 1:
                stats.decode_tok_s = (len(generated) - 1) / max(now - t_decode, 1e-9)
            else:
                stats.ttft_s = now - t_call
            stats.wall_s = now - t_call
            yield from events(delta, tok, len(generated) - 1)
            if stopper.stopped:
                finish = "stop"
                break
            if len(generated) >= max_new:
                break
            if self._cancel.is_set():
                finish = "cancelled"
                break
            if inflight:
                token, slot, on_host = inflight.pop(0)
                if cuda:
                    host, done = slots[slot]
                    done.synchronize()  # that token's step (or copy) only, not the steps launched behind it
                    tok = int(host if on_host is None else on_host)
                else:
                    tok = int(token)
            else:
                token, _, cache = launch(token, cache, n_prompt + len(generated) - 1)
                tok = int(token)
            self._after_step()
        if generated:  # text held back (a possible stop string or tag that never completed) ends the reply
            last, index = generated[-1], len(generated) - 1
            held = stopper.flush()
            parts = (splitter.push(held) + splitter.flush()) if splitter is not None else [("answer", held)]
            for channel, text in parts:
                if text:
                    yield TokenEvent(token_id=last, text=text, index=index, channel=channel)
        t_end = time.perf_counter()
        if len(generated) > 1:
            stats.decode_tok_s = (len(generated) - 1) / max(t_end - t_decode, 1e-9)
        stats.sparsity_realized = self.realized_sparsity(graph)
        if expert_cache is not None:
            stats.cache_hit_rate, moved = expert_cache.figures()
            stats.h2d_bytes_per_token = moved / max(1, len(generated) - 1)
        if cuda:
            stats.peak_gpu_mem_gb = torch.cuda.max_memory_allocated(self._device) / 1e9
        stats.wall_s = time.perf_counter() - t_call
        stats.finish_reason = finish

    def _prefill(self, ids: torch.Tensor, stable: int = 0):
        """Eager prefill of ids [1, P] in chunks of `prefill_chunk` tokens into a dynamic cache, the last turn's
        rewound where the prompt repeats it -> (cache, last logits [V], prompt tokens reused)."""

        def forward(piece, start, cache):
            kw = {self._cache_kw: cache} if cache is not None else {}
            out = self.model(input_ids=piece, use_cache=True, **kw, **self._logits_kw)
            return _cache_of(out), out.logits[0, -1]

        reuse = self._eager_reuse if self.reuse_prompts else None
        cache, logits, reused = prefill(
            forward,
            self._eager_cache,
            ids,
            stable=stable,
            chunk=self.prefill_chunk,
            reuse=reuse,
            fresh=lambda cache: None,
        )
        self._eager_cache = cache if self.reuse_prompts else None  # decoding goes on in this same object
        return cache, logits, reused

    def _reset_counters(self, graph) -> None:
        for m in self.loaded.experts:
            m.reset_counters()
        if graph is not None:
            graph.steps = 0

    def realized_sparsity(self, graph=None) -> float:
        """Fraction of routed-expert neurons skipped on the sparse path since the counters were reset (one device
        read). Captured replays do not run Python, so `graph.steps` adds the neurons they considered."""
        experts = self.loaded.experts
        seen = sum(m.seen for m in experts)
        if graph is not None and graph.steps:
            seen += graph.steps * graph.k * sum(m.intermediate_size for m in experts if m.sparse_enabled)
        if seen == 0:
            return 0.0
        kept = int(torch.stack([m.kept.to(self._device) for m in experts]).sum())
        return 1.0 - kept / seen


def _recording(notes: list[str], on_notice):
    """on_notice that also keeps each notice in `notes`."""

    def notice(text: str) -> None:
        notes.append(text)
        if on_notice is not None:
            on_notice(text)

    return notice


def _check_unicode(text, what: str) -> None:
    """Text a tokenizer can take: a str without lone surrogates (undecodable bytes smuggled in by surrogateescape),
    which tokenizers reject with a TypeError."""
    if not isinstance(text, str):
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(
            f"{what} is not valid text (an undecodable byte or lone surrogate at character {e.start}): give UTF-8 text"
        ) from None


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
