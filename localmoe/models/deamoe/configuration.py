"""`DeaMoeConfig`: the transformers config of a DeaMoE model (model_type "deamoe").

Everything but the MoE block is Qwen3-MoE's (attention with q/k RMSNorm, rotary, RMSNorm, pre-norm decoder layer), so
those fields keep Qwen3-MoE's names and meanings. The DeaMoE fields (layer formulas: `localmoe.experts.departments`):

    num_departments            D: departments per layer
    experts_per_department     n: experts per department (D * n routed experts per layer, numbered e = d * n + j)
    department_size            h: width of a department's shared gate/up/down projections (and of the private P_e)
    num_experts_per_tok        k: experts chosen per token
    topk_group                 g: departments a token may use (group-limited top-k; g >= D: plain top-k)
    department_score           how a department is ranked: "max" (its best expert's probability, default) or
                               "top2_sum" (sum of its two best, DeepSeek-V3 style)
    norm_topk_prob             renormalise the k chosen probabilities to sum to 1 (Qwen3-MoE's option)
    private_init               "identity" (default, the paper) or "normal" (N(0, initializer_range)) for P_e
    private_init_noise         std of a random perturbation added to the identity (0: exact identity)
    router_aux_loss_coef       weight of the expert load-balancing loss used in training

Validation (`check`) refuses inconsistent shapes in one line (`localmoe.errors.UsageError`).
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

from localmoe.errors import UsageError

DEPARTMENT_SCORES = ("max", "top2_sum")
PRIVATE_INITS = ("identity", "normal")


@strict
class DeaMoeConfig(PreTrainedConfig):
    model_type = "deamoe"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 8192
    hidden_size: int = 256
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    hidden_act: str = "silu"
    max_position_embeddings: int = 1024
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = True
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    sliding_window: int | None = None
    num_departments: int = 6
    experts_per_department: int = 5
    department_size: int = 120
    num_experts_per_tok: int = 4
    topk_group: int = 2
    department_score: str = "max"
    norm_topk_prob: bool = True
    private_init: str = "identity"
    private_init_noise: float = 0.0
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.01
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        super().__post_init__(**kwargs)
        self.check()

    @property
    def num_experts(self) -> int:
        """Routed experts per layer (D * n)."""
        return self.num_departments * self.experts_per_department

    def check(self) -> None:
        check_departments(self)

    @property
    def max_departments_per_token(self) -> int:
        """Departments one token can touch: min(k, g, D) (the decode kernel's fixed slot count for one token)."""
        return departments_per_token(self)


def check_departments(cfg) -> None:
    """Raise UsageError (one line) when a config's DeaMoE fields do not describe a layer (DeaMoeConfig and the
    Qwen3.5 twin's config share them)."""
    positive = ("num_departments", "experts_per_department", "department_size", "num_experts_per_tok")
    for name in positive + ("topk_group",):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UsageError(f"{cfg.model_type} config: {name} must be a positive integer, got {v!r}")
    if cfg.num_experts_per_tok > cfg.num_departments * cfg.experts_per_department:
        raise UsageError(
            f"{cfg.model_type} config: num_experts_per_tok {cfg.num_experts_per_tok} exceeds the "
            f"{cfg.num_departments * cfg.experts_per_department} "
            f"experts of a layer ({cfg.num_departments} departments x {cfg.experts_per_department})"
        )
    g = min(cfg.topk_group, cfg.num_departments)
    if cfg.num_experts_per_tok > g * cfg.experts_per_department:
        raise UsageError(
            f"{cfg.model_type} config: num_experts_per_tok {cfg.num_experts_per_tok} cannot be chosen from topk_group "
            f"{cfg.topk_group} departments of {cfg.experts_per_department} experts"
        )
    if cfg.department_score not in DEPARTMENT_SCORES:
        raise UsageError(f"{cfg.model_type} config: department_score must be one of {DEPARTMENT_SCORES}")
    if cfg.department_score == "top2_sum" and cfg.experts_per_department < 2:
        raise UsageError(f"{cfg.model_type} config: department_score 'top2_sum' needs experts_per_department >= 2")
    if cfg.private_init not in PRIVATE_INITS:
        raise UsageError(f"{cfg.model_type} config: private_init must be one of {PRIVATE_INITS}")
    if cfg.hidden_act != "silu":
        raise UsageError(
            f"{cfg.model_type} config: hidden_act must be 'silu' (the layer's SwiGLU), got {cfg.hidden_act!r}"
        )


def departments_per_token(cfg) -> int:
    """Departments one token can touch: min(k, g, D) (the decode kernel's fixed slot count for one token)."""
    return min(cfg.num_experts_per_tok, cfg.topk_group, cfg.num_departments)


__all__ = ["DeaMoeConfig", "check_departments", "departments_per_token"]
