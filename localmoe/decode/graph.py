"""The static decode step: a fixed-size cache allocated once and the whole batch-1 step captured in a CUDA graph.

Prefill runs eager (dense path, in chunks of `Engine.prefill_chunk` tokens) into a transformers `StaticCache` sized
for the context length, from where the cache can be rewound to when the prompt repeats a chat's history (prefix.py);
then one decode step — embedding, every layer's attention / Gated DeltaNet step, router, shared expert, localmoe's
sparse experts, norm, lm_head and the greedy token (kernels/argmax.py) — is captured once and replayed per token.
`step` copies a token id and position into the static inputs and returns the logits, for sampling outside the graph (on
the device, the repetition penalty included: engine/sampling.py). `step_greedy` chains greedy steps with nothing between
replays: the captured argmax writes the next input id, advances the position and puts the token in a device ring and a
pinned host ring, which the host reads after the step's event, without a copy on the stream. With a repetition penalty
the captured argmax also reads the engine's seen-token mask (sampling.Seen), penalises the logits of the tokens in it
and marks the token it chose, so penalised greedy steps chain the same way; the penalty is a device scalar read at
replay time (`set_penalty`; 1.0 = off, nothing read or marked), so one capture serves both. The only host
synchronisation per token is the token's read, for streaming. Anything that cannot be captured raises
`GraphUnavailable`, and the Engine falls back to eager with a one-line notice.

No Python garbage collection runs while a step is captured (`capture` collects first, then holds the collector off):
a decoder or engine dropped earlier that sits in a reference cycle is freed by the collector only, and a collection
during the capture destroys its CUDA graph there — cudaGraphExecDestroy is not permitted while a stream captures, and
the capture fails ("operation failed due to a previous error during capture"). The engine also `release`s a decoder it
drops, so its graph is destroyed at once, outside any capture.
"""

from __future__ import annotations

import gc

import torch

from localmoe.decode.prefix import PromptReuse, prefill
from localmoe.kernels.argmax import argmax_next

RING = 8  # greedy tokens kept on the device and the host: more than the steps the engine launches ahead


class GraphUnavailable(RuntimeError):
    pass


