"""DeaMoE (Jin et al., arXiv 2608.14385): departments of experts sharing projections, as a transformers model.

`configuration` (DeaMoeConfig, model_type "deamoe"), `modeling` (DeaMoeForCausalLM from Qwen3-MoE's building blocks),
`checkpoint` (tensor names, the one-line refusal of a bad checkpoint), `qwen3_5` (the DeaMoE twin of Qwen3.5-MoE,
model_type "deamoe_qwen3_5_text": Qwen3.5's decoder with DeaMoE's routed experts). The layer's arithmetic lives in
`localmoe.experts.departments`, its decode kernel in `localmoe.kernels.department_experts`.

`register()` makes AutoConfig / AutoModelForCausalLM resolve model_type "deamoe" to these classes (never remote
code); importing this package calls it.
"""

from __future__ import annotations

from localmoe.models.deamoe.configuration import DeaMoeConfig
from localmoe.models.deamoe.modeling import DeaMoeForCausalLM, DeaMoeModel
from localmoe.models.deamoe.qwen3_5 import DeaMoeQwen35Config, DeaMoeQwen35ForCausalLM, DeaMoeQwen35TextModel

_registered = False


def register() -> None:
    """Register "deamoe" with transformers' Auto classes (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    AutoConfig.register("deamoe", DeaMoeConfig, exist_ok=True)
    AutoModel.register(DeaMoeConfig, DeaMoeModel, exist_ok=True)
    AutoModelForCausalLM.register(DeaMoeConfig, DeaMoeForCausalLM, exist_ok=True)
    AutoConfig.register("deamoe_qwen3_5_text", DeaMoeQwen35Config, exist_ok=True)
    AutoModel.register(DeaMoeQwen35Config, DeaMoeQwen35TextModel, exist_ok=True)
    AutoModelForCausalLM.register(DeaMoeQwen35Config, DeaMoeQwen35ForCausalLM, exist_ok=True)
    _registered = True


register()

__all__ = [
    "DeaMoeConfig",
    "DeaMoeForCausalLM",
    "DeaMoeModel",
    "DeaMoeQwen35Config",
    "DeaMoeQwen35ForCausalLM",
    "register",
]
