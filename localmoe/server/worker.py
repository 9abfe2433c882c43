"""The one engine behind the server, at batch 1: `Worker` runs requests (`Job`s) one at a time, in arrival order, on
its own thread, and hands each token back to the request's event loop as it comes.

    submit(job)   queued, or refused with 503 (and Retry-After) when `max_queue` requests already wait
    job.cancel()  from the event loop (a client gone): a waiting job is dropped, a running one stops after the
                  token in flight (Engine.generate's `cancelled` check, which cannot reach the next request)
    prepare(...)  when nothing waits, the conversation's reply is prefilled ahead (Engine.prepare_next_turn), so
                  the next turn of the same conversation prefills only its new message

A job's events arrive on its asyncio queue as ("event", TokenEvent), then ("done", EngineStats) or ("error",
ApiError). Imports errors.py and localmoe.errors / localmoe.events; it drives the Engine it is given.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

from localmoe.errors import LocalmoeError, UsageError
from localmoe.server.errors import ApiError

RETRY_AFTER_S = 1


@dataclass
class Job:
    """One request's generation: the prompt ids and settings, where its events go, and its cancel flag."""

    ids: list[int]
    settings: object  # GenerationSettings
    stable: int
    loop: asyncio.AbstractEventLoop
    split_reasoning: bool = True  # False for a raw completion: a thinking model's tags stay in the text
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    t_submit: float = field(default_factory=time.perf_counter)
    queue_s: float = 0.0  # seconds it waited for the engine
    _pending: list = field(default_factory=list)  # items posted, not yet handed to the loop
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _scheduled: bool = False  # a hand-over is already scheduled on the loop

    def cancel(self) -> None:
        self.cancelled.set()

    def post(self, kind: str, payload) -> None:
        """From the worker thread: an item for the request's event loop (dropped once that loop is closed). Items
        posted while a hand-over is pending go with it: the loop is woken once per batch, not once per token."""
        with self._lock:
            self._pending.append((kind, payload))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._hand_over)
        except RuntimeError:
            pass

    def _hand_over(self) -> None:
        with self._lock:
            items, self._pending, self._scheduled = self._pending, [], False
        for item in items:
            self.events.put_nowait(item)


class Worker:
    def __init__(self, engine, max_queue: int = 16, log=None):
        self.engine, self.max_queue, self.log = engine, max_queue, log
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._next_turn: tuple | None = None  # (messages, think, tools) to prefill when idle
        self.running: Job | None = None
        self.counts = {"completed": 0, "cancelled": 0, "rejected": 0, "failed": 0}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="localmoe-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def status(self) -> dict:
        with self._cond:
            return {"running": int(self.running is not None), "queued": len(self._waiting), **self.counts}

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            if len(self._waiting) + (self.running is not None) > self.max_queue:
                self.counts["rejected"] += 1
                err = ApiError(
                    503,
                    f"the queue is full ({self.max_queue} requests wait for the engine): retry later",
                    code="queue_full",
                )
                err.headers["Retry-After"] = str(RETRY_AFTER_S)
                raise err
            self._waiting.append(job)
            self._next_turn = None
            self._cond.notify()

    def prepare(self, messages, think=None, tools=None) -> None:
        """Prefill this conversation's reply once the engine is idle (dropped if a request comes first)."""
        with self._cond:
            if not self._waiting and not self._closed:
                self._next_turn = (messages, think, tools)
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
            if self.running is not None:
                self.running.cancel()
            self._cond.notify()
        for job in waiting:
            job.post("error", ApiError(503, "the server is shutting down", code="shutting_down"))

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to end after close() (the reply in flight stops at its next token)."""
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and self._next_turn is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                if not self._waiting:
                    turn, self._next_turn = self._next_turn, None
                    job = None
                else:
                    job = self._waiting.popleft()
                    if job.cancelled.is_set():
                        self.counts["cancelled"] += 1
                        continue
                    self.running = job
            if job is None:
                self._prepare(*turn)
                continue
            try:
                self._generate(job)
            finally:
                with self._cond:
                    self.running = None

    def _prepare(self, messages, think, tools) -> None:
        try:
            self.engine.prepare_next_turn(messages, think, tools)
        except Exception as e:  # noqa: BLE001 - a prefill ahead is an optimisation: the next turn prefills instead
            if self.log is not None:
                self.log(f"prefilling the next turn failed ({type(e).__name__}: {e}); the next turn prefills whole")

    def _generate(self, job: Job) -> None:
        job.queue_s = time.perf_counter() - job.t_submit
        engine = self.engine
        try:
            events = engine.generate(
                job.ids,
                job.settings,
                stable=job.stable,
                cancelled=job.cancelled.is_set,
                split_reasoning=job.split_reasoning,
            )
            for ev in events:
                job.post("event", ev)
            stats = replace(engine.stats, extra=dict(engine.stats.extra))
        except UsageError as e:
            self.counts["failed"] += 1
            job.post("error", ApiError(400, str(e)))
            return
        except LocalmoeError as e:
            self.counts["failed"] += 1
            job.post("error", ApiError(500, str(e), code="engine_error"))
            return
        except Exception as e:  # noqa: BLE001 - one line to the client and the log, never a traceback
            self.counts["failed"] += 1
            first = str(e).splitlines()[0] if str(e) else ""
            if self.log is not None:
                self.log(f"generation failed: {type(e).__name__}: {first}")
            job.post("error", ApiError(500, f"generation failed: {type(e).__name__}: {first}", code="engine_error"))
            return
        self.counts["cancelled" if stats.finish_reason == "cancelled" else "completed"] += 1
        job.post("done", stats)
