"""DeaMoE (`deamoe`): localmoe's own architecture (localmoe.models.deamoe; arXiv 2608.14385), the bundled
localmoe-tiny-deamoe. Qwen3-MoE attention; each MoE block's experts are departments sharing gate/up/down projections,
each expert a private [h, h] (localmoe.experts.departments.DepartmentExperts), routed by a group-limited top-k.

Unlike the transformers families, the block's `experts` already is localmoe's module: the loader does not swap it and
its tensors (`mlp.experts.gate_proj`, `up_proj`, `down_t`, `private`: models/deamoe/checkpoint.py) load like the
rest, after `check_checkpoint` refuses a checkpoint that does not match its config. The model type is registered
with transformers' Auto classes by importing `registers` before a config is read. A VRAM budget that cannot hold
every department offloads department-aware (departments' shared projections first, then private parts:
experts/department_placement.py, experts/department_cache.py). Not yet: int4 experts. No tiny model here:
tests/test_deamoe.py builds its own (the tests looping over every family would meet the int4 refusal).
"""

from localmoe.models.families.spec import FamilySpec

SPEC = FamilySpec(
    name="DeaMoE",
    block_class="DeaMoeSparseMoeBlock",
    model_types=("deamoe",),
    expert_count_key="num_experts",  # DeaMoeConfig.num_experts = departments x experts per department
    expert_width_key="department_size",
    native_experts=True,
    registers="localmoe.models.deamoe",
    checkpoint_check="localmoe.models.deamoe.checkpoint:check_checkpoint",
    no_int4="--experts int4 is not supported for DeaMoE models yet: use --experts full",
)
