"""Streaming a checkpoint's tensors into the skeleton, one at a time, so host memory never holds two copies of the
weights: every non-expert tensor to where its unit lives; expert tensors expert by expert with
`safe_open(...).get_slice` straight into the expert store (`ExpertWeights`, [E, I, H] each: on the device, in host
memory, quantized to int4 as read, or into memory-mapped files). Handles fused (`experts.gate_up_proj`/`down_proj`),
per-expert (`experts.{e}.gate_proj/...`, Mixtral's `w1/w3/w2`) and Granite's `input_linear`/`output_linear`
layouts; shapes and dtypes are checked against the config as read. A family with `native_experts` (DeaMoE) has no
expert store: its department tensors are parameters, streamed like every non-expert tensor.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from localmoe.errors import RuntimeFailure
from localmoe.events import ProgressFn
from localmoe.experts.expert_weights import ExpertWeights
from localmoe.experts.host_memory import HostMemory
from localmoe.experts.int4 import STORAGE, Int4Tensor
from localmoe.experts.local_experts import LocalExperts
from localmoe.models import bnb, gpt_oss_weights
from localmoe.models.checkpoint import map_keys, open_shard
from localmoe.models.families import PER_EXPERT_NAMES
from localmoe.models.offload import Placement, place_buffers
from localmoe.models.skeleton import keep_fp32
from localmoe.safe_text import for_line


def load_weights(
    model,
    text_config,
    fam,
    experts: dict[str, LocalExperts],
    files: list[Path],
    placed: Placement,
    files_store,
    *,
    device: torch.device,
    dtype: torch.dtype,
    experts_format: str,
    progress: ProgressFn | None = None,
) -> None:
    """Every tensor of `files` into the skeleton (non-expert tensors, then each layer's experts), tied weights tied,
    buffers placed; a RuntimeFailure naming the first missing tensor when the checkpoint lacks any."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    if fam.native_experts:  # DeaMoE: the experts are parameters of localmoe's own module, loaded like the rest
        experts = {}
    others: dict = {}  # keys of no parameter: a bitsandbytes checkpoint's quant states (models/bnb.py)
    dense, expert_keys = map_keys(files, fam.rename, experts, params, others)
    total = len(dense) + sum(m.num_experts for m in experts.values())
    with _open_shards() as handle:
        loaded = _load_dense(model, dense, others, handle, placed, device, dtype, progress, total)
        done = len(dense)
        for prefix, mod in experts.items():
            _load_experts(prefix, mod, expert_keys[prefix], handle, placed, files_store, device, dtype, experts_format)
            done += mod.num_experts
            if progress:
                progress("load", done, total)
    _check_complete(model, text_config, params, loaded)
    place_buffers(model, placed.dmap, device)
    if progress:
        progress("load", total, total)


@contextlib.contextmanager
def _open_shards():
    """handle(file): the shard open for reading, each opened once, all closed on the way out."""
    handles: dict[Path, object] = {}

    def handle(file: Path):
        if file not in handles:
            handles[file] = open_shard(file).__enter__()
        return handles[file]

    try:
        yield handle
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)


def _load_dense(model, dense, others, handle, placed: Placement, device, dtype, progress, total: int) -> set[str]:
    """The non-expert tensors, each checked and put where its unit lives (float32 for the model's keep-in-fp32
    modules; an offloaded DeaMoE's department tensors in host memory: `Placement.device_for`; a bitsandbytes 4-bit
    weight dequantized once, its quant state in `others`) -> the parameter names loaded."""
    from accelerate.utils import set_module_tensor_to_device

    fp32_modules = keep_fp32(model)
    loaded: set[str] = set()
    done = 0
    for file, key, name in dense:
        try:
            tensor = handle(file).get_tensor(key)
        except Exception as e:
            raise RuntimeFailure(
                f"{for_line(file.name)}: cannot read {for_line(key)} ({for_line(e)}); the file is corrupt or truncated"
            ) from None
        state = bnb.quantized(others, name)
        if state is not None:
            tensor = bnb.dequantize(tensor, state, handle, placed.device_for(name, device), dtype)
        _check_dense(file, key, tensor, model.get_parameter(name))
        tdtype = torch.float32 if any(m in name for m in fp32_modules) and tensor.is_floating_point() else dtype
        set_module_tensor_to_device(
            model,
            name,
            placed.device_for(name, device),
            value=tensor,
            dtype=tdtype if tensor.is_floating_point() else None,
        )
        loaded.add(name)
        done += 1
        if progress and done % 16 == 0:
            progress("load", done, total)
    return loaded


