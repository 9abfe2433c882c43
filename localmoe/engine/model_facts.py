"""A model's counts and the bytes a decode step must read, from its transformers model (on the meta device or loaded)
and localmoe's experts: `ModelFacts` (layers, experts, widths, parameters, non-expert bytes), `facts` (reads them off
a model), `matrix_bytes` (one expert matrix in an experts format) and `step_floor` (the byte floor `localmoe show`
prints and `bench` measures against).

Imports the families table and the 4-bit formats' byte counts only.

Shape legend: E experts per MoE layer, I expert width, H hidden, k experts per token, L MoE layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from localmoe.experts.int4 import expert_bytes
from localmoe.models.families import FAMILIES, family_for_model_type


@dataclass(frozen=True)
class ModelFacts:
    """Counts of one model, from its (meta or loaded) transformers model and localmoe's experts."""

    family: str  # localmoe's family name (models/families/)
    model_type: str
    architecture: str  # the transformers class
    layers: int
    moe_layers: int
    hidden: int
    experts: int  # E, routed experts per MoE layer
    top_k: int
    expert_width: int  # I
    shared_expert_width: int  # 0 when none
    vocab: int
    context_max: int  # max_position_embeddings (0 when unset)
    non_expert_params: int
    non_expert_bytes: int  # in the model's dtype (fp32-kept modules as kept)
    embed_skip_bytes: int  # the embedding table but one row: not read per token (0 when lm_head shares it)
    departments: int = 0  # DeaMoE: D departments per MoE layer (experts = D * n, expert_width = h); 0: vanilla
    departments_per_token: int = 0  # DeaMoE: the most departments one token touches, min(k, topk_group, D)

    @property
    def expert_params(self) -> int:
        if self.departments:  # shared gate/up/down [h, H] per department, a private [h, h] per expert
            return self.moe_layers * (
                self.departments * 3 * self.expert_width * self.hidden + self.experts * self.expert_width**2
            )
        return self.moe_layers * self.experts * 3 * self.expert_width * self.hidden

    @property
    def total_params(self) -> int:
        return self.non_expert_params + self.expert_params

    @property
    def active_params(self) -> int:
        """Parameters a token uses: every non-expert one (embeddings included, as model cards count) and k experts
        per MoE layer (DeaMoE: at most `departments_per_token` departments' shared projections and k private parts)."""
        if self.departments:
            per = self.departments_per_token * 3 * self.expert_width * self.hidden + self.top_k * self.expert_width**2
            return self.non_expert_params + self.moe_layers * per
        return self.non_expert_params + self.moe_layers * self.top_k * 3 * self.expert_width * self.hidden


def facts(model, text_config, experts: list) -> ModelFacts:
    """ModelFacts of `model` (parameters on the meta device or loaded) whose MoE blocks hold `experts`
    (LocalExperts, layer order)."""

    owned = {id(p) for m in experts for p in m.parameters()}  # DeaMoE's experts are model parameters
    params = [p for p in model.parameters() if id(p) not in owned]  # tied weights once
    non_expert_params = sum(p.numel() for p in params)
    non_expert_bytes = sum(p.numel() * p.element_size() for p in params)
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is emb
    skip = 0 if tied else (emb.numel() - emb.shape[-1]) * emb.element_size()
    fam = family_for_model_type(text_config.model_type)
    block = next((FAMILIES[type(m).__name__] for m in model.modules() if type(m).__name__ in FAMILIES), None)
    m0 = experts[0]
    shared = getattr(text_config, "shared_expert_intermediate_size", None) or (
        getattr(text_config, "n_shared_experts", 0) or 0
    ) * (getattr(text_config, "moe_intermediate_size", 0) or 0)
    return ModelFacts(
        family=(fam or block).name if (fam or block) else text_config.model_type,
        model_type=text_config.model_type,
        architecture=type(model).__name__,
        layers=int(text_config.num_hidden_layers),
        moe_layers=len(experts),
        hidden=m0.hidden_size,
        experts=m0.num_experts,
        top_k=int(getattr(text_config, "num_experts_per_tok", 1)),
        expert_width=getattr(m0, "intermediate_size", None) or m0.width,
        shared_expert_width=int(shared or 0),
        vocab=int(text_config.vocab_size),
        context_max=int(getattr(text_config, "max_position_embeddings", 0) or 0),
        non_expert_params=non_expert_params,
        non_expert_bytes=non_expert_bytes,
        embed_skip_bytes=skip,
        departments=getattr(m0, "num_departments", 0),
        departments_per_token=int(getattr(text_config, "max_departments_per_token", 0) or 0),
    )


def matrix_bytes(f: ModelFacts, element_bytes: float, experts_format: str) -> float:
    """Bytes of one expert's gate (or up, or down) matrix [I, H] in `experts_format`."""
    if experts_format != "full":
        return expert_bytes(f.expert_width, f.hidden, experts_format) / 3
    return f.expert_width * f.hidden * element_bytes


def step_floor(f: ModelFacts, matrix: float, sparsity: float) -> float:
    """Bytes one decode step must read: every non-expert weight except the embedding table (one row), plus, per MoE
    layer, the k routed experts' gates whole and their up/down rows kept at `sparsity` (DeaMoE: each touched
    department's gate and down whole, its up rows and its k private parts' rows kept at `sparsity`)."""
    if f.departments:
        el = matrix / (f.expert_width * f.hidden)
        dept = f.departments_per_token * matrix * (2 + (1 - sparsity))
        private = f.top_k * f.expert_width**2 * el * (1 - sparsity)
        return float(f.non_expert_bytes - f.embed_skip_bytes + f.moe_layers * (dept + private))
    return float(f.non_expert_bytes - f.embed_skip_bytes + f.moe_layers * f.top_k * matrix * (1 + 2 * (1 - sparsity)))
