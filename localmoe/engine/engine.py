"""The Engine: owns everything from loading a model to streaming its reply, at batch 1.

    Engine.load(MODEL) → load.py's steps: resolve (hub) → tokenizer (prompts.py) → load (models/loader.py: experts
                       into localmoe's store) → notices (notices.py) → sparsity thresholds (experts/thresholds: cached
                       calibration) → ready; Engine.random(SHAPE) the same with random weights (bench --shape)
    engine.chat(messages) / engine.generate(ids) → the request checked, then generate.py's steps: prefill (dense
                       path, pieces of up to 2048 tokens, shorter where a VRAM budget is tight: fit_prefill; a chat's
                       history the cache already holds is not prefilled again: decode/prefix.py) → decode loop (sparse
                       path; on CUDA one captured graph per step, steps N+1, N+2 launched before token N is streamed)
                       → TokenEvent per token; `stats` (stats.py) updated as it goes; `cancel()` from any thread, or
                       a reply's own `cancelled` check (the server's);
                       engine.chat_prompt(messages) encodes a chat (tools too) for a later generate (the server)

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch

from localmoe.decode.graph import GraphDecoder, GraphUnavailable
from localmoe.decode.prefix import PromptReuse, prefill, render_chat, repeated_prefix, reply_prefix
from localmoe.engine import generate as reply
from localmoe.engine import prompts
from localmoe.engine import stats as figures
from localmoe.engine.load import load_engine, random_engine
from localmoe.engine.reasoning import ReasoningSplitter
from localmoe.engine.sampling import Seen, generation_defaults
from localmoe.errors import UsageError
from localmoe.events import EngineStats, GenerationSettings, Message, ProgressFn, TokenEvent
from localmoe.experts import predicted, predictor, prefill_budget, thresholds
from localmoe.experts.int4 import format_of
from localmoe.models import hub
from localmoe.models.loaded import LoadedModel
from localmoe.models.registry import DEFAULT_CONTEXT

PIPELINE_DEPTH = 2  # CUDA decode steps in flight ahead of the host: the GPU never waits for Python between steps
PREFILL_CHUNK = prefill_budget.MAX_CHUNK  # prompt tokens per prefill forward at most (a VRAM budget may lower it)


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
        self.experts_format = format_of(loaded.experts[0].weights.w_gate) if loaded.experts else "full"
        self.sparsity = 0.0
        self.departments = 0  # the gate predictor's departments per layer (--departments; 0 = off)
        self.rank: int | None = None  # its rank r (None: predictor.default_rank)
        self.z_sparsity = 0.0  # DeaMoE's second threshold τ_z at this quantile of |z| (--z-sparsity; 0 = off)
        self.calibration_tokens = thresholds.DEFAULT_TOKENS  # tokens of calibration text for τ and the predictor
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
        self.prefill_fit: prefill_budget.PrefillFit | None = None  # the chunk and staging span the budget chose
        self.context = min(DEFAULT_CONTEXT, self.max_positions) if self.max_positions else DEFAULT_CONTEXT
        self.use_graphs = device.type == "cuda"  # CUDA-graph decode (falls back to eager with a notice)
        # decode steps launched ahead of the token the host reads (see generate): 0 = one step at a time
        self.pipeline_depth = PIPELINE_DEPTH if device.type == "cuda" else 0
        self.graph_greedy = True  # greedy decode chooses its token inside the CUDA graph (decode/graph.py step_greedy)
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
        # a thinking model: its replies are split into reasoning and answer (reasoning.py)
        self.supports_thinking, self.reasoning_tags = prompts.thinking(tokenizer)
        self.reasoning_effort: str | None = None  # a harmony template's reasoning_effort; None: the template's
        self.fit_prefill()

    # -- construction (load.py: the signatures and what each step does) ---------------------------------
    load = classmethod(load_engine)  # Engine.load(model, *, device=None, ...): resolve, load and calibrate a model
    random = classmethod(random_engine)  # Engine.random(shape, *, device, dtype, ...): random weights, real shapes

    def _after_step(self) -> None:
        """Direct-miss offloading: let the expert cache see what the step routed to (and admit some misses)."""
        cache = self.loaded.cache
        if cache is not None and cache.admits:
            cache.observe_step(self.loaded.experts)

    def fit_prefill(self, left_bytes: int | None = None) -> prefill_budget.PrefillFit | None:
        """Under a VRAM budget: the prefill chunk and the staging span from the bytes it leaves (or `left_bytes`),
        experts/prefill_budget.fit_loaded; without one the chunk stays PREFILL_CHUNK. At load and on `set_context`."""
        loaded = self.loaded
        fit = prefill_budget.fit_loaded(
            loaded.offload, loaded.experts, loaded.cache, loaded.config, self.dtype, self.context, left_bytes
        )
        if fit is not None:
            self.prefill_chunk, self.prefill_fit = fit.chunk, fit
            if not fit.fits:
                self._notice(fit.line())
        return fit

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
        ids.update(prompts.stop_ids(self.tokenizer))  # harmony's <|return|> and <|call|>, whatever the config says
        return ids

    # -- sparsity -------------------------------------------------------------------------------------
    def set_sparsity(self, sparsity: float, progress: ProgressFn | None = None, calibration_text: str | None = None):
        if not 0.0 <= sparsity < 1.0:
            raise UsageError(f"sparsity must be in [0, 1), got {sparsity}")
        with self._busy:  # not while a reply or the next turn's prefill runs in another thread
            self._set_sparsity(sparsity, progress, calibration_text)

    def set_departments(self, departments: int, rank: int | None = None) -> None:
        """The department-shared gate predictor (issue #23) for the sparse path from the next `set_sparsity` on:
        N departments per layer (0 = off, the exact sparse path), rank r (None: the default). Resident experts of
        a vanilla MoE only; a bad N or r is a one-line usage error."""
        mods = self.loaded.experts
        if departments and (not mods or not hasattr(mods[0], "intermediate_size")):
            raise UsageError(f"--departments is for vanilla MoEs; {self.model_name} has DeaMoE departments already")
        if mods and hasattr(mods[0], "intermediate_size"):
            predictor.check_request(departments, rank, mods[0].num_experts, mods[0].hidden_size, self.model_name)
        if departments and mods and getattr(mods[0], "up_fn", None) is not None:
            raise UsageError(f"--departments predicts silu gates; {self.model_name}'s experts use a clamped SwiGLU")
        cache = self.loaded.cache
        if departments and cache is not None and (cache.mode != "direct" or not mods[0].predictor_fused(self._device)):
            raise UsageError(
                "--departments with offloaded experts needs direct misses on CUDA (--offload-miss direct): "
                "give a larger --vram or leave --departments out"
            )
        if (departments, rank) != (self.departments, self.rank):
            self._drop_graph()  # captured with the old predictor: the next set_sparsity applies the new one
        self.departments, self.rank = departments, rank

    def set_z_sparsity(self, z_sparsity: float) -> None:
        """DeaMoE's second threshold from the next `set_sparsity` on: z entries under the z_sparsity-quantile of |z|
        dropped and their W_down rows not read (0 = off). DeaMoE models only; a bad value is a one-line usage error."""
        if not 0.0 <= z_sparsity < 1.0:
            raise UsageError(f"--z-sparsity must be in [0, 1), got {z_sparsity}")
        if z_sparsity and not all(hasattr(m, "tau_z") for m in self.loaded.experts):
            raise UsageError(
                f"--z-sparsity is for DeaMoE models (departments); {self.model_name} has none: leave it out"
            )
        if z_sparsity != self.z_sparsity:
            self._drop_graph()  # captured with the old τ_z: the next set_sparsity applies the new one
        self.z_sparsity = z_sparsity

    def _set_sparsity(self, sparsity: float, progress: ProgressFn | None, calibration_text: str | None) -> None:
        if sparsity == 0.0:
            thresholds.disable(self.loaded, device=self._device)
        else:
            table = thresholds.thresholds_for(
                self,
                sparsity,
                progress=progress,
                text=calibration_text,
                tokens=self.calibration_tokens,
                z_sparsity=self.z_sparsity,
            )
            thresholds.apply(self.loaded, table, device=self._device)
        preds = None
        if sparsity and self.departments:
            preds, _ = predictor.predictors_for(
                self,
                table,
                self.departments,
                self.rank,
                text=calibration_text,
                tokens=self.calibration_tokens,
                progress=progress,
            )
            fused = all(m.predictor_fused(self._device) for m in self.loaded.experts)
            if self.use_graphs and not fused:  # the predictor's torch reference syncs with the host: no CUDA graph
                self.use_graphs = False
                self._notice("--departments decodes without the CUDA graph (these experts have no predictor kernel)")
        if any(hasattr(m, "predictor") for m in self.loaded.experts):  # LocalExperts (not DeaMoE's): set or clear
            predicted.make_room(self.loaded, preds)  # offloaded: B and C take the VRAM of some gates
            predicted.apply(self.loaded, preds, device=self._device)
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

    def _template(self, think: bool | None, tools: Sequence[dict] | None = None):
        """The tokenizer, rendering with `enable_thinking=think` when given and the template has the switch, and with
        `tools` (function definitions, the template's `tools` variable) when given."""
        kwargs = {"tools": list(tools)} if tools else {}
        if think is not None and self.supports_thinking:
            kwargs["enable_thinking"] = bool(think)
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return prompts.TemplateArgs(self.tokenizer, **kwargs) if kwargs else self.tokenizer

    def set_reasoning_effort(self, effort: str | None) -> bool:
        """How much a harmony model (gpt-oss) reasons before its answer: "low", "medium" or "high", its chat
        template's `reasoning_effort` (None: the template's default). False, and nothing set, when the template has
        no such variable."""
        if effort is not None and effort not in prompts.EFFORTS:
            raise UsageError(f"reasoning effort must be one of {', '.join(prompts.EFFORTS)}, got {effort!r}")
        takes = prompts.takes_effort(self.tokenizer)
        self.reasoning_effort = effort if takes else None
        return takes

    def encode_chat(
        self, messages: Sequence[Message], think: bool | None = None, tools: Sequence[dict] | None = None
    ) -> list[int]:
        """The prompt for `messages` through the chat template, with its generation header. `think`: the template's
        thinking switch (`enable_thinking`), None = the template's default. An assistant message may carry its
        reasoning as `reasoning_content`: the template renders it where (and if) it wants it. `tools`: function
        definitions ({"type": "function", "function": {...}}), given to the template as its `tools` variable."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise UsageError(f"{self.model_name} has no chat template: use --raw to send the prompt as is")
        for m in messages:
            prompts.check_unicode(m.get("content"), f"the {m.get('role', 'message')} message")
            prompts.check_unicode(m.get("reasoning_content"), f"the {m.get('role', 'message')} message's reasoning")
        return render_chat(self._template(think, tools), messages, True)

    def chat_prompt(
        self, messages: Sequence[Message], think: bool | None = None, tools: Sequence[dict] | None = None
    ) -> tuple[list[int], int]:
        """(the prompt ids for `messages`, as encode_chat; how many of them the conversation's next prompt repeats,
        generate's `stable`), so that a front end can encode a request before it queues it for `generate`."""
        ids = self.encode_chat(messages, think, tools)
        return ids, repeated_prefix(self._template(think, tools), messages, ids)

    def encode_raw(self, prompt: str) -> list[int]:
        prompts.check_unicode(prompt, "the prompt")
        return list(self.tokenizer(prompt)["input_ids"])

    def chat(
        self,
        messages: Sequence[Message],
        settings: GenerationSettings,
        think: bool | None = None,
        tools: Sequence[dict] | None = None,
    ) -> Iterator[TokenEvent]:
        ids, stable = self.chat_prompt(messages, think, tools)
        return self.generate(ids, settings, stable=stable)

    @torch.inference_mode()
    def prepare_next_turn(
        self, messages: Sequence[Message], think: bool | None = None, tools: Sequence[dict] | None = None
    ) -> int:
        """After a reply, while the user writes the next message: prefill the conversation (its last message the
        reply) up to where any next prompt continues, so that turn prefills only its new message. The cache already
        holds the prompt before the reply; this adds the reply (its decode steps ran past it, so the recurrent state
        is recomputed from the turn's prompt end). `think` and `tools` as the next turn's encode_chat will have them.
        -> tokens prefilled (0: nothing to do)."""
        if not self.reuse_prompts or not getattr(self.tokenizer, "chat_template", None):
            return 0
        ids = reply_prefix(self._template(think, tools), messages)
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
            self.fit_prefill()  # the KV cache's size and the attention's span changed

    def _forget_prompt(self) -> None:
        """The next prompt is prefilled whole (a short prompt's prefill can take the sparse path: a cache filled
        under other settings is not reused)."""
        self._eager_cache = None
        self._eager_reuse.forget()

    def _notice(self, text: str) -> None:
        if self.on_notice is not None:
            self.on_notice(text)

    def _drop_graph(self) -> None:
        """The next reply captures a new decoder; this one's CUDA graph is destroyed now (decode/graph.py: never during
        a later capture, when the collector would reach it)."""
        if self._graph is not None:
            self._graph.release()
        self._graph = None

    def _graph_decoder(self):
        if self._graph is None and self.use_graphs:
            try:
                self._graph = GraphDecoder(self, self.context)
            except GraphUnavailable as e:
                self.use_graphs = False
                self._notice(f"CUDA graph decode unavailable ({e}); decoding eagerly")
        return self._graph

    # -- control ----------------------------------------------------------------------------------------
    def cancel(self) -> None:
        self._cancel.set()

    @property
    def stats(self) -> EngineStats:
        """The reply's figures; under a VRAM budget `extra` holds the prefill chunk, the staging span and the resident
        4-bit experts' dequantized span (bytes; 0: none) chosen."""
        fit = self.prefill_fit
        if fit is not None:
            self._stats.extra.update(
                prefill_chunk=self.prefill_chunk, staging_span=fit.span, dequant_bytes=fit.dequant_bytes
            )
        return self._stats

    # -- the loop ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: Sequence[int],
        settings: GenerationSettings,
        *,
        stable: int = 0,
        cancelled: Callable[[], bool] | None = None,
        split_reasoning: bool = True,
    ) -> Iterator[TokenEvent]:
        """Stream the reply to prompt_ids. `stable`: how many of its first tokens the next prompt will repeat (a chat's
        history): the cache state there is kept, and a later prompt starting with them prefills only the rest.
        `cancelled`: this reply's own cancel check, asked after every token as `cancel()` is (finish_reason
        "cancelled"); unlike `cancel()` it cannot reach a reply that starts later (a server's queued requests).
        `split_reasoning=False`: a thinking model's reply as it wrote it, tags included, all on the answer channel (a
        raw completion)."""
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
        for name in ("frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(settings, name)):
                raise UsageError(f"the {name.replace('_', ' ')} must be a finite number, got {getattr(settings, name)}")
        max_new = min(settings.max_new_tokens, self.context - n_prompt)
        with self._busy:
            splitter = self._splitter(prompt_ids) if split_reasoning else None
            yield from reply.generate(
                self, prompt_ids, settings, stable, n_prompt, max_new, t_call, cancelled, splitter
            )

    def _splitter(self, prompt_ids) -> ReasoningSplitter | None:
        """A thinking model's reasoning splitter, starting inside the block when the prompt leaves one open."""
        return prompts.splitter(self.tokenizer, self.reasoning_tags, prompt_ids)

    def _prefill(self, ids: torch.Tensor, stable: int = 0):
        """Eager prefill of ids [1, P] in chunks of `prefill_chunk` tokens into a dynamic cache, the last turn's
        rewound where the prompt repeats it -> (cache, last logits [V], prompt tokens reused)."""

        def forward(piece, start, cache):
            kw = {self._cache_kw: cache} if cache is not None else {}
            out = self.model(input_ids=piece, use_cache=True, **kw, **self._logits_kw)
            return reply.cache_of(out), out.logits[0, -1]

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
        figures.reset_counters(self.loaded.experts, graph)

    def realized_sparsity(self, graph=None) -> float:
        """Fraction of routed-expert neurons skipped on the sparse path since the counters were reset (one device
        read); `graph`: the decoder whose captured replays ran since (stats.realized_sparsity)."""
        return figures.realized_sparsity(self.loaded.experts, graph, self._device)
