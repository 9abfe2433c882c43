"""`FamilySpec`, the shape of one family's row, and `TinyModel`, the tiny random-weight model the tests build of it.

A family module (one per transformers MoE family, beside this one) holds a `SPEC = FamilySpec(...)`; the package
assembles them into `FAMILIES`. Imports no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

FUSED_EXPERTS = ("gate_up_proj", "down_proj")  # gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]


@dataclass(frozen=True)
class TinyModel:
    """A tiny random-weight checkpoint of a family (tests/tiny_models.py builds and saves it). `config`: the config
    keywords beyond the sizes every tiny model shares (tiny_models adds those; to `text_config` when there is one);
    `model_class`: the transformers class to build, when it is not the family's AutoModelForCausalLM; `save`:
    `save_pretrained` keywords that store it as the hub stores the family's checkpoints."""

    config: dict[str, Any]
    model_class: str = ""
    save: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FamilySpec:
    name: str  # human name
    block_class: str  # transformers class holding `.experts` (the swap point)
    model_types: tuple[str, ...]  # the first is the family's key: its module's name, its tiny checkpoint's name
    renames: tuple[tuple[str, str], ...] = ()  # regex -> replacement, checkpoint key -> module name
    skip: tuple[str, ...] = ()  # regexes of checkpoint keys outside the text model
    # Experts on disk, after the renames, as suffixes of the experts module prefix: per-expert
    # {e}.<gate>.weight [I, H], {e}.<up>.weight [I, H], {e}.<down>.weight [H, I]; None: FUSED_EXPERTS.
    expert_names: tuple[str, str, str] | None = None
    expert_count_key: str = "num_experts"  # config key of the number of routed experts
    expert_width_key: str = "intermediate_size"  # config key of one expert's width I
    activation: str = "silu"  # the experts' gate activation (act(gate)·up): the config's hidden_act
    unsupported: str = ""  # non-empty: loading fails with this reason
    # localmoe's own architectures (DeaMoE): the block's `experts` is localmoe's module already (not swapped; its
    # tensors load as parameters), `registers` the module whose import registers the model_type with transformers'
    # Auto classes, `checkpoint_check` "module:function" run on the checkpoint folder before the skeleton is built
    native_experts: bool = False
    registers: str = ""
    checkpoint_check: str = ""
    no_int4: str = ""  # non-empty: --experts int4 is refused with this reason
    tiny: TinyModel | None = field(default=None, compare=False, repr=False)  # tests' tiny model; None: none built

    @property
    def key(self) -> str:
        """The family's short name: its first model_type (`qwen3_moe`), the name of its module here."""
        return self.model_types[0]

    def rename(self, key: str) -> str | None:
        """Module-namespace name for a checkpoint key, or None when the key is to be skipped."""
        for pattern in self.skip:
            if re.search(pattern, key):
                return None
        for pattern, repl in self.renames:
            key = re.sub(pattern, repl, key)
        return key