def _load_experts(prefix, mod, keys, handle, placed: Placement, files_store, device, dtype, experts_format) -> None:
    """One MoE layer's routed experts into their storage: memory-mapped files (written once, then mapped as they
    are), int4 stacks (quantized on the device expert by expert as read, so VRAM never holds the layer in bf16; kept
    there or, offloaded, in host memory), or full-precision stacks on the device or in host memory."""
    shape = (mod.num_experts, mod.intermediate_size, mod.hidden_size)
    if experts_format == "mxfp4":  # a gpt-oss checkpoint's own MXFP4 experts, read as they are
        mod.weights = gpt_oss_weights.load_layer(
            prefix, mod, keys, handle, device=device, dtype=dtype, host=placed.host, memory=placed.memory
        )
        return
    if gpt_oss_weights.stored_as_mxfp4(keys):
        raise RuntimeFailure(
            f"the experts under {for_line(prefix)} are stored as MXFP4 but config.json has no quantization_config "
            "with quant_method mxfp4: checkpoint and config disagree; re-download the checkpoint"
        )
    if files_store is not None:
        into, ready = files_store.open(prefix, shape)
        if not ready:
            _load_layer_experts(prefix, mod, keys, handle, device, dtype, into=into)
            files_store.done(prefix, shape)
        mod.weights = into
    elif experts_format in STORAGE:  # int4, nf4
        kind = STORAGE[experts_format]
        into = ExpertWeights(*(_int4_storage(kind, shape, dtype, device, placed.host, placed.memory) for _ in range(3)))
        mod.weights = _load_layer_experts(prefix, mod, keys, handle, device, dtype, into=into)
    else:
        mod.weights = _load_layer_experts(
            prefix, mod, keys, handle, device, dtype, host=placed.host, memory=placed.memory
        )


