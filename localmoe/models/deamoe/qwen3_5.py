"""The DeaMoE twin of Qwen3.5-MoE (model_type "deamoe_qwen3_5_text"): Qwen3.5's hybrid decoder (Gated DeltaNet and
gated attention layers, zero-centred RMSNorm, the sigmoid-gated shared expert) with DeaMoE's routed experts.

Everything but the routed experts and their router is transformers' Qwen3.5-MoE text model, unchanged: the same
classes, checkpoint names and decode kernels (localmoe/decode/replacements.py lists the twin's layer and model
classes beside Qwen3.5's). Per MoE block, for x [T, H]:

    y = DepartmentExperts(x, group-limited top-k of softmax(x W_r^T)) + sigmoid(x w_sg) * shared_expert(x)

(layer formulas: localmoe/experts/departments.py). The config is Qwen3.5's text config plus DeaMoE's fields
(configuration.py: num_departments D, experts_per_department n, department_size h, topk_group g, department_score,
norm_topk_prob, private_init, private_init_noise); `num_experts` is D * n and `moe_intermediate_size` is unused.
Built for `localmoe bench --shape qwen3.5-35b-deamoe` (localmoe/data/shapes.json: same hidden size, layers,
attention, shared expert, total parameters and per-token FLOPs as Qwen3.5-35B-A3B) and loadable like any DeaMoE
checkpoint; no trained model of this shape exists.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeAttention,
    Qwen3_5MoeDecoderLayer,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeGatedDeltaNet,
    Qwen3_5MoeMLP,
    Qwen3_5MoePreTrainedModel,
    Qwen3_5MoeRMSNorm,
    Qwen3_5MoeTextModel,
    Qwen3_5MoeTextRotaryEmbedding,
)

from localmoe.experts.departments import DepartmentExperts
from localmoe.models.deamoe.configuration import check_departments, departments_per_token
from localmoe.models.deamoe.modeling import DeaMoeRouter, init_department_module


@strict
class DeaMoeQwen35Config(Qwen3_5MoeTextConfig):
    model_type = "deamoe_qwen3_5_text"
    base_config_key = ""

    num_departments: int = 48
    experts_per_department: int = 20
    department_size: int = 768
    topk_group: int = 4
    department_score: str = "max"
    norm_topk_prob: bool = True
    private_init: str = "identity"
    private_init_noise: float = 0.0

    def __post_init__(self, **kwargs):
        self.num_experts = self.num_departments * self.experts_per_department
        super().__post_init__(**kwargs)
        check_departments(self)

    @property
    def max_departments_per_token(self) -> int:
        return departments_per_token(self)


class DeaMoeQwen35SparseMoeBlock(nn.Module):
    """Qwen3.5's MoE block with DeaMoE's router and routed experts; the shared expert and its gate are Qwen3.5's."""

    def __init__(self, config: DeaMoeQwen35Config, layer_idx: int):
        super().__init__()
        self.gate = DeaMoeRouter(config)
        H = config.hidden_size
        self.experts = DepartmentExperts(
            config.num_departments, config.experts_per_department, H, config.department_size, layer_idx
        )
        self.experts.slots = departments_per_token(config)
        self.shared_expert = Qwen3_5MoeMLP(config, intermediate_size=config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, hidden_states):
        B, T, H = hidden_states.shape
        x = hidden_states.view(-1, H)
        shared = self.shared_expert(x)
        _, weights, idx = self.gate(x)
        y = self.experts(x, idx, weights) + nn.functional.sigmoid(self.shared_expert_gate(x)) * shared
        return y.reshape(B, T, H)


class DeaMoeQwen35DecoderLayer(Qwen3_5MoeDecoderLayer):
    """Qwen3.5-MoE's decoder layer (its forward) with the DeaMoE block as `mlp`."""

    def __init__(self, config: DeaMoeQwen35Config, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)  # not Qwen3.5's __init__: it would build Qwen3.5's experts
        self.hidden_size = config.hidden_size
        self.block_type = config.layer_types[layer_idx]
        if self.block_type == "linear_attention":
            self.linear_attn = Qwen3_5MoeGatedDeltaNet(config, layer_idx)
        elif self.block_type == "full_attention":
            self.self_attn = Qwen3_5MoeAttention(config, layer_idx)
        self.mlp = DeaMoeQwen35SparseMoeBlock(config, layer_idx)
        self.input_layernorm = Qwen3_5MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3_5MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DeaMoeQwen35PreTrainedModel(Qwen3_5MoePreTrainedModel):
    config: DeaMoeQwen35Config
    config_class = DeaMoeQwen35Config
    _no_split_modules = ["DeaMoeQwen35DecoderLayer"]
    _can_set_experts_implementation_cached_value = True  # as DeaMoE: DepartmentExperts runs its own paths

    def _init_weights(self, module):
        super()._init_weights(module)
        init_department_module(module, self.config)


class DeaMoeQwen35TextModel(DeaMoeQwen35PreTrainedModel):
    def __init__(self, config: DeaMoeQwen35Config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([DeaMoeQwen35DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3_5MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3_5MoeTextRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    forward = Qwen3_5MoeTextModel.forward


class DeaMoeQwen35ForCausalLM(DeaMoeQwen35PreTrainedModel, Qwen3_5MoeForCausalLM):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DeaMoeQwen35Config):
        DeaMoeQwen35PreTrainedModel.__init__(self, config)
        self.model = DeaMoeQwen35TextModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.router_aux_loss_coef = config.router_aux_loss_coef
        self.num_experts = config.num_experts
        self.num_experts_per_tok = config.num_experts_per_tok
        self.post_init()
