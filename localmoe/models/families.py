"""The one table of MoE families localmoe supports, keyed by the transformers MoE block class.

For each block class it says which `model_type`s use it, how checkpoint keys are renamed into the
transformers module namespace (the same renames transformers applies when it loads), which checkpoint
prefixes are not part of the text model, and the expert activation. The loader swaps the `experts`
submodule of every block whose class is in this table for localmoe's `LocalExperts`; nothing else of
transformers is replaced. Imports no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class FamilySpec:
    name: str  # human name
    block_class: str  # transformers class holding `.experts` (the swap point)
    model_types: tuple[str, ...]
    renames: tuple[tuple[str, str], ...] = ()  # regex -> replacement, checkpoint key -> module name
    skip: tuple[str, ...] = ()  # regexes of checkpoint keys outside the text model
    unsupported: str = ""  # non-empty: loading fails with this reason

    def rename(self, key: str) -> str | None:
        """Module-namespace name for a checkpoint key, or None when the key is to be skipped."""
        for pattern in self.skip:
            if re.search(pattern, key):
                return None
        for pattern, repl in self.renames:
            key = re.sub(pattern, repl, key)
        return key


FAMILIES: dict[str, FamilySpec] = {
    spec.block_class: spec
    for spec in (
        FamilySpec(
            name="Qwen3.5-MoE",
            block_class="Qwen3_5MoeSparseMoeBlock",
            model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
            renames=((r"^model\.language_model\.", "model."),),
            skip=(r"^model\.visual\.", r"^mtp\."),
        ),
        FamilySpec(name="Qwen3-MoE", block_class="Qwen3MoeSparseMoeBlock", model_types=("qwen3_moe",)),
        FamilySpec(name="OLMoE", block_class="OlmoeSparseMoeBlock", model_types=("olmoe",)),
        FamilySpec(
            name="Mixtral",
            block_class="MixtralSparseMoeBlock",
            model_types=("mixtral",),
            renames=((r"\.block_sparse_moe\.", ".mlp."),),
        ),
        FamilySpec(name="DeepSeek-V2", block_class="DeepseekV2Moe", model_types=("deepseek_v2",)),
        FamilySpec(
            name="GraniteMoE",
            block_class="GraniteMoeMoE",
            model_types=("granitemoe",),
            renames=(
                (r"block_sparse_moe\.input_linear\.weight$", "block_sparse_moe.experts.gate_up_proj"),
                (r"block_sparse_moe\.output_linear\.weight$", "block_sparse_moe.experts.down_proj"),
                (r"block_sparse_moe\.router\.layer\.weight$", "block_sparse_moe.router.weight"),
            ),
        ),
        FamilySpec(
            name="GPT-OSS",
            block_class="GptOssMLP",
            model_types=("gpt_oss",),
            unsupported="GPT-OSS is not yet supported: its hub weights are MXFP4 and its experts use a clamped "
            "SwiGLU with biases, which localmoe's expert store and kernels do not handle yet",
        ),
    )
}


def family_for_model_type(model_type: str) -> FamilySpec | None:
    for spec in FAMILIES.values():
        if model_type in spec.model_types:
            return spec
    return None


def supported_families() -> str:
    return ", ".join(f"{s.name} ({'/'.join(s.model_types)})" for s in FAMILIES.values() if not s.unsupported)


# Expert tensor layouts on disk, as suffixes after the experts module prefix (module namespace).
# fused: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
# per-expert: {e}.<gate>.weight [I, H], {e}.<up>.weight [I, H], {e}.<down>.weight [H, I].
PER_EXPERT_NAMES = {
    "proj": ("gate_proj", "up_proj", "down_proj"),  # Qwen3-MoE, OLMoE, DeepSeek
    "w": ("w1", "w3", "w2"),  # Mixtral
}


# Config keys for the number of routed experts and their width, by family (the first present is the one).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # Qwen/OLMoE, Mixtral/Granite, DeepSeek
EXPERT_WIDTH_KEYS = ("moe_intermediate_size",)  # Qwen, DeepSeek (the others use intermediate_size)


def expert_count(config) -> int | None:
    """The number of routed experts of a text config (whichever key its family uses), or None when none is set."""
    for key in EXPERT_COUNT_KEYS:
        value = getattr(config, key, None)  # transformers maps the other families' keys onto these (attribute_map)
        if value is not None:
            return value
    return None
