"""Qwen3.5-MoE (`qwen3_5_moe`): Qwen3.5-35B-A3B, -122B-A10B. Its hub checkpoints are multimodal: the text model under
`model.language_model.`, a vision tower and a multi-token-prediction head beside it (both skipped), experts stored
fused; a shared expert beside the routed ones; 3 of 4 layers Gated DeltaNet. The family localmoe fuses most: see
localmoe/decode/replacements.py."""

from localmoe.models.families.spec import FamilySpec, TinyModel

SPEC = FamilySpec(
    name="Qwen3.5-MoE",
    block_class="Qwen3_5MoeSparseMoeBlock",
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    renames=((r"^model\.language_model\.", "model."),),
    skip=(r"^model\.visual\.", r"^mtp\."),
    expert_count_key="num_experts",
    expert_width_key="moe_intermediate_size",
    tiny=TinyModel(
        config={
            "text_config": {
                "head_dim": 8,
                "moe_intermediate_size": 16,
                "shared_expert_intermediate_size": 16,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "num_hidden_layers": 4,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "linear_key_head_dim": 8,
                "linear_value_head_dim": 8,
                "linear_conv_kernel_dim": 4,
                "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            },
            "vision_config": {
                "depth": 1,
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_heads": 2,
                "out_hidden_size": 32,
                "patch_size": 4,
                "temporal_patch_size": 2,
                "spatial_merge_size": 2,
            },
            "tie_word_embeddings": False,
        },
        model_class="Qwen3_5MoeForConditionalGeneration",  # the hub's multimodal checkpoint
        save={"save_original_format": False},  # experts fused on disk, as the hub stores them
    ),
)