class GraphDecoder:
    def __init__(self, engine, max_len: int):
        from transformers import StaticCache

        if engine._device.type != "cuda":
            raise GraphUnavailable("CUDA graphs need a CUDA device")
        self.engine = engine
        self.model = engine.model
        self.max_len = max_len
        try:
            self.cache = StaticCache(config=engine.loaded.config, max_cache_len=max_len)
        except Exception as e:  # noqa: BLE001 - any cache this family cannot make static
            raise GraphUnavailable(f"no static cache for {engine.loaded.config.model_type}: {e}") from None
        dev = engine._device
        self.ids = torch.zeros((1, 1), dtype=torch.long, device=dev)
        self.pos = torch.zeros((1,), dtype=torch.long, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.k = int(getattr(engine.loaded.config, "num_experts_per_tok", 1))
        # greedy chain: written by the captured argmax (kernels/argmax.py); `chooses` is False if it cannot run
        self.ring = torch.zeros(RING, dtype=torch.long, device=dev)
        self.host_ring = torch.zeros(RING, dtype=torch.long, pin_memory=True)
        self.count = torch.zeros(1, dtype=torch.int32, device=dev)
        self.chooses = True
        self.penalty = torch.ones(1, dtype=torch.float32, device=dev)  # what the captured argmax penalises with
        self.penalizes = False  # the captured argmax has the seen mask (the engine's, made before the capture)
        self._last: torch.Tensor | None = None  # the ring slot step_greedy returned last (the next step's input)
        self._next_pos = -1
        self._n = 0  # greedy replays since the chain began (= the device count)
        self.steps = 0  # replays since the engine last reset its counters
        # the prompt prefix the static cache can be rewound to (a chat's history); its state copy in host memory
        # when experts are offloaded (the VRAM budget is theirs)
        self.prompt_reuse = PromptReuse(host_copy=engine.loaded.cache is not None)
        self.reused = 0

    def _forward(self, ids, pos):
        kw = {self.engine._cache_kw: self.cache}
        out = self.model(input_ids=ids, cache_position=pos, use_cache=True, **kw, **self.engine._logits_kw)
        return out.logits[0, -1]

    def prefill(self, prompt: torch.Tensor, stable: int = 0) -> torch.Tensor:
        """prompt [1, P] -> logits [V] of the last position (eager, in chunks of the engine's `prefill_chunk`). The
        prompt's first tokens that the cache already holds (`prefix.PromptReuse`, kept at `stable`) are not run
        again; `reused` says how many."""
        self._last = None

        def forward(piece, start, cache):
            return cache, self._forward(piece, torch.arange(start, start + piece.shape[1], device=piece.device))

        reuse = self.prompt_reuse if self.engine.reuse_prompts else None
        if reuse is None:
            self.prompt_reuse.forget()  # the whole cache is about to be rewritten
        _, logits, self.reused = prefill(
            forward, self.cache, prompt, stable=stable, chunk=self.engine.prefill_chunk, reuse=reuse
        )
        return logits

    def set_penalty(self, value: float) -> None:
        """The repetition penalty the captured greedy choice applies from the next replay on (1.0: off)."""
        self.penalty.fill_(value)

    def release(self) -> None:
        """Drop the captured graph and the static cache now (the engine no longer uses this decoder): the graph's
        CUDA objects are destroyed here, outside any capture, rather than whenever the collector reaches a cycle
        this decoder is in (see the module docstring)."""
        self.graph = None
        self.logits = None
        self.cache = None

    def capture(self, position: int) -> None:
        self.pos.fill_(position)
        self.penalty.fill_(1.0)  # the warm-up steps' choices must not mark the seen mask
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # garbage holding CUDA graphs or events (a dropped decoder, engine) is freed now: a collection inside the
        # capture below would destroy them there and fail it (torch's graph context collects only when
        # torch.compiler.config.force_cudagraph_gc is set)
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.stream(stream):
                for _ in range(3):  # warm-up: kernels compiled, workspaces allocated (same position is rewritten)
                    self._choose(self._forward(self.ids, self.pos))
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # captured on the warm-up's stream: the kernels' per-stream zeroed workspaces (tickets, accumulators)
            # were made there, so the graph holds no allocation and no memset node
            with torch.cuda.graph(graph, stream=stream):
                self.logits = self._forward(self.ids, self.pos)
                self._choose(self.logits)
        except Exception as e:  # noqa: BLE001
            raise GraphUnavailable(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        finally:
            if collecting:
                gc.enable()
        self.graph = graph

    def _choose(self, logits: torch.Tensor) -> None:
        if not self.chooses:
            return
        seen = getattr(self.engine, "_seen", None)
        penalty = {"seen": seen.mask, "penalty": self.penalty} if seen is not None else {}
        try:
            argmax_next(
                logits,
                ids=self.ids.view(-1),
                pos=self.pos,
                ring=self.ring,
                host=self.host_ring,
                count=self.count,
                **penalty,
            )
        except (ValueError, RuntimeError):  # logits this kernel does not take: greedy steps sample outside
            self.chooses = False
            return
        self.penalizes = bool(penalty)

    def step(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """Run one captured step for `token` at `position`; returns the static logits [V] (valid until next step)."""
        self.ids.copy_(token.view(1, 1))
        self.pos.fill_(position)
        self._last = None
        self.graph.replay()
        self.steps += 1  # replays count kept neurons on the GPU; the engine adds what they considered
        return self.logits

    def step_greedy(self, token: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One captured step choosing its token greedily in the graph -> (token on the device, the same on the host:
        valid once the work queued so far has finished, until RING more steps). Passing back the device token of the
        previous call with the next position copies nothing before the replay; anything else starts a new chain."""
        if not self.chooses:
            raise GraphUnavailable("the captured step has no greedy choice")
        if token is not self._last or position != self._next_pos:
            self.ids.copy_(token.view(1, 1))
            self.pos.fill_(position)
            self.count.zero_()
            self._n = 0
        self.graph.replay()
        self.steps += 1
        i = self._n % RING
        self._n += 1
        self._next_pos = position + 1
        self._last = self.ring[i]
        return self._last, self.host_ring[i]
