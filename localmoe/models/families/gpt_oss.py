"""GPT-OSS (`gpt_oss`): gpt-oss-20b and gpt-oss-120b. Their hub experts are MXFP4 (blocks of 32 e2m1 codes sharing
a power-of-two scale) with biases and a clamped SwiGLU; localmoe reads them as they are stored
(models/gpt_oss_weights.py: the experts into Mxfp4Tensors and biases, never a bf16 copy) and runs them with that
activation (experts/clamped_swiglu.py, its alpha and limit from the config). The router (top-k of the logits,
softmax over the k) stays transformers' GptOssTopKRouter.

The tiny test checkpoint is written in the hub's MXFP4 layout (tests/tiny_models.py): hidden and expert width
multiples of 32, both attention layer types (transformers' default for 2 layers: sliding, then full; a window of 8),
YaRN rope, and a swiglu_limit low enough that its clamps bite."""

from localmoe.models.families.spec import FamilySpec, TinyModel

SPEC = FamilySpec(
    name="GPT-OSS",
    block_class="GptOssMLP",
    model_types=("gpt_oss",),
    expert_count_key="num_local_experts",
    expert_width_key="intermediate_size",
    activation="clamped_swiglu",  # localmoe's own (experts/clamped_swiglu.py); config.hidden_act is unused by experts
    tiny=TinyModel(
        config={
            "hidden_size": 64,
            "intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 16,
            "sliding_window": 8,
            "swiglu_limit": 1.5,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 16,
                "rope_theta": 150000.0,
            },
        }
    ),
)
