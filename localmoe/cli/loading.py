"""From flags to an engine: `Engine.load` with the engine flags (notices and progress on stderr), the reply's
generation settings (the sampling flags given over the model's generation config), and the refusal of a registry
model localmoe cannot run before anything loads.
"""

from __future__ import annotations

import sys

from localmoe.cli.inputs import stops
from localmoe.cli.terminal import Progress, isatty, say, stderr_progress
from localmoe.errors import UsageError

# sampling flags -> GenerationSettings fields; a flag left out (None) keeps the model's default
SAMPLING_FLAGS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repeat_penalty": "repetition_penalty",
}


def given_sampling(args) -> dict:
    """The sampling settings the command line gives: only the flags the user passed, plus the ones always set."""
    given = {field: getattr(args, flag) for flag, field in SAMPLING_FLAGS.items() if getattr(args, flag) is not None}
    given.update(max_new_tokens=args.max_new_tokens, seed=args.seed, stop=stops(args))
    return given


def reply_settings(args, engine=None):
    """The reply's settings: the flags given, over the engine's defaults (the model's generation config) or, with no
    engine, GenerationSettings' defaults."""
    from dataclasses import replace

    from localmoe.events import GenerationSettings

    base = engine.default_settings() if engine is not None else GenerationSettings()
    return replace(base, **given_sampling(args))


def check_rank(args) -> None:
    """`--rank` without `--departments` (or with `--departments 0` only) is a usage error."""
    n = args.departments if isinstance(args.departments, list) else [args.departments]
    if args.rank is not None and max(n) == 0:
        raise UsageError("--rank needs --departments N (N >= 1): it is the department predictor's rank")


def load_engine(args, progress=None, model: str | None = None):
    from localmoe.engine.engine import Engine

    check_rank(args)

    quiet = progress is not None or getattr(args, "quiet", False)
    bar = progress or stderr_progress()

    def notice(text: str) -> None:
        if isinstance(bar, Progress):
            bar.end_line()
        say(f"localmoe: note: {text}")

    engine = Engine.load(
        model or args.model,
        device=args.device,
        dtype=args.dtype,
        sparsity=args.sparsity,
        progress=bar,
        calibration_text=args.calibration_text,
        vram_gib=args.vram,
        context=args.context,
        on_notice=None if quiet else notice,
        host_storage=args.host_storage,
        embeddings=args.embeddings,
        experts=args.experts,
        departments=args.departments,
        rank=args.rank,
        z_sparsity=getattr(args, "z_sparsity", 0.0),
        show_plan=not getattr(args, "json", False) and isatty(sys.stderr),
    )
    effort = getattr(args, "reasoning_effort", None)
    if effort is not None and not engine.set_reasoning_effort(effort) and not quiet:
        notice("--reasoning-effort does nothing: this model's chat template has no reasoning_effort")
    return engine


def refuse_unsupported(model: str) -> None:
    """A registry model (alias or repo id) localmoe cannot run: refused before anything loads or downloads."""
    from localmoe.models.registry import load_registry, unsupported_model_error

    reg = load_registry()
    spec = reg.get(model.strip()) or reg.by_repo(model.strip())
    if spec is not None and spec.unsupported:
        raise unsupported_model_error(spec, reg)
