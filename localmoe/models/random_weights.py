"""Random-weight models at real shapes, for benchmarks (`localmoe bench --shape`): measure the hardware without a
download. The model is built as the loader builds a checkpoint (meta skeleton, localmoe's experts, offload plan,
fused modules), then filled: matrices ~ N(0, 0.02), norm weights 1 (0 for Qwen3.5's zero-centred norms), DeltaNet's
A_log / dt_bias uniform in [0, 1). Random routers spread tokens evenly over the experts, the pessimistic case for
the expert cache; `routing="skewed"` gives each layer a few hot experts.

Shapes: E = experts per layer, H = hidden.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from localmoe.errors import RuntimeFailure, UsageError
from localmoe.experts.clamped_swiglu import ExpertBiases
from localmoe.experts.expert_weights import ExpertWeights
from localmoe.experts.host_memory import HostMemory
from localmoe.experts.int4 import PROJECTIONS, QUANTIZED, empty_stack, format_of, quantize_as
from localmoe.experts.local_experts import LocalExperts
from localmoe.models.families import family_for_model_type, supported_families
from localmoe.models.loaded import LoadedModel, attach_cache
from localmoe.models.loader import LoadOptions, check_format, format_for, install_decode
from localmoe.models.offload import place_buffers, plan_placement
from localmoe.models.skeleton import build


def param_owners(model) -> dict[str, str]:
    """Parameter name -> class name of the module holding it."""
    mods = {n: type(m).__name__ for n, m in model.named_modules()}
    return {n: mods[n.rsplit(".", 1)[0] if "." in n else ""] for n, _ in model.named_parameters(remove_duplicate=False)}


ROUTINGS = ("uniform", "skewed")  # build_random's router spreads
# Skewed routing: each MoE layer's router row e is scaled by (rank_e + 1) ** -SKEW_ALPHA, normalised to mean 1, over a
# random ranking of that layer's experts. Measured at Qwen3.5-35B-A3B shapes (256 experts, top-8, H 2048; router
# N(0, 0.02), inputs N(0, 1), 8192 tokens, 4 seeds): the hottest 20% of experts take 65-66% of the routed picks
# (uniform: 22%); on the hidden states of a 4-layer random model at those dims (1024 tokens) 65-67% (uniform 25-36%);
# at Qwen3-30B-A3B shapes (128 experts) 49%.
SKEW_ALPHA = 0.3


def router_weight(block, experts) -> torch.Tensor:
    """A MoE block's router matrix [E, H]: its one 2-D parameter of that shape outside the routed and shared experts
    (`mlp.gate.weight` in most families, Granite's `block_sparse_moe.router.weight`)."""
    E, H = experts.num_experts, experts.hidden_size
    found = [
        p
        for n, p in block.named_parameters()
        if tuple(p.shape) == (E, H) and not n.startswith(("experts.", "shared_expert"))
    ]
    if len(found) != 1:
        raise RuntimeFailure(f"{type(block).__name__}: expected one [{E}, {H}] router weight, found {len(found)}")
    return found[0]


def skew_routers(model, experts: dict[str, LocalExperts], seed: int) -> None:
    """Scale router rows by a power law over a per-layer random ranking (see SKEW_ALPHA): the hot experts differ per
    layer. Its own generator, so every other weight equals the uniform build's at the same seed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for prefix, mod in experts.items():
            w = router_weight(model.get_submodule(prefix.rsplit(".", 1)[0]), mod)  # [E, H]
            E = mod.num_experts
            s = torch.arange(1, E + 1, dtype=torch.float32) ** -SKEW_ALPHA  # [E], by rank
            s = (s / s.mean())[torch.randperm(E, generator=gen)]  # [E], by expert
            w.mul_(s.to(device=w.device, dtype=w.dtype)[:, None])


def random_value(name: str, shape, owner: str, *, dtype, device, gen: torch.Generator) -> torch.Tensor:
    """A random weight for benchmarks: matrices ~ N(0, 0.02); norm weights 1, or 0 for Qwen3.5's zero-centred
    RMSNorm (its weight enters as 1 + w); DeltaNet's A_log and dt_bias uniform in [0, 1); other vectors 1."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if name.endswith(("A_log", "dt_bias")):
        return t.uniform_(0.0, 1.0, generator=gen)
    if name.endswith("norm.weight") or len(shape) == 1:
        return t.fill_(0.0 if owner == "Qwen3_5MoeRMSNorm" else 1.0)
    return t.normal_(0.0, 0.02, generator=gen)


def _host_copy(t, memory: HostMemory, projection: str = "w_gate"):
    """A master copy of t (a tensor, or a 4-bit stack of ExpertWeights' `projection`) in host memory, pinned while
    pinning works."""
    alloc = memory
    if isinstance(t, QUANTIZED):
        h = empty_stack(format_of(t), t.shape, t.dtype, "cpu", projection, alloc=alloc)
        for dst, src in zip(h.parts(), t.parts()):
            dst.copy_(src)
        return h
    return alloc(tuple(t.shape), t.dtype).copy_(t)


def build_random(
    text_config,
    *,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    options: LoadOptions | None = None,
    routing: str = "uniform",
    on_notice=None,
) -> LoadedModel:
    """The same model with random weights (for `bench --shape`: measure hardware without a download), built as
    `load_model` builds a checkpoint under `options` (its host_storage and store_key unused: offloaded master copies
    are drawn on the device, then kept in host memory).

    Matrices ~ N(0, 0.02), norm weights 1 (0 for zero-centred norms), other vectors small; experts likewise.
    Random routers spread tokens evenly over the experts (`routing="uniform"`, the pessimistic case for the expert
    cache); `routing="skewed"` then rescales the router rows so each layer has a few hot experts (`skew_routers`)."""
    from accelerate.utils import set_module_tensor_to_device

    options = options or LoadOptions()
    if routing not in ROUTINGS:
        raise UsageError(f"unknown routing {routing!r}: use one of {', '.join(ROUTINGS)}")
    fam = family_for_model_type(text_config.model_type)
    if fam is None or fam.unsupported:
        raise UsageError(f"no random-weight build for {text_config.model_type!r}; supported: {supported_families()}")
    check_format(options.experts_format)
    # gpt-oss (its config's quantization_config): MXFP4 experts, as its checkpoints store them
    options = replace(options, experts_format=format_for(text_config, options.experts_format))
    model, experts = build(text_config, dtype)
    placed = plan_placement(model, text_config, experts, device, dtype, options, on_notice)
    dmap = placed.dmap
    gen = torch.Generator(device=device).manual_seed(seed)
    owners = param_owners(model)
    for name, p in list(model.named_parameters()):
        t = random_value(name, p.shape, owners[name], dtype=dtype, device=device, gen=gen)
        where = placed.device_for(name, device)
        if where.type == "cpu" and device.type != "cpu" and name.startswith(placed.host_params):
            t = _host_copy(t, placed.memory)  # an offloaded DeaMoE's master copy: drawn on the device, then moved
        set_module_tensor_to_device(model, name, where, value=t)
    if routing == "skewed":
        skew_routers(model, experts, seed)
    place_buffers(model, dmap, device)
    for mod in experts.values():
        if not isinstance(mod, LocalExperts):  # DeaMoE's DepartmentExperts: parameters, filled above
            continue
        shape = (mod.num_experts, mod.intermediate_size, mod.hidden_size)
        mats = []
        for projection in PROJECTIONS:
            t = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
            if options.experts_format != "full":  # quantized on the device
                t = quantize_as(t, options.experts_format, projection)
            mats.append(
                _host_copy(t, placed.memory, projection) if placed.host else t
            )  # offloaded: drawn on the device, then moved
        mod.weights = ExpertWeights(*mats)
        if mod.up_fn is not None:  # GPT-OSS's expert biases: small, like the other vectors
            E, I, H = shape
            mod.biases = ExpertBiases.empty(E, I, H, dtype, device)
            for b in (mod.biases.gate, mod.biases.up, mod.biases.down):
                b.normal_(0.0, 0.02, generator=gen)
    install_decode(model, dmap, device, options.fused)
    loaded = LoadedModel(
        model=model, config=text_config, family=fam, experts=list(experts.values()), offload=placed.budget
    )
    if placed.host:
        attach_cache(loaded, dtype, device, placed.memory.pinned, options.offload_miss)
    return loaded
