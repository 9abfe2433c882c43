"""`localmoe serve`: an OpenAI-compatible HTTP server over one resident Engine (the optional `serve` extra:
Starlette and uvicorn).

    launch.py     serve(): the socket bound (loopback unless an API key is set), the app run by uvicorn
    app.py        create_app(): the endpoints, the API key, the body limit, OpenAI-style errors
    requests.py   a request body checked and turned into the engine's messages/prompt and GenerationSettings
    worker.py     Worker: the engine's one thread, requests in arrival order, a bounded queue, cancellation
    transport.py  JobResponse: a job's reply as server-sent events or one JSON body, cancelled on disconnect
    replies.py    ReplyBuilder: TokenEvents as OpenAI's chunks and responses, usage and localmoe's figures
    tools.py      tool calls found in a reply as it streams, in the formats chat templates define
    errors.py     ApiError and OpenAI's error body

Imports run one way: launch -> app -> (transport -> replies -> tools; worker; requests) -> errors. Beyond its own
modules the package imports only localmoe.events and localmoe.errors (and starlette, uvicorn): it drives the Engine
object it is given through its public API (chat_prompt, encode_raw, generate with `cancelled=`, prepare_next_turn,
default_settings, stats); never cli/ or tui/. The CLI imports `launch` only after `missing_extra()` said the extra
is installed.
"""

from __future__ import annotations

from importlib.util import find_spec

EXTRA_MODULES = ("starlette", "uvicorn")


def missing_extra() -> str | None:
    """The one-line fix when the `serve` extra is not installed, else None."""
    missing = [m for m in EXTRA_MODULES if find_spec(m) is None]
    if missing:
        return f"localmoe serve needs {' and '.join(missing)}: pip install 'localmoe[serve]'"
    return None
