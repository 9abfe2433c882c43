"""How an Engine is made: `Engine.load` (a model the user named: resolve, tokenizer, load, notices, calibration) and
`Engine.random` (random weights at a registry model's real shapes, for `bench --shape`), both ending with the load's
one-line plan and offload notices recorded on the engine. engine.py binds these as its classmethods; their
signatures are the public API.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from localmoe.devices import pick_device, pick_dtype, vram_budget
from localmoe.engine import plan, prompts
from localmoe.engine.notices import offload_notices, recording
from localmoe.engine.sampling import generation_defaults
from localmoe.errors import RuntimeFailure
from localmoe.events import ProgressFn
from localmoe.models import hub
from localmoe.models.checkpoint import check_tokenizer, read_config
from localmoe.models.loader import LoadOptions, load_model
from localmoe.models.random_weights import build_random
from localmoe.models.registry import DEFAULT_CONTEXT, UNKNOWN_MODEL_SPARSITY, load_registry
from localmoe.models.shapes import shape_config


def load_engine(
    cls: type,  # Engine (bound as its classmethods: this module does not import engine.py)
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
    embeddings: str | None = None,
    show_plan: bool = False,
    departments: int = 0,
    rank: int | None = None,
    z_sparsity: float = 0.0,
):
    """Resolve, load and calibrate MODEL (`departments`, `rank`: the gate predictor, Engine.set_departments;
    `z_sparsity`: DeaMoE's second threshold, Engine.set_z_sparsity).
    Notices go to `on_notice` and `engine.notes`; the plan line
    (`plan_line`, `localmoe show`'s one-line plan) is the first of `notes`, and goes to `on_notice` too with
    `show_plan` (the CLI's run on a terminal)."""
    t0 = time.perf_counter()
    notes: list[str] = []
    notice = recording(notes, on_notice)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    resolved = hub.resolve(model, progress=progress)
    read_config(resolved.path)  # a bad config.json or a folder without a tokenizer: the loader's own messages
    check_tokenizer(resolved.path)
    tokenizer = prompts.load_tokenizer(resolved.path)
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
            embeddings=embeddings or "auto",  # "host" / "gpu"; None: host memory on CUDA (models/host_embedding.py)
        )
        loaded = load_model(resolved.path, device=dev, dtype=dt, options=options, progress=progress, on_notice=notice)
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
    plan_notice(engine, sparsity, show_plan)
    engine._defaults = generation_defaults(resolved.path, notice)
    _offload_notices(engine)
    engine.set_departments(departments, rank)
    engine.set_z_sparsity(z_sparsity)
    engine.set_sparsity(sparsity, progress, calibration_text=calibration_text)
    engine.on_notice = on_notice  # later notices (recalibration, graph fallbacks) go to the caller only
    _loaded_in(engine, t0)
    return engine


def random_engine(
    cls: type,  # Engine (bound as its classmethods: this module does not import engine.py)
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
    embeddings: str | None = None,
):
    """A random-weight engine with a registry model's real config (for `bench --shape`); `routing` as in
    `random_weights.build_random`."""
    t0 = time.perf_counter()
    config = shape_config(shape)
    options = LoadOptions(
        vram_bytes=vram_budget(device, vram_gib),
        context=context or DEFAULT_CONTEXT,
        fused=fused,
        offload_miss=offload_miss,
        experts_format=experts,
        embeddings=embeddings or "auto",
    )
    loaded = build_random(config, device=device, dtype=dtype, options=options, routing=routing, on_notice=on_notice)
    spec = load_registry().get(shape)
    resolved = hub.ResolvedModel(name=f"{shape} (random weights)", path=Path("."), spec=spec, revision="random")
    engine = cls(resolved, loaded, None, device, dtype)
    engine.on_notice = on_notice
    if context:
        engine.set_context(context)
    _offload_notices(engine)
    engine.set_sparsity(0.0)
    _loaded_in(engine, t0)
    return engine


def plan_notice(engine, sparsity: float, show: bool = True) -> None:
    """The one-line plan (`localmoe show`'s), as the load's first notice (only recorded in `notes` unless `show`)."""
    try:
        engine.plan_line = plan.engine_plan(engine, sparsity).line()
    except Exception:  # noqa: BLE001 - a plan it cannot describe is no reason to fail a load that worked
        return
    if show:
        engine._notice(engine.plan_line)
        engine._plan_shown = True
    else:
        engine.notes.append(engine.plan_line)


def _offload_notices(engine) -> None:
    if offload_notices(engine.loaded, engine._device, engine._plan_shown, engine._notice):
        engine.use_graphs = False


def _loaded_in(engine, t0: float) -> None:
    engine.load_s = time.perf_counter() - t0
    engine._stats = replace(engine._stats, load_s=engine.load_s)
