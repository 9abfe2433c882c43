"""What a model needs, worked out from its config alone: size, active parameters, the VRAM plan at a budget and the
bytes a decode step must read. `localmoe show` prints it before any download; `run` and `chat` print its one-line
form (`ModelPlan.line`) as they load.

The numbers come from the code that loads models, not from a second model of it: the transformers skeleton on the
meta device with localmoe's experts swapped in (`models.skeleton.build_skeleton` / `swap_experts`, as
`models.random_weights` builds a bench model), the offload plan of `models.offload.plan_offload` /
`experts.placement` (what stays resident, expert slots, the gates-first split of direct misses; an untied input
embedding table in host memory, `models.host_embedding`, as a GPU load puts it by default), and the byte floor
`measure.benchmark.step_bytes` reports (`model_facts.step_floor`).

Shape legend: E experts per MoE layer, I expert width, H hidden, k experts per token, L MoE layers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from localmoe.devices import vram_budget
from localmoe.engine.model_facts import ModelFacts, facts, matrix_bytes, step_floor
from localmoe.engine.sampling import generation_defaults
from localmoe.errors import UsageError
from localmoe.experts.department_placement import DepartmentPlan
from localmoe.experts.int4 import expert_bytes as int4_bytes
from localmoe.experts.placement import WORKSPACE_RESERVE, gate_tier_split, state_bytes
from localmoe.models import host_embedding, hub
from localmoe.models.checkpoint import read_config
from localmoe.models.families import family_for_model_type
from localmoe.models.loader import check_format, format_for
from localmoe.models.offload import plan_offload
from localmoe.models.registry import DEFAULT_CONTEXT, UNKNOWN_MODEL_SPARSITY
from localmoe.models.shapes import shape_config
from localmoe.models.skeleton import build_skeleton, swap_experts

GiB = 1 << 30


def count(n: float) -> str:
    """A parameter count for people: 34.66B, 13.7M, 950K."""
    for div, unit, fmt in ((1e9, "B", ".2f"), (1e6, "M", ".1f"), (1e3, "K", ".0f")):
        if n >= div:
            return f"{n / div:{fmt}}{unit}"
    return str(int(n))


def size(b: float) -> str:
    """Bytes for people, decimal: 69.35 GB, 23.1 MB, 512 KB."""
    for div, unit, fmt in ((1e9, "GB", ".2f"), (1e6, "MB", ".1f"), (1e3, "KB", ".0f")):
        if b >= div:
            return f"{b / div:{fmt}} {unit}"
    return f"{int(b)} B"


@dataclass
class ModelPlan:
    name: str
    facts: ModelFacts
    dtype: str  # the run's ("bfloat16")
    experts_format: str
    context: int  # tokens the KV/state is sized for
    sparsity: float  # the default decode sparsity
    expert_bytes: int  # one expert, gate + up + down, in the format
    budget_bytes: int | None = None  # None: no GPU budget (the CPU)
    offload: object = None  # placement.OffloadPlan at the budget
    error: str = ""  # why the budget cannot hold the model ("" when it can, or without a budget)
    state_bytes: int = 0
    floor_dense: float = 0.0
    floor_sparse: float = 0.0
    download_bytes: int | None = None
    download_source: str = ""  # "disk", "hub", or "estimate"
    estimate_note: str = ""  # what an estimate assumes ("parameters in bfloat16")
    device: str = "cuda"  # where it would run: "cpu" (an engine on the CPU), "cuda"
    source: str = ""  # where the config came from (hub.ConfigSource.how), for show
    repo: str | None = None
    sampling: dict = field(default_factory=dict)  # the checkpoint's sampling defaults (show)
    host_embedding_bytes: int = 0  # the input embedding table in host memory (--embeddings host): no VRAM

    @property
    def total_expert_bytes(self) -> int:
        return self.facts.moe_layers * self.facts.experts * self.expert_bytes

    @property
    def all_resident_bytes(self) -> int:
        """VRAM that keeps everything resident: non-expert weights (but a host-resident embedding table), KV/state,
        workspace and every expert."""
        non_expert = self.facts.non_expert_bytes - self.host_embedding_bytes
        return int(non_expert + self.state_bytes + self.workspace_bytes + self.total_expert_bytes)

    @property
    def workspace_bytes(self) -> int:
        """VRAM set aside for activations: the offload plan's (a prefill piece's peak, experts/prefill_budget), at
        least WORKSPACE_RESERVE."""
        return int(getattr(self.offload, "workspace_bytes", WORKSPACE_RESERVE))

    def vram(self) -> dict | None:
        """The plan at the budget, in numbers (None without a budget)."""
        if self.budget_bytes is None:
            return None

        d = {
            "budget_bytes": self.budget_bytes,
            "fits": not self.error,
            "error": self.error or None,
            "all_resident_bytes": self.all_resident_bytes,
            "state_bytes": self.state_bytes,
            "workspace_bytes": self.workspace_bytes,
            "expert_bytes": self.expert_bytes,
            "experts_total": self.facts.moe_layers * self.facts.experts,
            "host_embedding_bytes": self.host_embedding_bytes,
        }
        p = self.offload
        if p is None:
            return d
        if isinstance(p, DepartmentPlan):  # DeaMoE: department units first, then private units
            d.update(
                non_expert_bytes=p.non_expert_bytes,
                non_expert_gpu_bytes=p.non_expert_bytes,
                offloading=p.offloading,
                departments_total=p.departments_total,
                departments_cached=p.department_slots,
                department_bytes=p.department_bytes,
                private_total=p.total_experts,
                private_cached=p.private_slots,
                private_bytes=p.private_bytes,
                host_ram_bytes=p.host_bytes if p.offloading else 0,
            )
            return d
        gates, updown = gate_tier_split(p) if p.offloading else (p.total_experts, p.total_experts)
        d.update(
            non_expert_bytes=p.non_expert_bytes,
            non_expert_gpu_bytes=p.non_expert_gpu_bytes if p.spills else p.non_expert_bytes,
            experts_cached=p.slots,
            experts_cached_per_layer=p.slots / max(1, self.facts.moe_layers),
            offloading=p.offloading,
            direct_gates_cached=gates,
            direct_updown_cached=updown,
            host_ram_bytes=p.total_experts * p.expert_bytes if p.offloading else 0,
        )
        return d

    def vram_text(self) -> str:
        """The plan at the budget, one clause."""
        gib = lambda b: f"{b / GiB:.2f} GiB" if b >= GiB / 10 else f"{b / (1 << 20):.1f} MiB"  # noqa: E731
        on_host = (
            f", token embeddings {gib(self.host_embedding_bytes)} of them in host memory"
            if self.host_embedding_bytes
            else ""
        )
        if self.budget_bytes is None:
            weights = gib(self.facts.non_expert_bytes + self.total_expert_bytes)
            if self.device == "cpu":
                return f"on the CPU: {weights} of weights in host memory"
            return (
                f"all resident needs {gib(self.all_resident_bytes)} of VRAM ({weights} of weights{on_host}); no GPU "
                "here: --vram GiB plans for a card"
            )
        head = f"at {gib(self.budget_bytes)} of VRAM"
        if self.error:
            return f"{head}: does not fit ({self.error})"
        p = self.offload
        resident = (
            f"non-expert weights {gib(p.non_expert_bytes)}"
            + (f" ({gib(p.non_expert_gpu_bytes)} of them on the GPU)" if p.spills else "")
            + f" + KV/state {gib(p.state_bytes)} resident"
            + (
                f" (token embeddings {gib(self.host_embedding_bytes)} in host memory)"
                if self.host_embedding_bytes
                else ""
            )
        )
        if not p.offloading:
            return f"{head}: {resident}, all {p.total_experts} experts too ({gib(self.total_expert_bytes)})"
        if isinstance(p, DepartmentPlan):
            return (
                f"{head}: {resident}, departments first: {p.department_slots} of {p.departments_total} departments' "
                f"shared projections and {p.private_slots} of {p.total_experts} experts' private parts cached "
                f"({gib(p.cache_bytes)}), host RAM {gib(p.host_bytes)} for the master copies"
            )
        per = p.slots / max(1, self.facts.moe_layers)
        return (
            f"{head}: {resident}, {p.slots} of {p.total_experts} experts cached ({per:.1f} per layer; direct "
            f"misses keep gates first), host RAM {gib(p.total_experts * p.expert_bytes)} for the experts' "
            "master copies"
        )

    def line(self) -> str:
        """The one-line plan `run` and `chat` print at load (and `show`'s 'plan' line)."""
        f = self.facts
        return (
            f"{self.name}: {count(f.total_params)} parameters ({count(f.active_params)} active), "
            f"{f.moe_layers} MoE layers x {f.experts} experts (top-{f.top_k}); {self.experts_format} experts, "
            f"{self.dtype}, context {self.context}; {self.vram_text()}; reads {size(self.floor_dense)} "
            f"per token dense, {size(self.floor_sparse)} at {self.sparsity:.0%} sparsity"
        )

    def as_json(self) -> dict:
        f = self.facts
        d = {
            "model": self.name,
            "repo": self.repo,
            "config_source": self.source or None,
            **{k: v for k, v in asdict(f).items()},
            "params_total": f.total_params,
            "params_active": f.active_params,
            "dtype": self.dtype,
            "experts_format": self.experts_format,
            "context": self.context,
            "default_sparsity": self.sparsity,
            "download_bytes": self.download_bytes,
            "download_source": self.download_source or None,
            "download_estimate": self.estimate_note or None,
            "vram": self.vram(),
            "bytes_per_token": {"dense": self.floor_dense, "sparse": self.floor_sparse, "sparsity": self.sparsity},
            "sampling": self.sampling or None,
            "plan": self.line(),
        }
        return d

    def text(self) -> str:
        """`localmoe show`'s lines."""
        f = self.facts
        src = {
            "hub": "config fetched from the hub; weights not downloaded",
            "shapes": "offline and not downloaded: config from localmoe's table of shapes",
            "cache": "downloaded" if self.download_source == "disk" else "config cached; weights not downloaded",
            "local": "local folder",
            "bundled": "bundled with localmoe",
        }.get(self.source, "")
        dl = (
            "–"
            if self.download_bytes is None
            else size(self.download_bytes)
            + {
                "disk": " on disk",
                "hub": " (hub file list)",
                "estimate": f" (estimated: {self.estimate_note})",
            }.get(self.download_source, "")
        )
        shared = f", shared expert width {f.shared_expert_width}" if f.shared_expert_width else ""
        smp = self.sampling
        sampling = (
            "greedy"
            if not smp or smp.get("temperature", 0) <= 0
            else f"temperature {smp['temperature']:g}, top-k {smp['top_k']}, top-p {smp['top_p']:g}"
        )
        if smp and smp.get("repetition_penalty", 1.0) != 1.0:
            sampling += f", repetition penalty {smp['repetition_penalty']:g}"
        lines = [
            f"{self.name}"
            + (f" ({self.repo})" if self.repo and self.repo != self.name else "")
            + (f": {src}" if src else ""),
            f"  architecture   {f.family} ({f.model_type}, {f.architecture})",
            f"  layers         {f.layers} ({f.moe_layers} MoE), hidden {f.hidden}, vocabulary {f.vocab}",
            f"  experts        {f.experts} per MoE layer, top-{f.top_k}, width {f.expert_width}{shared}",
            f"  parameters     {count(f.total_params)} total, {count(f.active_params)} active per token",
            f"  context        {f.context_max or '?'} tokens (planned for {self.context})",
            f"  download       {dl}",
            f"  sampling       {sampling} (generation_config.json)"
            if smp
            else "  sampling       greedy (no generation_config.json)",
            f"  VRAM           {self.experts_format} experts, {self.dtype}: {self.vram_text()}",
            f"  per token      {size(self.floor_dense)} read dense, {size(self.floor_sparse)} at the "
            f"default {self.sparsity:.0%} sparsity (the decode step's byte floor)",
            f"  plan           {self.line()}",
        ]
        return "\n".join(lines)


def _finish(plan: ModelPlan, element_bytes: float) -> ModelPlan:
    m = matrix_bytes(plan.facts, element_bytes, plan.experts_format)
    plan.floor_dense = step_floor(plan.facts, m, 0.0)
    plan.floor_sparse = step_floor(plan.facts, m, plan.sparsity)
    return plan


def from_config(
    name: str,
    text_config,
    *,
    budget_bytes: int | None,
    context: int,
    dtype,
    experts_format: str,
    sparsity: float,
    embeddings: str = "host",
) -> ModelPlan:
    """The plan of a model from its text config: the skeleton built on the meta device (no weights), the loader's
    offload plan at `budget_bytes` (None: no GPU) for a GPU load, whose untied input embedding table lives in host
    memory unless `embeddings` is "gpu". A budget too small is reported in `error`, not raised."""
    import torch

    check_format(experts_format)
    experts_format = format_for(text_config, experts_format)  # gpt-oss: its checkpoints' MXFP4
    spec = family_for_model_type(text_config.model_type)
    if spec is not None and spec.no_int4 and experts_format != "full":
        raise UsageError(spec.no_int4)
    model = build_skeleton(text_config, dtype)
    experts = swap_experts(model, text_config)
    if embeddings != "gpu":
        host_embedding.install(model, text_config)  # the skeleton as a GPU load builds it (models/offload.py)
    f = facts(model, text_config, list(experts.values()))
    el = torch.finfo(dtype).bits // 8
    try:
        if f.departments:  # DeaMoE: a routed expert's share of its layer's department weights
            one = f.expert_params * el // max(1, f.moe_layers * f.experts)
        elif experts_format != "full":
            one = int4_bytes(f.expert_width, f.hidden, experts_format)
        else:
            one = 3 * f.expert_width * f.hidden * el
    except ValueError as e:
        raise UsageError(f"{e}; use --experts full") from None
    plan = ModelPlan(
        name=name,
        facts=f,
        dtype=str(dtype).replace("torch.", ""),
        experts_format=experts_format,
        context=context,
        sparsity=sparsity,
        expert_bytes=one,
        budget_bytes=budget_bytes,
        state_bytes=state_bytes(text_config, context, dtype),
        host_embedding_bytes=host_embedding.host_bytes(model, el),
    )
    if budget_bytes is not None:
        try:
            plan.offload = plan_offload(model, text_config, experts, dtype, budget_bytes, context, None, experts_format)
        except UsageError as e:
            plan.error = str(e)
    return _finish(plan, el)


def engine_plan(engine, sparsity: float) -> ModelPlan:
    """The plan of a loaded engine (its model, its budget's offload plan): what `run` and `chat` print."""

    loaded = engine.loaded
    f = facts(engine.model, loaded.config, loaded.experts)
    m0 = loaded.experts[0]
    one = m0.weights.nbytes() // max(1, m0.num_experts) if m0.weights is not None else 0
    p = loaded.offload
    plan = ModelPlan(
        name=engine.model_name,
        facts=f,
        dtype=str(engine.dtype).replace("torch.", ""),
        experts_format=engine.experts_format,
        context=engine.context,
        sparsity=sparsity,
        expert_bytes=one,
        budget_bytes=p.budget_bytes if p is not None else None,
        offload=p,
        device=engine._device.type,
        state_bytes=p.state_bytes if p is not None else state_bytes(loaded.config, engine.context, engine.dtype),
        host_embedding_bytes=host_embedding.host_bytes(engine.model),
    )
    el = m0.weights.w_gate.element_size() if m0.weights is not None else 2
    m = f.expert_width * f.hidden * el  # Int4Tensor.element_size: bytes per weight, scales included
    plan.floor_dense = step_floor(f, m, 0.0)
    plan.floor_sparse = step_floor(f, m, sparsity)
    return plan


def show(
    name: str, *, vram_gib: float | None = None, experts_format: str = "full", context: int | None = None
) -> ModelPlan:
    """`localmoe show MODEL`: the plan from the config alone (hub.locate_config: a local or cached folder, the config
    files fetched from the hub, or localmoe's table of shapes offline). The budget: `vram_gib`, else what a CUDA card
    here has free, else none. bf16 (the GPU's dtype)."""
    import torch

    src = hub.locate_config(name)
    if src.folder is not None:
        _, text_config, _ = read_config(src.folder)
    else:
        text_config = shape_config(src.spec.alias)
    limit = int(getattr(text_config, "max_position_embeddings", 0) or 0)
    if context is not None and limit and context > limit:
        raise UsageError(f"--context {context} is more than {src.name} supports ({limit})")
    ctx = context or (min(DEFAULT_CONTEXT, limit) if limit else DEFAULT_CONTEXT)
    if vram_gib is not None:
        budget = vram_budget(torch.device("cpu"), vram_gib)
    elif torch.cuda.is_available():
        budget = vram_budget(torch.device("cuda"), None)
    else:
        budget = None
    default = src.spec.sparsity if src.spec is not None else UNKNOWN_MODEL_SPARSITY
    plan = from_config(
        src.name,
        text_config,
        budget_bytes=budget,
        context=ctx,
        dtype=torch.bfloat16,
        experts_format=experts_format,
        sparsity=default,
    )
    plan.source, plan.repo = src.how, src.repo_id
    if src.folder is not None and (src.folder / "generation_config.json").is_file():
        plan.sampling = asdict(generation_defaults(src.folder))
        for k in ("max_new_tokens", "seed", "stop"):
            plan.sampling.pop(k, None)
    if src.downloaded and src.folder is not None:
        plan.download_bytes, plan.download_source = hub.local_weight_bytes(src.folder), "disk"
    else:
        size = hub.hub_weight_bytes(src.repo_id) if src.repo_id else None
        if size is not None:
            plan.download_bytes, plan.download_source = size, "hub"
        else:
            plan.download_bytes, plan.estimate_note = _download_estimate(text_config, plan.facts)
            plan.download_source = "estimate"
    return plan


def _download_estimate(config, f: ModelFacts) -> tuple[int, str]:
    """(bytes, what they assume) of a checkpoint not on disk and not listed by the hub: its parameters in the stored
    dtype (config `dtype` / `torch_dtype`; bf16 when unset), and where the config says the experts are stored in
    MXFP4 (GPT-OSS's `quantization_config`) the routed experts in that format, as the checkpoint holds them."""
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(dt).replace("torch.", "") if dt is not None else "bfloat16"
    el = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}.get(name, 2)
    q = getattr(config, "quantization_config", None)
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    if method == "mxfp4" and f.expert_params and not f.departments:
        experts = f.moe_layers * f.experts * 3 * matrix_bytes(f, el, "mxfp4")
        return int(f.non_expert_params * el + experts), f"experts in MXFP4, the rest in {name}"
    return int(f.total_params * el), f"parameters in {name}"
