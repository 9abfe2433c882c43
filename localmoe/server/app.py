"""The HTTP API: `create_app(engine, ...)` -> a Starlette application with OpenAI's endpoints over one Engine.

    POST /v1/chat/completions   messages through the chat template (tools too), streamed or whole
    POST /v1/completions        a raw prompt (text or token ids), streamed or whole
    GET  /v1/models             the one model served; GET /v1/models/{id} it alone
    GET  /health                {"status": "ok", model, running, queued, request counts}; never needs the key

Every request body is read up to `max_body` bytes (413 beyond), parsed as a JSON object and checked
(requests.py) before it queues (worker.py); a prompt is encoded here, so a prompt too long for the context is a 400
before any stream starts. With an API key, /v1/ needs `Authorization: Bearer KEY` (401 otherwise). Every error is
OpenAI's JSON (errors.py), never a traceback; unknown routes 404, wrong methods 405. Browsers' cross-origin calls
are refused unless their origin is allowed (`cors_origins`).

Imports the server's modules, localmoe.errors and starlette; it drives the Engine it is given.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.routing import Route

from localmoe.errors import UsageError
from localmoe.server.errors import ApiError, bad
from localmoe.server.replies import ReplyBuilder
from localmoe.server.requests import chat_request, check_model, completion_request
from localmoe.server.tools import has_tools, template_text, tool_format
from localmoe.server.transport import JobResponse, JsonResponse, error_response
from localmoe.server.worker import Job, Worker

MAX_BODY = 8 << 20  # bytes: a request body larger than this is refused with 413


class Api:
    """The endpoints' state: the engine, its worker, the model's names, the key."""

    def __init__(self, engine, worker: Worker, *, names: list[str], api_key: str | None, max_body: int, log=None):
        self.engine, self.worker, self.api_key, self.max_body, self.log = engine, worker, api_key, max_body, log
        self.model = names[0]
        self.names = set(names) | {engine.model_name}
        self.created = int(time.time())
        template = template_text(engine.tokenizer)
        self.template_has_tools, self.tool_format = has_tools(template), tool_format(template)

    # -- plumbing ---------------------------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, key = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "a valid API key is required: send 'Authorization: Bearer KEY'", code="invalid_api_key")

    async def body(self, request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise ApiError(413, f"the request body is over {self.max_body} bytes", code="request_too_large")
        data = bytearray()
        async for piece in request.stream():
            data += piece
            if len(data) > self.max_body:
                raise ApiError(413, f"the request body is over {self.max_body} bytes", code="request_too_large")
        try:
            body = json.loads(bytes(data).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: nested past Python's limit
            raise bad("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        check_model(body, self.names, self.model)
        return body

    def submit(self, request, ids: list[int], stable: int, req, messages=None) -> JobResponse:
        if len(ids) >= self.engine.context:
            raise bad(
                f"the prompt has {len(ids)} tokens but the context is {self.engine.context}: shorten it "
                "(or restart the server with a larger --context)",
                code="context_length_exceeded",
            )
        job = Job(ids, req.settings, stable, asyncio.get_running_loop(), split_reasoning=req.kind == "chat")
        self.worker.submit(job)
        builder = ReplyBuilder(req, self.model, self.tool_format)
        return JobResponse(job, builder, req.stream, after=lambda b, stats: self.after(req, messages, b, stats))

    def after(self, req, messages, builder: ReplyBuilder, stats) -> None:
        """A reply ended: the log line, and a chat answer without tool calls prefilled ahead of the conversation's next
        turn (Worker.prepare: only while no request waits)."""
        if self.log is not None:
            self.log(
                f"{req.kind}: {stats.prompt_tokens} tok in ({stats.reused_prompt_tokens} cached), "
                f"{stats.generated_tokens} out, first token {stats.ttft_s:.2f} s, {stats.decode_tok_s:.1f} tok/s, "
                f"{builder.finish_reason(stats)}"
            )
        ended = stats.finish_reason in ("stop", "length")  # the client sends back what it got, cut short or not
        if messages is not None and not builder.calls and ended and self.engine.reuse_prompts:
            turn = [*messages, {"role": "assistant", "content": builder.answer_text()}]
            self.worker.prepare(turn, req.think, list(req.tools) or None)

    # -- endpoints --------------------------------------------------------------------------------------------
    async def chat(self, request: Request):
        self.authorize(request)
        body = await self.body(request)
        e = self.engine
        if not getattr(e.tokenizer, "chat_template", None):
            raise ApiError(
                422, f"{self.model} has no chat template: send a raw prompt to /v1/completions", code="unsupported"
            )
        req = chat_request(body, e.default_settings(), e.context, self.template_has_tools)
        messages = list(req.messages)
        try:
            ids, stable = e.chat_prompt(messages, req.think, list(req.tools) or None)
        except UsageError as err:
            raise bad(str(err), "messages") from None
        except Exception as err:  # noqa: BLE001 - the template refused these messages (its raise_exception)
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise bad(f"the chat template cannot render these messages: {first}", "messages") from None
        return self.submit(request, ids, stable, req, messages)

    async def completions(self, request: Request):
        self.authorize(request)
        body = await self.body(request)
        e = self.engine
        req = completion_request(body, e.default_settings(), e.context)
        if isinstance(req.prompt, str):
            try:
                ids = e.encode_raw(req.prompt)
            except UsageError as err:
                raise bad(str(err), "prompt") from None
        else:
            vocab = len(e.tokenizer)
            if any(not 0 <= t < vocab for t in req.prompt):
                raise bad(f"'prompt' token ids must be in [0, {vocab})", "prompt")
            ids = list(req.prompt)
        if not ids:
            raise bad("the prompt encodes to no tokens: give some text", "prompt")
        return self.submit(request, ids, 0, req)

    def model_card(self) -> dict:
        e = self.engine
        return {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "localmoe",
            "context_length": e.context,
            "localmoe": {"device": e.device, "sparsity": e.sparsity, "experts": e.experts_format},
        }

    async def models(self, request: Request):
        self.authorize(request)
        return JsonResponse({"object": "list", "data": [self.model_card()]})

    async def one_model(self, request: Request):
        self.authorize(request)
        name = request.path_params["name"]
        if name not in self.names:
            raise ApiError(404, f"model {name!r} is not served here (GET /v1/models)", code="model_not_found")
        return JsonResponse(self.model_card())

    async def health(self, request: Request):
        return JsonResponse({"status": "ok", "model": self.model, **self.worker.status()})


async def _api_error(request, exc: ApiError):
    return error_response(exc)


async def _http_error(request, exc: HTTPException):
    message = {404: f"no such endpoint: {request.method} {request.url.path}", 405: "method not allowed"}
    return error_response(ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail))))


def _guarded(endpoint, log):
    """The endpoint with any unexpected exception answered as a 500 in one line (logged in one line too), so that
    nothing reaches uvicorn's traceback logging."""

    async def guarded(request: Request):
        try:
            return await endpoint(request)
        except (ApiError, HTTPException):
            raise
        except ClientDisconnect:  # gone while sending its body: nobody to answer, nothing to log
            return error_response(ApiError(400, "the client went away"))
        except Exception as exc:  # noqa: BLE001 - the last resort: one line, never a traceback
            first = str(exc).splitlines()[0] if str(exc) else ""
            if log is not None:
                log(f"{request.method} {request.url.path} failed: {type(exc).__name__}: {first}")
            return error_response(ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error"))

    return guarded


def create_app(
    engine,
    *,
    names: list[str] | None = None,
    api_key: str | None = None,
    max_queue: int = 16,
    max_body: int = MAX_BODY,
    cors_origins: list[str] | None = None,
    log=None,
) -> Starlette:
    """The app over `engine` (already loaded); its worker thread starts with the app and stops with it.
    `names`: what clients may call the model (the first is what responses name it); `cors_origins`: web pages (by
    origin, "*" for any) whose scripts may call the API from a browser (default: none); `log`: callable(str) for one
    line per reply and per failure."""
    worker = Worker(engine, max_queue=max_queue, log=log)
    api = Api(engine, worker, names=names or [engine.model_name], api_key=api_key, max_body=max_body, log=log)
    routes = [
        Route(path, _guarded(endpoint, log), methods=[method])
        for path, endpoint, method in (
            ("/health", api.health, "GET"),
            ("/v1/health", api.health, "GET"),
            ("/v1/models", api.models, "GET"),
            ("/v1/models/{name:path}", api.one_model, "GET"),
            ("/v1/chat/completions", api.chat, "POST"),
            ("/v1/completions", api.completions, "POST"),
        )
    ]

    def lifespan(app):
        return _Lifespan(worker)

    middleware = (
        [
            Middleware(
                CORSMiddleware,
                allow_origins=list(cors_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type"],
            )
        ]
        if cors_origins
        else []
    )
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={ApiError: _api_error, HTTPException: _http_error},
        lifespan=lifespan,
    )
    app.state.worker = worker
    return app


class _Lifespan:
    """The worker thread runs while the app does."""

    def __init__(self, worker: Worker):
        self.worker = worker

    async def __aenter__(self):
        self.worker.start()

    async def __aexit__(self, *exc):
        self.worker.close()
