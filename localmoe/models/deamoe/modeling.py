"""`DeaMoeForCausalLM`: Qwen3-MoE's decoder with DeaMoE's department MoE block (transformers building blocks).

Reused unchanged from transformers' Qwen3-MoE: attention (`Qwen3MoeAttention`, q/k RMSNorm, rotary, GQA), RMSNorm,
rotary embedding, the pre-norm decoder layer's forward, the base model's and the causal LM's forward (the aux loss
is Qwen3-MoE's load-balancing loss over the D * n experts). New: `DeaMoeRouter` (two-stage group-limited top-k,
`localmoe.experts.departments.group_limited_topk`) and `DeaMoeSparseMoeBlock` holding `DepartmentExperts`.

Per layer i the MoE block is y = experts(x, router(x)) (formulas: localmoe/experts/departments.py); the block has
no shared expert and no dense MLP layers (every layer is a DeaMoE layer).

Initialisation: router, attention, embeddings and department projections N(0, initializer_range); private
matrices the identity (`private_init` "identity", plus N(0, private_init_noise) if set) or N(0, initializer_range),
so at init a DeaMoE layer is a Qwen3-style MoE of D experts of width h whose experts of a department coincide.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeAttention,
    Qwen3MoeDecoderLayer,
    Qwen3MoeForCausalLM,
    Qwen3MoeModel,
    Qwen3MoeRMSNorm,
    Qwen3MoeRotaryEmbedding,
)
from transformers.utils.output_capturing import OutputRecorder

from localmoe.experts.departments import DepartmentExperts, group_limited_topk
from localmoe.models.deamoe.checkpoint import check_checkpoint, local_folder
from localmoe.models.deamoe.configuration import DeaMoeConfig, departments_per_token


class DeaMoeRouter(nn.Module):
    """weight [D * n, H]; -> (router logits [T, D * n], routing weights [T, k], flat expert ids [T, k], e = d*n + j)."""

    def __init__(self, config: DeaMoeConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.per_department = config.experts_per_department
        self.topk_group = config.topk_group
        self.score = config.department_score
        self.norm_topk_prob = config.norm_topk_prob
        self.hidden_dim = config.hidden_size
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = nn.functional.linear(hidden_states, self.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        idx, top = group_limited_topk(probs, self.per_department, self.top_k, self.topk_group, self.score)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), idx


class DeaMoeSparseMoeBlock(nn.Module):
    def __init__(self, config: DeaMoeConfig, layer_idx: int):
        super().__init__()
        self.gate = DeaMoeRouter(config)
        self.experts = DepartmentExperts(
            config.num_departments,
            config.experts_per_department,
            config.hidden_size,
            config.department_size,
            layer_idx,
        )
        self.experts.slots = departments_per_token(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        flat = hidden_states.view(-1, hidden_dim)
        _, weights, idx = self.gate(flat)
        return self.experts(flat, idx, weights).reshape(batch_size, sequence_length, hidden_dim)


class DeaMoeDecoderLayer(Qwen3MoeDecoderLayer):
    """Qwen3-MoE's decoder layer (its forward) with the DeaMoE block as `mlp`."""

    def __init__(self, config: DeaMoeConfig, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)
        self.self_attn = Qwen3MoeAttention(config, layer_idx)
        self.mlp = DeaMoeSparseMoeBlock(config, layer_idx)
        self.input_layernorm = Qwen3MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_size = config.hidden_size


class DeaMoePreTrainedModel(PreTrainedModel):
    config: DeaMoeConfig
    config_class = DeaMoeConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DeaMoeDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # transformers' experts implementations (eager, grouped_mm) have nothing to act on here: DepartmentExperts runs
    # its own paths. Accepting the setting (transformers caches this flag per class, from 5.2x) lets a caller that
    # sets one, as `localmoe bench --baseline transformers` does, build the model as transformers would.
    _can_set_experts_implementation_cached_value = True
    _can_record_outputs = {
        "router_logits": OutputRecorder(DeaMoeRouter, index=0),
        "hidden_states": DeaMoeDecoderLayer,
        "attentions": Qwen3MoeAttention,
    }

    def _init_weights(self, module):
        super()._init_weights(module)
        init_department_module(module, self.config)


def init_department_module(module: nn.Module, config) -> None:
    """DeaMoE's initialisation of `module` if it is a router or a DepartmentExperts (else nothing): router and
    department projections N(0, initializer_range); private matrices the identity (`private_init` "identity", plus
    N(0, private_init_noise) if set) or N(0, initializer_range). Shared by DeaMoE and its Qwen3.5 twin."""
    std = config.initializer_range
    if isinstance(module, DepartmentExperts):
        for p in (module.gate_proj, module.up_proj, module.down_t):
            init.normal_(p, mean=0.0, std=std)
        if config.private_init == "identity":
            eye = torch.eye(module.width, dtype=module.private.dtype, device=module.private.device)
            value = eye.expand_as(module.private).clone()
            if config.private_init_noise:
                value += config.private_init_noise * torch.randn_like(value)
            init.copy_(module.private, value)
        else:
            init.normal_(module.private, mean=0.0, std=std)
    elif isinstance(module, DeaMoeRouter):
        init.normal_(module.weight, mean=0.0, std=std)


class DeaMoeModel(DeaMoePreTrainedModel):
    def __init__(self, config: DeaMoeConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([DeaMoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3MoeRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    forward = Qwen3MoeModel.forward


class DeaMoeForCausalLM(DeaMoePreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DeaMoeConfig):
        super().__init__(config)
        self.model = DeaMoeModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.router_aux_loss_coef = config.router_aux_loss_coef
        self.num_experts = config.num_experts
        self.num_experts_per_tok = config.num_experts_per_tok
        self.post_init()

    forward = Qwen3MoeForCausalLM.forward

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' from_pretrained after `check_checkpoint` (a bad DeaMoE checkpoint: one-line UsageError)."""
        folder = local_folder(pretrained_model_name_or_path, kwargs.get("revision"))
        if folder is not None:
            check_checkpoint(folder)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
