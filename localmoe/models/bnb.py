"""Checkpoints quantized with bitsandbytes (config.json `quantization_config.quant_method: bitsandbytes`): their
quirks, in one place.

A bnb-4bit checkpoint stores each quantized Linear's weight as bitsandbytes' Linear4bit saves it: `<name>.weight`,
the packed bytes ([out * in / 2, 1] uint8, two NF4 values per byte, high nibble first, blocks of `blocksize` along
the row-major [out, in] matrix), beside its quant state: `<name>.weight.absmax` (fp32 per block, or uint8 when the
statistics are double-quantized, then with `.nested_absmax` and `.nested_quant_map`), `.quant_map` (the 16-entry
codebook) and `.quant_state.bitsandbytes__nf4` (shape, dtype, blocksize as packed JSON).

How localmoe loads one (`--experts nf4`, chosen for it):
* routed experts go straight into the NF4 store (kernels/nf4.py `Nf4Tensor`): gate and up rows are bitsandbytes'
  own bytes and absmax (double-quantized statistics expanded to fp32 once); down_proj, stored [H, I] with its
  blocks along I, is needed transposed ([I, H], a neuron's output vector contiguous, blocks along H), so it is
  dequantized one expert at a time and quantized again along H (a second NF4 rounding of that projection);
  nothing but one expert's matrix is ever held in the model's dtype;
* every other quantized Linear (attention, the router, a shared expert) is dequantized once as it loads: localmoe's
  fused decode kernels read the model's dtype, and those weights are a small share of an MoE's;
* 8-bit and FP4 checkpoints are refused in one line.

Imports no torch at module level (the CLI's --help path reads configs through checkpoint.py).
"""

from __future__ import annotations

from localmoe.errors import RuntimeFailure, UsageError
from localmoe.safe_text import for_line

STATE_SUFFIXES = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state.bitsandbytes__nf4")


def checkpoint_format(config) -> str | None:
    """ "nf4" for a bitsandbytes 4-bit NF4 checkpoint, None for an unquantized one; UsageError for the bitsandbytes
    formats localmoe does not load (8-bit, FP4)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    if qc.get("quant_method") != "bitsandbytes":
        return None
    if qc.get("load_in_8bit") or not qc.get("load_in_4bit"):
        raise UsageError(
            "8-bit bitsandbytes checkpoints are not supported: use the model's bnb-4bit (NF4) checkpoint, or its "
            "bf16 one with --experts nf4 or --experts int4"
        )
    kind = qc.get("bnb_4bit_quant_type", "fp4")
    if kind != "nf4":
        raise UsageError(
            f"bitsandbytes {for_line(str(kind))} checkpoints are not supported (NF4 only): use the model's bf16 "
            "checkpoint with --experts nf4"
        )
    return "nf4"


def require() -> None:
    """RuntimeFailure in one line when bitsandbytes (NF4's quantizer and a bnb checkpoint's reader) is missing."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise RuntimeFailure("NF4 experts need bitsandbytes, which is not installed: pip install bitsandbytes")


def check_experts_format(experts_format: str) -> str:
    """The experts format a bnb-4bit checkpoint loads with: nf4 ("full", the default, means the checkpoint's own)."""
    if experts_format == "int4":
        raise UsageError(
            "this checkpoint's experts are NF4 already (bitsandbytes 4-bit): use --experts nf4 (int4 would "
            "quantize them a second time)"
        )
    return "nf4"


def quantized(keys: dict, name: str) -> dict | None:
    """The quant state's (file, key) by suffix for tensor `name` of the `keys` map {name: (file, key)}, or None when
    `name` is a plain tensor."""
    state = {s: keys[f"{name}.{s}"] for s in STATE_SUFFIXES if f"{name}.{s}" in keys}
    return state or None


def _state(state: dict, handle, device):
    import torch

    from localmoe.kernels.nf4 import NF4_CODE, bnb_functional

    bnb_f = bnb_functional()

    tensors = {}
    for suffix, (file, key) in state.items():
        try:
            tensors[suffix] = handle(file).get_tensor(key)
        except Exception as e:
            raise RuntimeFailure(
                f"{for_line(file.name)}: cannot read {for_line(key)} ({for_line(e)}); the file is corrupt or truncated"
            ) from None
    code = tensors.get("quant_map")  # checked here, on the host: after from_dict it is on `device` (a sync per read)
    if code is not None and not torch.equal(code.float(), torch.tensor(NF4_CODE)):
        raise UsageError("this bitsandbytes checkpoint's quant_map is not the NF4 codebook: it is not supported")
    try:
        qs = bnb_f.QuantState.from_dict(tensors, device=device)
    except (ValueError, KeyError, TypeError) as e:
        raise RuntimeFailure(
            f"unreadable bitsandbytes quant state ({for_line(e)}); re-download the checkpoint"
        ) from None
    if qs.quant_type != "nf4":
        raise UsageError(f"bitsandbytes {for_line(qs.quant_type)} tensors are not supported (NF4 only)")
    return qs


def dequantize(packed, state: dict, handle, device, dtype):
    """A quantized tensor [out, in] in `dtype` on `device` (bitsandbytes' dequantize_4bit)."""
    from localmoe.kernels.nf4 import bnb_functional

    bnb_f = bnb_functional()

    qs = _state(state, handle, device)
    return bnb_f.dequantize_4bit(packed.to(device), qs).to(dtype)


def absmax_fp32(qs):
    """The per-block absmax in fp32 (double-quantized statistics expanded as bitsandbytes' dequantize_4bit does)."""
    from localmoe.kernels.nf4 import bnb_functional

    bnb_f = bnb_functional()
    import torch

    if not qs.nested:
        return qs.absmax.float()
    return (bnb_f.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset).to(torch.float32)


def put_expert(dst, e: int, packed, state: dict, handle, device, dtype, *, transpose: bool) -> None:
    """Expert e's quantized matrix (packed bytes + quant state) into the stack `dst`: bitsandbytes' bytes and absmax
    as they are where `dst` is an Nf4Tensor with the checkpoint's block along its rows and no transpose is needed
    (gate, up); otherwise dequantized on `device` (one expert's matrix) and quantized into `dst` (down_proj)."""
    from localmoe.kernels.nf4 import Nf4Tensor

    qs = _state(state, handle, device)
    H = dst.shape[2]
    if isinstance(dst, Nf4Tensor) and not transpose and qs.blocksize == dst.group and H % qs.blocksize == 0:
        dst.put_packed(e, packed, absmax_fp32(qs))
        return
    from localmoe.kernels.nf4 import bnb_functional

    bnb_f = bnb_functional()

    w = bnb_f.dequantize_4bit(packed.to(device), qs).to(dtype)
    w = w.T if transpose else w
    if isinstance(dst, Nf4Tensor):
        dst.put(e, w, work_device=device)
    else:
        dst[e].copy_(w)
