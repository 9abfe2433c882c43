"""DeaMoE's Qwen3.5 twin (`deamoe_qwen3_5_text`, localmoe.models.deamoe.qwen3_5): Qwen3.5-MoE's hybrid decoder and
shared expert with DeaMoE's departments as the routed experts. It exists for `bench --shape qwen3.5-35b-deamoe`
(the DeaMoE twin of Qwen3.5-35B-A3B at equal parameters and per-token FLOPs) and loads like DeaMoE: its
`DepartmentExperts` is localmoe's module already, its checkpoint is checked before the skeleton is built, its decode
layers are Qwen3.5's fused ones (localmoe/decode/replacements.py). No tiny model here: tests/test_deamoe_twin.py
builds its own.
"""

from localmoe.models.families.spec import FamilySpec

SPEC = FamilySpec(
    name="DeaMoE (Qwen3.5 twin)",
    block_class="DeaMoeQwen35SparseMoeBlock",
    model_types=("deamoe_qwen3_5_text",),
    expert_count_key="num_experts",
    expert_width_key="department_size",
    native_experts=True,
    registers="localmoe.models.deamoe",
    checkpoint_check="localmoe.models.deamoe.checkpoint:check_checkpoint",
    no_int4="--experts int4 is not supported for DeaMoE models yet: use --experts full",
)
