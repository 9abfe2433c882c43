"""`localmoe chat`: the flags checked, then the terminal chat app (localmoe.tui) started with a loader that builds
the engine from the flags (and loads another model on `/model ALIAS`).
"""

from __future__ import annotations

from localmoe.cli.inputs import system_prompt, text_file
from localmoe.cli.loading import given_sampling, load_engine, refuse_unsupported, reply_settings
from localmoe.errors import UsageError


def cmd_chat(args) -> int:
    from localmoe.models.registry import load_registry

    model = args.model or load_registry().default
    if not model:
        raise UsageError("no default model: pass MODEL (see `localmoe models`)")
    args.model = model
    system = system_prompt(args)
    refuse_unsupported(model)  # here, not once the chat app is up and loading
    text_file(args.calibration_text, "--calibration-text")
    given = given_sampling(args)  # checked (--stop) before the app starts
    from localmoe.tui.app import run_chat

    def load(progress, model: str | None = None):
        """The chat's loader: the model given on the command line, or `model` (`/model ALIAS`). The engine's
        default_settings() are the model's generation config under the sampling flags given."""
        if model is not None:
            refuse_unsupported(model)
        engine = load_engine(args, progress, model=model)
        engine.override_defaults(**given)
        return engine

    kwargs = {"think": args.think} if args.think is not None else {}
    return run_chat(
        load,
        model_label=model,
        settings=reply_settings(args),
        sparsity=args.sparsity,
        system=system,
        continue_last=args.continue_last,
        **kwargs,
    )
