"""GPT-OSS checkpoints' experts, read as the hub stores them: MXFP4 (config.json `quantization_config.quant_method:
mxfp4`, as openai/gpt-oss-20b and -120b have it) with biases.

Per MoE layer, under `model.layers.N.mlp.experts.`:
  gate_up_proj_blocks [E, 2I, H/32, 16] uint8   e2m1 codes, two per byte (low nibble first), gate rows at even
  gate_up_proj_scales [E, 2I, H/32] uint8       indices and up rows at odd; one e8m0 exponent per 32 codes
  gate_up_proj_bias   [E, 2I] float             the same interleaving
  down_proj_blocks    [E, H, I/32, 16] uint8    down_proj [H, I]: blocks of 32 along I
  down_proj_scales    [E, H, I/32] uint8
  down_proj_bias      [E, H] float

How localmoe loads them (kernels/mxfp4.py owns the in-memory layout): expert by expert, gate and up rows
de-interleaved into `Mxfp4Tensor`s (the bytes unchanged) and down transposed nibble by nibble into the neuron-major
`w_down_t` (lossless); the stacks live on the device, or offloaded in (pinned) host memory like int4 master copies;
no bf16 copy of an expert exists at any point. The biases go to the compute device in the model's dtype
(`LocalExperts.biases`). Every tensor's presence, dtype and shape is checked from the safetensors header first, and a
fault is one line naming the tensor.

`--experts` for such a checkpoint: full (the default, meaning the checkpoint's own format) and mxfp4 read it in place;
int4 and nf4 are refused (its experts are 4-bit already: a second rounding for no memory saved).
"""

from __future__ import annotations

import torch

from localmoe.errors import RuntimeFailure, UsageError
from localmoe.experts.clamped_swiglu import ExpertBiases
from localmoe.experts.expert_weights import ExpertWeights
from localmoe.experts.host_memory import HostMemory
from localmoe.experts.int4 import PROJECTIONS, empty_stack
from localmoe.kernels.mxfp4 import down_t_from_hub, gate_up_from_hub
from localmoe.safe_text import for_line

NAMES = (
    "gate_up_proj_blocks",
    "gate_up_proj_scales",
    "gate_up_proj_bias",
    "down_proj_blocks",
    "down_proj_scales",
    "down_proj_bias",
)


def checkpoint_format(config) -> str | None:
    """ "mxfp4" for a checkpoint whose config says its weights are MXFP4 (gpt-oss), None otherwise."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    return "mxfp4" if qc.get("quant_method") == "mxfp4" else None


def check_experts_format(experts_format: str) -> str:
    """The experts format an MXFP4 checkpoint loads with: mxfp4 ("full", the default, means the checkpoint's own)."""
    if experts_format in ("int4", "nf4"):
        raise UsageError(
            f"this checkpoint's experts are MXFP4 already (4-bit, read as they are): drop --experts "
            f"{experts_format} ({experts_format} would quantize them a second time and save no memory)"
        )
    return "mxfp4"


def stored_as_mxfp4(keys: dict) -> bool:
    """Whether a layer's expert keys {name: (file, key)} are the hub's MXFP4 tensors."""
    return any(name.endswith(("_blocks", "_scales")) for name in keys)


def _want(E: int, I: int, H: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor's shape and dtype kind ("U8" or "float")."""
    return {
        "gate_up_proj_blocks": ((E, 2 * I, H // 32, 16), "U8"),
        "gate_up_proj_scales": ((E, 2 * I, H // 32), "U8"),
        "gate_up_proj_bias": ((E, 2 * I), "float"),
        "down_proj_blocks": ((E, H, I // 32, 16), "U8"),
        "down_proj_scales": ((E, H, I // 32), "U8"),
        "down_proj_bias": ((E, H), "float"),
    }


class _Layer:
    """One layer's expert tensors, checked from their headers, then read expert by expert."""

    def __init__(self, prefix: str, keys: dict, handle, E: int, I: int, H: int):
        self.prefix, self.keys, self.handle = prefix, keys, handle
        for name, (shape, kind) in _want(E, I, H).items():
            if name not in keys:
                raise RuntimeFailure(
                    f"checkpoint lacks {for_line(prefix)}.{name} (an MXFP4 expert tensor); re-download it with "
                    "`localmoe pull`"
                )
            file, key = keys[name]
            sl = self._slice(name)
            try:
                got, dtype = tuple(sl.get_shape()), sl.get_dtype()
            except Exception as e:
                raise self._corrupt(file, key, e) from None
            if got != shape:
                raise RuntimeFailure(
                    f"{for_line(file.name)}: expert tensor {for_line(key)} has shape {list(got)}, config.json says "
                    f"{list(shape)}: checkpoint and config disagree"
                )
            if (kind == "U8") != (dtype == "U8") or (kind == "float" and dtype not in ("BF16", "F16", "F32")):
                raise RuntimeFailure(
                    f"{for_line(file.name)}: expert tensor {for_line(key)} is {for_line(dtype)}, MXFP4 "
                    f"{'codes and scales are U8' if kind == 'U8' else 'biases are floats'}: the checkpoint is corrupt"
                )

    @staticmethod
    def _corrupt(file, key, e) -> RuntimeFailure:
        return RuntimeFailure(
            f"{for_line(file.name)}: cannot read {for_line(key)} ({for_line(e)}); the file is corrupt or truncated"
        )

    def _slice(self, name: str):
        file, key = self.keys[name]
        try:
            return self.handle(file).get_slice(key)
        except Exception as e:
            raise self._corrupt(file, key, e) from None

    def read(self, name: str, index=None):
        """Tensor `name` of the layer, or its expert `index`."""
        file, key = self.keys[name]
        try:
            sl = self._slice(name)
            return sl[index] if index is not None else sl[:]
        except RuntimeFailure:
            raise
        except Exception as e:
            raise self._corrupt(file, key, e) from None


def load_layer(prefix: str, mod, keys: dict, handle, *, device, dtype, host: bool, memory: HostMemory):
    """One layer's MXFP4 experts into new Mxfp4Tensor stacks (on `device`, or with `host` in host memory, pinned
    while pinning works) -> ExpertWeights; the biases onto `device` as `mod.biases` (the compute device)."""
    E, I, H = mod.num_experts, mod.intermediate_size, mod.hidden_size
    if H % 32 or I % 32:
        raise UsageError(f"MXFP4 experts need hidden and expert widths divisible by 32; this model's are {H} and {I}")
    layer = _Layer(prefix, keys, handle, E, I, H)
    alloc = memory if host else None
    where = torch.device("cpu") if host else device
    w = ExpertWeights(*(empty_stack("mxfp4", (E, I, H), dtype, where, p, alloc=alloc) for p in PROJECTIONS))
    for e in range(E):
        gate_b, gate_s, up_b, up_s = gate_up_from_hub(
            layer.read("gate_up_proj_blocks", e), layer.read("gate_up_proj_scales", e)
        )
        down_b, down_s = down_t_from_hub(layer.read("down_proj_blocks", e), layer.read("down_proj_scales", e))
        for stack, blocks, scales in ((w.w_gate, gate_b, gate_s), (w.w_up, up_b, up_s), (w.w_down_t, down_b, down_s)):
            stack.blocks[e].copy_(blocks)
            stack.scales[e].copy_(scales)
    gate_up, down = layer.read("gate_up_proj_bias"), layer.read("down_proj_bias")
    mod.biases = ExpertBiases(
        *(t.to(device=device, dtype=dtype).contiguous() for t in (gate_up[:, 0::2], gate_up[:, 1::2], down))
    )
    return w
