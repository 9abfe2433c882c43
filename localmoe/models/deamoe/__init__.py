"""DeaMoE (Jin et al., arXiv 2608.14385): departments of experts sharing projections, as a transformers model.

`configuration` (DeaMoeConfig, model_type "deamoe"), `modeling` (DeaMoeForCausalLM from Qwen3-MoE's building blocks),
`checkpoint` (tensor names, the one-line refusal of a bad checkpoint). The layer's arithmetic lives in
`localmoe.experts.departments`, its decode kernel in `localmoe.kernels.department_experts`.

`register()` makes AutoConfig / AutoModelForCausalLM resolve model_type "deamoe" to these classes (never remote
code); importing this package calls it.
"""

from __future__ import annotations

from localmoe.models.deamoe.configuration import DeaMoeConfig
from localmoe.models.deamoe.modeling import DeaMoeForCausalLM, DeaMoeModel

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
    _registered = True


register()

__all__ = ["DeaMoeConfig", "DeaMoeForCausalLM", "DeaMoeModel", "register"]
