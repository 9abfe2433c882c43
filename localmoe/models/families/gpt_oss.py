"""GPT-OSS (`gpt_oss`): gpt-oss-20b. Not supported yet: its hub experts are MXFP4 with biases and a clamped
SwiGLU. Described here so that its registry entries are refused, before any download, with the reason; the tests
build a tiny one to check that refusal."""

from localmoe.models.families.spec import FamilySpec, TinyModel

SPEC = FamilySpec(
    name="GPT-OSS",
    block_class="GptOssMLP",
    model_types=("gpt_oss",),
    expert_count_key="num_local_experts",
    expert_width_key="intermediate_size",
    activation="clamped SwiGLU with biases",  # not a transformers activation name: localmoe's kernels lack it
    unsupported="GPT-OSS is not yet supported: its hub weights are MXFP4 and its experts use a clamped "
    "SwiGLU with biases, which localmoe's expert store and kernels do not handle yet",
    tiny=TinyModel(config={"intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8}),
)