def _check_complete(model, text_config, params: set[str], loaded: set[str]) -> None:
    """Every parameter loaded, tied embeddings tied."""
    missing = sorted(params - loaded)
    if missing and getattr(text_config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise RuntimeFailure(
            f"checkpoint lacks {len(missing)} tensors (first: {missing[0]}); re-download it with `localmoe pull`"
        )


def _load_layer_experts(
    prefix,
    mod: LocalExperts,
    keys: dict,
    handle,
    device,
    dtype,
    *,
    host: bool = False,
    memory: HostMemory | None = None,
    into: ExpertWeights | None = None,
) -> ExpertWeights:
    E, I, H = mod.num_experts, mod.intermediate_size, mod.hidden_size
    shape = (E, I, H)
    if into is not None:  # given storage (the memory-mapped files)
        w = into
    elif host:  # offloaded: the master copies live in host memory, pinned when possible
        alloc = memory
        w = ExpertWeights(*(alloc(shape, dtype) for _ in range(3)))
    else:
        w = ExpertWeights(*(torch.empty(shape, dtype=dtype, device=device) for _ in range(3)))

    def corrupt(file, key, e):
        return RuntimeFailure(
            f"{for_line(file.name)}: cannot read {for_line(key)} ({for_line(e)}); the file is corrupt or truncated"
        )

    def read(key_file, index=None, check=True):
        """The tensor (or its expert `index`), its dtype checked from the header first (unless not `check`)."""
        file, key = key_file
        try:
            sl = handle(file).get_slice(key)
            dt = sl.get_dtype()
        except Exception as e:
            raise corrupt(file, key, e) from None
        if check:
            _check_dtype(file, key, dt)
        try:
            return sl[index] if index is not None else sl[:]
        except Exception as e:
            raise corrupt(file, key, e) from None

    def whole_shape(key_file, want):
        """A fused tensor's shape [E, ...] from its header, before expert e of it is read."""
        file, key = key_file
        try:
            got = tuple(handle(file).get_slice(key).get_shape())
        except Exception as e:
            raise corrupt(file, key, e) from None
        if got != tuple(want):
            raise RuntimeFailure(
                f"{for_line(file.name)}: expert tensor {for_line(key)} has shape {list(got)}, "
                f"config.json says {list(want)}: checkpoint and config disagree"
            )

    if "gate_up_proj" in keys and "down_proj" in keys:  # fused: [E, 2I, H] and [E, H, I]
        whole_shape(keys["gate_up_proj"], (E, 2 * I, H))
        whole_shape(keys["down_proj"], (E, H, I))
        for e in range(E):
            gu = read(keys["gate_up_proj"], e)
            _check(prefix, "gate_up_proj", gu.shape, (2 * I, H))
            _put(w.w_gate, e, gu[:I], device)
            _put(w.w_up, e, gu[I:], device)
            dn = read(keys["down_proj"], e)
            _check(prefix, "down_proj", dn.shape, (H, I))
            _put(w.w_down_t, e, dn.T, device)
        return w
    for names in PER_EXPERT_NAMES.values():
        g_name, u_name, d_name = (f"0.{n}.weight" for n in names)
        if g_name in keys:
            for e in range(E):
                for dst, n, want, transpose in (
                    (w.w_gate, names[0], (I, H), False),
                    (w.w_up, names[1], (I, H), False),
                    (w.w_down_t, names[2], (H, I), True),
                ):
                    kf = keys.get(f"{e}.{n}.weight")
                    if kf is None:
                        raise RuntimeFailure(
                            f"checkpoint lacks {prefix}.{e}.{n}.weight; re-download it with `localmoe pull`"
                        )
                    state = bnb.quantized(keys, f"{e}.{n}.weight")
                    if state is not None:  # bitsandbytes 4-bit: its bytes into the NF4 store
                        packed = read(kf, check=False)
                        _check(prefix, f"{e}.{n}", (2 * packed.numel(),), (want[0] * want[1],))
                        bnb.put_expert(dst, e, packed, state, handle, device, dtype, transpose=transpose)
                        continue
                    t = read(kf)
                    _check(prefix, f"{e}.{n}", t.shape, want)
                    _put(dst, e, t.T if transpose else t, device)
            return w
    found = ", ".join(sorted(keys)[:4]) or "nothing"
    raise RuntimeFailure(
        f"unrecognised expert layout under {prefix} (found {found}); this checkpoint layout is not supported"
    )


def _put(dst, e: int, rows: torch.Tensor, device) -> None:
    """Expert e's [I, H] rows into a layer's stack: copied, or quantized on `device` into an Int4Tensor."""
    if isinstance(dst, Int4Tensor):
        dst.put(e, rows, work_device=device)
    else:
        dst[e].copy_(rows)


def _int4_storage(kind, shape, dtype, device, host: bool, memory: HostMemory) -> Int4Tensor:
    """An empty 4-bit stack [E, I, H] of class `kind` (Int4Tensor, Nf4Tensor) on the device, or offloaded in host
    memory (pinned while pinning works)."""
    if not host:
        return kind.empty(shape, dtype, device)
    return kind.empty(shape, dtype, "cpu", alloc=memory)


# Weights localmoe converts to the run's dtype as it reads them; anything else (int8, fp8, packed 4-bit) is a
# quantized checkpoint whose values mean something only with its scales, which localmoe does not read.
FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
_QUANTIZED_HINT = (
    "localmoe loads float16/bfloat16/float32 and bitsandbytes 4-bit (NF4) checkpoints only (other quantized ones "
    "are not supported; --experts int4 or nf4 quantizes a bf16 checkpoint itself): use the model's bf16 checkpoint"
)


_NAMES = {
    "I8": "int8",
    "U8": "uint8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}  # safetensors dtype names as torch spells them


def _check_dtype(file: Path, key: str, dtype) -> None:
    """`dtype`: a safetensors dtype name ("BF16", "I8", ...) or a torch dtype."""
    if dtype in FLOAT_DTYPES or dtype in FLOAT_DTYPES.values():
        return
    name = _NAMES.get(dtype, dtype) if isinstance(dtype, str) else str(dtype).replace("torch.", "")
    raise RuntimeFailure(f"{for_line(file.name)}: tensor {for_line(key)} is {for_line(name)}; {_QUANTIZED_HINT}")


def _check_dense(file: Path, key: str, tensor: torch.Tensor, param: torch.Tensor) -> None:
    """A non-expert tensor (attention, router, norms, embeddings) must have the shape the config gives its parameter
    (accelerate would only say "this looks incorrect", naming no tensor) and a float dtype (an int8 tensor would be
    cast to the run's dtype as if it held weights)."""
    if tuple(tensor.shape) != tuple(param.shape):
        raise RuntimeFailure(
            f"{for_line(file.name)}: tensor {for_line(key)} has shape {list(tensor.shape)}, "
            f"config.json says {list(param.shape)}: checkpoint and config disagree; re-download the "
            "checkpoint or fix config.json"
        )
    if param.is_floating_point():
        _check_dtype(file, key, tensor.dtype)


def _check(prefix, name, got, want):
    if tuple(got) != tuple(want):
        raise RuntimeFailure(
            f"expert tensor {for_line(prefix)}.{for_line(name)} has shape {list(got)}, config.json "
            f"says {list(want)}: checkpoint and config disagree"
        )
