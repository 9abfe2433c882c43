"""`localmoe serve`: the flags checked (the `serve` extra installed, an API key for any non-loopback address, the
port free) before the model loads once, then the OpenAI-compatible server (localmoe.server) until ctrl+c.
"""

from __future__ import annotations

import os

from localmoe.cli.inputs import text_file
from localmoe.cli.loading import load_engine, refuse_unsupported
from localmoe.cli.terminal import say
from localmoe.errors import UsageError


def cmd_serve(args) -> int:
    from localmoe.models.registry import load_registry
    from localmoe.server import missing_extra

    fix = missing_extra()
    if fix is not None:
        raise UsageError(fix)
    from localmoe.server import launch

    model = args.model or load_registry().default
    if not model:
        raise UsageError("no default model: pass MODEL (see `localmoe models`)")
    args.model = model
    refuse_unsupported(model)
    text_file(args.calibration_text, "--calibration-text")
    key = args.api_key or os.environ.get(launch.API_KEY_ENV) or None
    launch.check_address(args.host, key)
    sock = launch.bind(args.host, args.port)  # before the load: a port in use is said at once
    try:
        engine = load_engine(args)
        log = None if args.quiet else (lambda line: say(f"localmoe: serve: {line}"))
        names = list(dict.fromkeys([model, engine.model_name]))
        say(f"localmoe: serving {engine.model_name} at {launch.url(sock)} (ctrl+c stops)")
        launch.serve(
            engine,
            sock,
            names=names,
            api_key=key,
            max_queue=args.max_queue,
            max_body=int(args.max_body * (1 << 20)),
            cors_origins=args.cors_origin,
            log=log,
        )
    finally:
        sock.close()
    return 0
