"""DeaMoE checkpoints: the tensor names, and the one-line refusal of a checkpoint that does not match its config.

A checkpoint is what `DeaMoeForCausalLM.save_pretrained` writes: config.json (model_type "deamoe") and safetensors
(one file or shards with model.safetensors.index.json). Tensors (D departments, n experts each, h department width,
H hidden, E = D * n, A attention heads, K kv heads, d head_dim, V vocab):

    model.embed_tokens.weight                          [V, H]
    model.norm.weight                                  [H]
    lm_head.weight                                     [V, H]    absent when tie_word_embeddings
    model.layers.{i}.input_layernorm.weight            [H]
    model.layers.{i}.post_attention_layernorm.weight   [H]
    model.layers.{i}.self_attn.q_proj.weight           [A * d, H]     (Qwen3-MoE's attention)
    model.layers.{i}.self_attn.k_proj.weight           [K * d, H]
    model.layers.{i}.self_attn.v_proj.weight           [K * d, H]
    model.layers.{i}.self_attn.o_proj.weight           [H, A * d]
    model.layers.{i}.self_attn.q_norm.weight           [d]
    model.layers.{i}.self_attn.k_norm.weight           [d]
    model.layers.{i}.mlp.gate.weight                   [E, H]    router; expert e = d * n + j
    model.layers.{i}.mlp.experts.gate_proj             [D, h, H] shared per department
    model.layers.{i}.mlp.experts.up_proj               [D, h, H] shared per department
    model.layers.{i}.mlp.experts.down_t                [D, h, H] shared per department, W_down transposed
    model.layers.{i}.mlp.experts.private               [D, n, h, h] expert j of department d: z = u @ private[d, j]

The Qwen3.5 twin (model_type "deamoe_qwen3_5_text", qwen3_5.py) stores Qwen3.5-MoE's tensors (transformers' names;
transformers checks them) with the router and the four department tensors above in place of Qwen3.5's experts; of
its tensors this module checks the embedding, the final norm and each layer's router, department tensors and shared
expert.

`check_checkpoint(folder)` reads the config and the safetensors headers only (no tensor data) and raises
`localmoe.errors.UsageError` naming the first tensor that is missing or whose shape disagrees with the config's
departments / experts / widths (the config's own inconsistencies are refused by `DeaMoeConfig.check`).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from localmoe.errors import UsageError
from localmoe.safe_text import for_line


def expected_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor name of a DeaMoE checkpoint with its shape, for the config `cfg` (the twin: those checked here)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    D, n, h = cfg.num_departments, cfg.experts_per_department, cfg.department_size
    out = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (V, H)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
        if cfg.model_type == "deamoe":
            d, A, K = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
            out |= {
                p + "self_attn.q_proj.weight": (A * d, H),
                p + "self_attn.k_proj.weight": (K * d, H),
                p + "self_attn.v_proj.weight": (K * d, H),
                p + "self_attn.o_proj.weight": (H, A * d),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
            }
        else:  # the Qwen3.5 twin: its shared expert and gate
            S = cfg.shared_expert_intermediate_size
            out |= {
                p + "mlp.shared_expert.gate_proj.weight": (S, H),
                p + "mlp.shared_expert.up_proj.weight": (S, H),
                p + "mlp.shared_expert.down_proj.weight": (H, S),
                p + "mlp.shared_expert_gate.weight": (1, H),
            }
        out |= {
            p + "mlp.gate.weight": (D * n, H),
            p + "mlp.experts.gate_proj": (D, h, H),
            p + "mlp.experts.up_proj": (D, h, H),
            p + "mlp.experts.down_t": (D, h, H),
            p + "mlp.experts.private": (D, n, h, h),
        }
    return out


def _header(path: Path) -> dict:
    """The safetensors header of `path` (name -> {"shape", "dtype", ...})."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        if size > 100 << 20:
            raise UsageError(f"deamoe checkpoint: {for_line(path.name)} is not a safetensors file")
        head = json.loads(f.read(size))
    head.pop("__metadata__", None)
    return head


def stored_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in the checkpoint's safetensors files."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        try:
            shapes |= {k: tuple(v["shape"]) for k, v in _header(f).items()}
        except (OSError, ValueError, KeyError, struct.error) as e:
            raise UsageError(f"deamoe checkpoint: cannot read {for_line(f.name)} ({type(e).__name__})") from None
    return shapes


def check_checkpoint(folder: str | Path) -> None:
    """Refuse (UsageError, one line naming the tensor) a checkpoint whose tensors do not match its config."""
    from transformers import AutoConfig  # transformers: only when a check runs

    folder = Path(folder)
    cfg = AutoConfig.from_pretrained(str(folder))  # the configs' checks refuse inconsistent counts
    shapes = stored_shapes(folder)
    shape_of = (
        f"{cfg.num_departments} departments x {cfg.experts_per_department} experts, width {cfg.department_size}, "
        f"hidden {cfg.hidden_size}"
    )
    for name, want in expected_shapes(cfg).items():
        got = shapes.get(name)
        if got is None:
            raise UsageError(
                f"{cfg.model_type} checkpoint {for_line(str(folder))}: tensor {name} is missing (config: {shape_of}); "
                "the checkpoint is incomplete or not a DeaMoE checkpoint"
            )
        if got != want:
            raise UsageError(
                f"{cfg.model_type} checkpoint {for_line(str(folder))}: tensor {name} has shape {list(got)}, the config "
                f"({shape_of}) needs {list(want)}"
            )


def local_folder(name_or_path, revision: str | None = None) -> Path | None:
    """The checkpoint folder behind a from_pretrained argument: a local folder, or a snapshot already in the HF
    cache (never downloads); None when neither."""
    p = Path(str(name_or_path))
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(name_or_path), revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache: transformers reports it in its own words
        return None
