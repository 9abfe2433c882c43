"""The model skeleton: the transformers text model built with its parameters on the meta device (buffers real), each
MoE block's `experts` submodule replaced by a parameter-free `LocalExperts` (families.FAMILIES; a family of localmoe's
own, DeaMoE, keeps its `DepartmentExperts`, whose parameters load like the rest), and what the skeleton says about
itself before any weight is read (modules kept in float32, the units accelerate places whole).
"""

from __future__ import annotations

import re

import torch

from localmoe.errors import UsageError
from localmoe.experts.clamped_swiglu import CLAMPED_SWIGLU
from localmoe.experts.local_experts import LocalExperts
from localmoe.models.families import FAMILIES, supported_families


def build_skeleton(text_config, dtype: torch.dtype):
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(text_config, dtype=dtype, trust_remote_code=False)
    return model


def swap_experts(model, text_config) -> dict:
    """Replace each MoE block's `experts`; returns {experts module name: LocalExperts} in layer order (a family with
    `native_experts`: its own DepartmentExperts, not replaced)."""
    swapped: dict = {}
    for name, module in list(model.named_modules()):
        if type(module).__name__ not in FAMILIES or not hasattr(module, "experts"):
            continue
        if FAMILIES[type(module).__name__].native_experts:
            swapped[f"{name}.experts"] = module.experts
            continue
        old = module.experts
        layer = int(m.group(1)) if (m := re.search(r"layers\.(\d+)\.", name + ".")) else len(swapped)
        if FAMILIES[type(module).__name__].activation == CLAMPED_SWIGLU:  # GPT-OSS: gate_up_proj is [E, H, 2I]
            # the replaced module's own values: transformers before 5.24 fixes alpha (1.702) in GptOssExperts
            swiglu = (float(old.alpha), float(old.limit))
            new = LocalExperts(old.num_experts, old.hidden_size, old.intermediate_size, "", layer, swiglu=swiglu)
        else:
            E, two_i, H = old.gate_up_proj.shape
            new = LocalExperts(E, H, two_i // 2, text_config.hidden_act, layer)
        module.experts = new
        swapped[f"{name}.experts"] = new
    if not swapped:
        raise UsageError(f"the checkpoint has no MoE layers localmoe can run; supported: {supported_families()}")
    return swapped


def keep_fp32(model) -> list[str]:
    keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    keep += list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    return keep


def units(model) -> dict[str, int]:
    """Parameter bytes of the units accelerate places whole: modules of the model's no-split classes (decoder
    layers), and every parameter-holding module outside them (embedding, final norm, lm_head)."""
    from accelerate.utils import compute_module_sizes

    no_split = set(getattr(model, "_no_split_modules", None) or [])
    sizes = compute_module_sizes(model)
    units: dict[str, int] = {}
    for name, m in model.named_modules():
        if any(name.startswith(u + ".") for u in units):
            continue
        if type(m).__name__ in no_split or (name and next(m.parameters(recurse=False), None) is not None):
            units[name] = sizes.get(name, 0)
    return units


def build(text_config, dtype: torch.dtype):
    """The skeleton with localmoe's experts swapped in -> (model, {experts module name: LocalExperts})."""
    model = build_skeleton(text_config, dtype)
    return model, swap_experts(model, text_config)
