"""DeepSeek-V2 (`deepseek_v2`): DeepSeek-V2-Lite. Multi-head latent attention (keys and values of different head
dims), dense MLPs in the first `first_k_dense_replace` layers, n_routed_experts per-expert tensors (gate_proj,
up_proj, down_proj) of moe_intermediate_size beside shared experts."""

from localmoe.models.families.spec import FamilySpec, TinyModel

SPEC = FamilySpec(
    name="DeepSeek-V2",
    block_class="DeepseekV2Moe",
    model_types=("deepseek_v2",),
    expert_names=("gate_proj", "up_proj", "down_proj"),
    expert_count_key="n_routed_experts",
    expert_width_key="moe_intermediate_size",
    tiny=TinyModel(
        config={
            "intermediate_size": 48,
            "moe_intermediate_size": 16,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "n_group": 1,
            "topk_group": 1,
            "rope_scaling": None,
            "num_hidden_layers": 3,
            "num_key_value_heads": 4,
        }
    ),
)
