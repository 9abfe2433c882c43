"""Checkpoint loading: build the text model on the meta device, swap in localmoe's experts, stream tensors.

1. `AutoConfig` (no remote code) → the family table decides whether the architecture is supported.
2. The transformers model is built with parameters on the meta device (buffers real), and each MoE
   block's `experts` submodule is replaced by a parameter-free `LocalExperts` (families.FAMILIES).
3. Every non-expert tensor is read from the safetensors files one at a time and placed where it lives;
   expert tensors are read expert by expert with `safe_open(...).get_slice` straight into the expert
   store (`ExpertWeights`, [E, I, H] each), so host memory never holds two copies of the weights.
Handles fused (`experts.gate_up_proj`/`down_proj`), per-expert (`experts.{e}.gate_proj/...`, Mixtral's
`w1/w3/w2`) and Granite's `input_linear`/`output_linear` layouts, single-file and sharded checkpoints.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from localmoe.errors import RuntimeFailure, UsageError
from localmoe.events import ProgressFn
from localmoe.experts.int4 import Int4Tensor
from localmoe.experts.local_experts import ExpertWeights, LocalExperts
from localmoe.models.families import (
    EXPERT_COUNT_KEYS,
    EXPERT_WIDTH_KEYS,
    FAMILIES,
    PER_EXPERT_NAMES,
    FamilySpec,
    expert_count,
    family_for_model_type,
    supported_families,
)
from localmoe.safe_text import for_line


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: object  # the text config
    family: FamilySpec
    experts: list[LocalExperts]  # one per MoE layer, in layer order
    offload: object = None  # localmoe.experts.placement.OffloadPlan when a VRAM budget was given
    cache: object = None  # localmoe.experts.cache.ExpertCache when experts are offloaded
    host_pinned: bool = False  # expert master copies in pinned host memory
    host_storage: str = ""  # where offloaded experts' master copies live: pinned, pageable or mmap (files)

    def expert_bytes(self) -> int:
        return sum(m.weights.nbytes() for m in self.experts)


def read_config(path: Path):
    from transformers import AutoConfig

    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # older huggingface_hub: transformers' configs were not validated dataclasses
        StrictDataclassError = ValueError
    where = f"{for_line(path)}/config.json"
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except StrictDataclassError as e:  # a field of the wrong type (transformers >= 5 validates them)
        why = str(e).strip().splitlines()[-1].strip().removeprefix("TypeError: ").removeprefix("ValueError: ")
        raise UsageError(f"{where}: {for_line(why)}: fix config.json (or re-download the checkpoint)") from None
    except ValueError as e:  # unknown model_type, remote code needed
        raise UsageError(
            f"cannot read {where}: {for_line(str(e).splitlines()[0])}; supported: {supported_families()}"
        ) from None
    except (OSError, json.JSONDecodeError) as e:
        raise RuntimeFailure(f"cannot read {where}: {for_line(e)}") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    fam = family_for_model_type(config.model_type) or family_for_model_type(text.model_type)
    if fam is None:
        raise UsageError(
            f"architecture {for_line(repr(config.model_type))} is not a supported MoE family; "
            f"supported: {supported_families()}"
        )
    if fam.unsupported:
        raise UsageError(fam.unsupported)
    check_sizes(text, where + ("" if text is config else " (text_config)"))
    return config, text, fam


# Sizes a config may carry that must be positive integers when present (transformers builds tensors of negative
# size, or a model with no experts, without complaint). Zero is refused too: no supported family has a zero here.
POSITIVE_SIZES = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
    *EXPERT_COUNT_KEYS,
    *EXPERT_WIDTH_KEYS,
    "num_experts_per_tok",
)


def check_sizes(text_config, where: str) -> None:
    """UsageError naming the field when a size in the text config is not a positive integer, or when a token is
    routed to more experts (`num_experts_per_tok`) than the model has."""
    aliases = dict(getattr(text_config, "attribute_map", None) or {})  # e.g. num_experts -> num_local_experts
    for key in POSITIVE_SIZES:
        value = getattr(text_config, key, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            stored = aliases.get(key, key)  # config.json may spell it either way
            names = sorted({key, stored} | {a for a, k in aliases.items() if k == stored})
            raise UsageError(
                f"{where}: {' / '.join(names)} is {for_line(repr(value))}, it must be a positive "
                "integer: fix config.json (or re-download the checkpoint)"
            )
    experts = expert_count(text_config)
    k = getattr(text_config, "num_experts_per_tok", None)
    if experts is not None and k is not None and k > experts:
        raise UsageError(
            f"{where}: num_experts_per_tok is {k} but the model has {experts} routed experts: a token "
            "cannot be routed to more experts than exist; fix config.json"
        )


# A checkpoint needs its tokenizer: without these transformers builds an empty one (every text is 0 tokens).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def check_tokenizer(path: Path) -> None:
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise UsageError(
            f"no tokenizer in {for_line(path)}: it has none of {', '.join(TOKENIZER_FILES[:3])}; copy "
            "the tokenizer files of the model's hub repo into it"
        )


INDEX = "model.safetensors.index.json"


def _index_map(index: Path) -> dict:
    """The index's `weight_map` {tensor: shard file name}, each name a plain .safetensors file name: shards resolve
    inside the checkpoint folder only (by name: an HF cache snapshot's files are symlinks into ../../blobs, which
    is fine; a name with a path separator, `..` or an absolute path is refused)."""
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError("weight_map is not a non-empty object")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        why = "no weight_map" if isinstance(e, (KeyError, TypeError)) else getattr(e, "strerror", None) or e
        raise RuntimeFailure(
            f"{for_line(index)} is not a valid safetensors index ({for_line(why)}): re-download the "
            "checkpoint (`localmoe pull`) or save it again"
        ) from None
    for tensor, name in weight_map.items():
        if not _plain_shard_name(name):
            raise UsageError(
                f"{for_line(index)}: weight_map entry {for_line(json.dumps(tensor))} points to "
                f"{for_line(json.dumps(name))}, not a .safetensors file of the checkpoint folder (shards are "
                "plain file names: no folders, '..' or absolute paths); fix the index"
            )
    return weight_map


def _plain_shard_name(name) -> bool:
    return (
        isinstance(name, str)
        and name.endswith(".safetensors")
        and name != ".safetensors"
        and not any(c in name for c in "/\\\0")
        and not os.path.isabs(name)
    )


def shard_files(path: Path) -> list[Path]:
    index = path / INDEX
    if index.is_file():
        files = sorted({path / f for f in _index_map(index).values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise RuntimeFailure(f"{for_line(path)} has no .safetensors weights (localmoe never loads pickle weights)")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise RuntimeFailure(f"checkpoint is incomplete, missing {for_line(missing)}: run `localmoe pull` again")
    return files


def build_skeleton(text_config, dtype: torch.dtype):
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(text_config, dtype=dtype, trust_remote_code=False)
    return model


def swap_experts(model, text_config) -> dict[str, LocalExperts]:
    """Replace each MoE block's `experts`; returns {experts module name: LocalExperts} in layer order."""
    swapped: dict[str, LocalExperts] = {}
    for name, module in list(model.named_modules()):
        if type(module).__name__ not in FAMILIES or not hasattr(module, "experts"):
            continue
        old = module.experts
        E, two_i, H = old.gate_up_proj.shape
        layer = int(m.group(1)) if (m := re.search(r"layers\.(\d+)\.", name + ".")) else len(swapped)
        new = LocalExperts(E, H, two_i // 2, text_config.hidden_act, layer)
        module.experts = new
        swapped[f"{name}.experts"] = new
    if not swapped:
        raise UsageError(f"the checkpoint has no MoE layers localmoe can run; supported: {supported_families()}")
    return swapped


def _open(file: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError: header corrupt, file truncated
        raise RuntimeFailure(f"{file} is corrupt or truncated ({e}); delete it and run `localmoe pull` again") from None


def _keep_fp32(model) -> list[str]:
    keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    keep += list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    return keep


def _units(model) -> dict[str, int]:
    """Parameter bytes of the units accelerate places whole: modules of the model's no-split classes (decoder
    layers), and every parameter-holding module outside them (embedding, final norm, lm_head)."""
    from accelerate.utils import compute_module_sizes

    no_split = set(getattr(model, "_no_split_modules", None) or [])
    sizes = compute_module_sizes(model)
    units: dict[str, int] = {}
    for name, m in model.named_modules():
        if any(name.startswith(u + ".") for u in units):
            continue
        if type(m).__name__ in no_split or (name and next(m.parameters(recurse=False), None) is not None):
            units[name] = sizes.get(name, 0)
    return units


def plan_offload(
    model, text_config, experts: dict, dtype, vram_bytes: int, context: int, on_notice=None, fmt: str = "full"
):
    """The VRAM plan for `vram_bytes`, with experts of format `fmt` ("full" or "int4")."""
    from localmoe.experts import placement
    from localmoe.experts.int4 import expert_bytes as int4_expert_bytes

    el = torch.finfo(dtype).bits // 8
    non_expert = sum(p.numel() * el for p in model.parameters())
    mods = list(experts.values())
    E, I, H = mods[0].num_experts, mods[0].intermediate_size, mods[0].hidden_size
    if any((m.num_experts, m.intermediate_size, m.hidden_size) != (E, I, H) for m in mods):
        raise UsageError("expert offloading needs every MoE layer to have the same expert shape")
    expert_bytes = 3 * I * H * el
    if fmt == "int4":
        try:
            expert_bytes = int4_expert_bytes(I, H)
        except ValueError as e:
            raise UsageError(f"{e}; use --experts full") from None
    largest = max(_units(model).values(), default=0)
    budget = placement.plan(
        budget_bytes=vram_bytes,
        non_expert_bytes=non_expert,
        state=placement.state_bytes(text_config, context, dtype),
        expert_bytes=expert_bytes,
        total_experts=E * len(mods),
        top_k=int(getattr(text_config, "num_experts_per_tok", 1)),
        largest_module_bytes=largest,
    )
    warning = placement.host_ram_notice(budget, placement.available_ram())
    if warning and on_notice:
        on_notice(warning)
    return budget


def int4_hint(loaded: LoadedModel) -> str | None:
    """For offloaded full-precision experts that would all fit the budget in 4 bits: the notice naming the flag."""
    from localmoe.experts.int4 import expert_bytes
    from localmoe.experts.placement import WORKSPACE_RESERVE

    plan, m = loaded.offload, loaded.experts[0]
    if plan is None or not plan.offloading or m.weights.int4:
        return None
    try:
        need = (
            plan.non_expert_bytes
            + plan.state_bytes
            + WORKSPACE_RESERVE
            + plan.total_experts * expert_bytes(m.intermediate_size, m.hidden_size)
        )
    except ValueError:  # no 4-bit format for this hidden size
        return None
    if need > plan.budget_bytes:
        return None
    return (
        f"--experts int4 would keep every expert in VRAM ({need / 2**30:.1f} GiB of the "
        f"{plan.budget_bytes / 2**30:.1f} GiB budget; 4-bit weights, a small accuracy cost)"
    )


def place_non_experts(model, budget, device: torch.device, dtype) -> dict[str, torch.device]:
    """Where each non-expert unit lives when the plan spills: accelerate's `infer_auto_device_map` fills the GPU's
    share of the budget in model order and puts the rest in host memory. {} when nothing spills."""
    if budget is None or not budget.spills:
        return {}
    from accelerate import infer_auto_device_map

    no_split = list(getattr(model, "_no_split_modules", None) or [])
    dmap = infer_auto_device_map(
        model,
        max_memory={0: budget.non_expert_gpu_bytes, "cpu": 1 << 50},
        no_split_module_classes=no_split,
        dtype=dtype,
    )
    return {name: torch.device("cpu") if where in ("cpu", "disk") else device for name, where in dmap.items()}


def device_of(name: str, dmap: dict[str, torch.device], device: torch.device) -> torch.device:
    """The device of parameter/buffer `name` under a device map (its longest matching module prefix)."""
    best, at = -1, device
    for prefix, dev in dmap.items():
        if (prefix == "" or name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
            best, at = len(prefix), dev
    return at


def dispatch_spilled(model, dmap: dict[str, torch.device], device: torch.device) -> None:
    """Attach accelerate's hooks so the host-resident units run on `device` (their weights copied in per forward)."""
    if not dmap or device.type == "cpu":
        return
    from accelerate import dispatch_model

    dispatch_model(
        model, device_map={k: ("cpu" if v.type == "cpu" else v) for k, v in dmap.items()}, main_device=device
    )


def load_model(
    path: Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    progress: ProgressFn | None = None,
    vram_bytes: int | None = None,
    context: int = 8192,
    fused: bool = True,
    offload_miss: str = "auto",
    on_notice=None,
    host_storage: str = "auto",
    store_key: tuple[str, str] | None = None,
    experts_format: str = "full",
) -> LoadedModel:
    """Build the model from the checkpoint at `path`. Offloaded experts' master copies go to pinned host memory, or
    with `host_storage` "mmap" (or "auto" when the RAM cannot hold them) to memory-mapped files
    (`localmoe.experts.store`,
    keyed by `store_key` = (model name, revision)) that later loads map without reading the checkpoint.
    `experts_format` "int4": each layer's routed experts are quantized on the device as they load."""
    from accelerate.utils import set_module_tensor_to_device

    if host_storage not in HOST_STORAGE:
        raise UsageError(f"host storage must be one of {', '.join(HOST_STORAGE)}, got {host_storage!r}")
    check_format(experts_format)
    _, text_config, fam = read_config(path)
    check_tokenizer(path)
    model = build_skeleton(text_config, dtype)
    experts = swap_experts(model, text_config)
    fp32_modules = _keep_fp32(model)
    budget = (
        plan_offload(model, text_config, experts, dtype, vram_bytes, context, on_notice, experts_format)
        if vram_bytes
        else None
    )
    host = budget is not None and budget.offloading
    dmap = place_non_experts(model, budget, device, dtype)
    pinned = [device.type == "cuda"]  # cleared when pinning fails
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    files = shard_files(path)
    if experts_format == "int4" and host and host_storage == "mmap":
        raise UsageError(
            "--host-storage mmap keeps full-precision experts; int4 master copies live in host memory: "
            "drop --host-storage mmap (or use --experts full)"
        )
    key = store_key or (str(path), "local")
    files_store = (
        None if experts_format == "int4" else _expert_files(host, host_storage, budget, key, files, dtype, on_notice)
    )
    if files_store is not None:
        pinned[0] = False

    # Where each checkpoint key lives, in the module namespace.
    plan: list[tuple[Path, str, str]] = []  # (file, checkpoint key, module name)
    for file in files:
        with _open(file) as f:
            for key in f.keys():
                name = fam.rename(key)
                if name is not None:
                    plan.append((file, key, name))
    expert_keys: dict[str, dict[str, tuple[Path, str]]] = {p: {} for p in experts}
    dense: list[tuple[Path, str, str]] = []
    for file, key, name in plan:
        prefix = next((p for p in experts if name.startswith(p + ".")), None)
        if prefix is not None:
            expert_keys[prefix][name[len(prefix) + 1 :]] = (file, key)
        elif name in params:
            dense.append((file, key, name))

    total = len(dense) + sum(m.num_experts for m in experts.values())
    done = 0
    handles: dict[Path, object] = {}

    def handle(file: Path):
        if file not in handles:
            handles[file] = _open(file).__enter__()
        return handles[file]

    try:
        loaded: set[str] = set()
        for file, key, name in dense:
            try:
                tensor = handle(file).get_tensor(key)
            except Exception as e:
                raise RuntimeFailure(
                    f"{for_line(file.name)}: cannot read {for_line(key)} ({for_line(e)}); the file is "
                    "corrupt or truncated"
                ) from None
            _check_dense(file, key, tensor, model.get_parameter(name))
            tdtype = torch.float32 if any(m in name for m in fp32_modules) and tensor.is_floating_point() else dtype
            set_module_tensor_to_device(
                model,
                name,
                device_of(name, dmap, device),
                value=tensor,
                dtype=tdtype if tensor.is_floating_point() else None,
            )
            loaded.add(name)
            done += 1
            if progress and done % 16 == 0:
                progress("load", done, total)
        for prefix, mod in experts.items():
            if files_store is not None:  # memory-mapped files: written once, then mapped as they are
                shape = (mod.num_experts, mod.intermediate_size, mod.hidden_size)
                into, ready = files_store.open(prefix, shape)
                if not ready:
                    _load_layer_experts(prefix, mod, expert_keys[prefix], handle, device, dtype, into=into)
                    files_store.done(prefix, shape)
                mod.weights = into
            elif experts_format == "int4":  # quantized on the device expert by expert as read (VRAM never holds
                # the layer in bf16), kept there or, offloaded, in host memory (pinned when possible)
                shape = (mod.num_experts, mod.intermediate_size, mod.hidden_size)
                into = ExpertWeights(*(_int4_storage(shape, dtype, device, host, pinned) for _ in range(3)))
                mod.weights = _load_layer_experts(prefix, mod, expert_keys[prefix], handle, device, dtype, into=into)
            else:
                mod.weights = _load_layer_experts(
                    prefix, mod, expert_keys[prefix], handle, device, dtype, host=host, pinned=pinned
                )
            done += mod.num_experts
            if progress:
                progress("load", done, total)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)

    missing = sorted(params - loaded)
    if missing and getattr(text_config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise RuntimeFailure(
            f"checkpoint lacks {len(missing)} tensors (first: {missing[0]}); re-download it with `localmoe pull`"
        )
    for name, buf in model.named_buffers():
        if buf.device != device_of(name, dmap, device):
            set_module_tensor_to_device(model, name, device_of(name, dmap, device), value=buf)
    model.eval()
    model.requires_grad_(False)
    if progress:
        progress("load", total, total)
    if fused and not dmap:  # spilled units' weights come and go with accelerate's hooks: transformers' modules
        install_fused(model, device)
    dispatch_spilled(model, dmap, device)
    loaded = LoadedModel(model=model, config=text_config, family=fam, experts=list(experts.values()), offload=budget)
    if host:
        attach_cache(loaded, dtype, device, pinned[0], offload_miss)
        loaded.host_storage = "mmap" if files_store is not None else "pinned" if pinned[0] else "pageable"
    return loaded


HOST_STORAGE = ("auto", "pinned", "mmap")


def check_format(experts_format: str) -> None:
    from localmoe.experts.int4 import EXPERT_FORMATS

    if experts_format not in EXPERT_FORMATS:
        raise UsageError(f"--experts must be one of {', '.join(EXPERT_FORMATS)}, got {experts_format!r}")


def _expert_files(host: bool, storage: str, budget, key: tuple[str, str], files: list[Path], dtype, on_notice):
    """The memory-mapped expert store when the master copies go to files ("mmap", or "auto" with too little RAM);
    None for host memory."""
    if not host or storage == "pinned":
        return None
    from localmoe.experts import store
    from localmoe.experts.placement import total_ram

    need = budget.total_experts * budget.expert_bytes
    if storage == "auto" and not store.needs_files(need, total_ram()):
        return None
    files_store = store.ExpertStore(key[0], key[1], files, dtype)
    if on_notice:
        on_notice(
            f"expert master copies ({need / (1 << 30):.1f} GiB) are memory-mapped files under "
            f"{files_store.dir} (host RAM {'is short' if storage == 'auto' else 'not used: --host-storage mmap'})"
            "; the first load writes them, misses are copied in (slower than pinned memory)"
        )
    return files_store


def install_fused(model, device: torch.device) -> None:
    """localmoe's fused decode modules (localmoe.decode.replacements: RMSNorm, Gated DeltaNet step, router + shared
    expert) replace
    transformers' on CUDA (default; `--no-fused` opts out); after loading, since loading puts new Parameter objects
    on them."""
    from localmoe.decode import replacements

    replacements.install(model, device)


def attach_cache(loaded: LoadedModel, dtype, device, pinned: bool, miss: str = "auto", gate_tier: bool = True) -> None:
    """Experts' weights are host master copies: put the GPU expert cache in front of them (replacing one attached
    before). Miss mode "auto": direct reads from pinned host memory on CUDA (the fastest measured), else
    copy-then-compute. Direct misses with `gate_tier` split the cache's bytes gates first
    (`placement.gate_tier_split`)."""
    from localmoe.experts import cache as offload
    from localmoe.experts import placement

    if miss == "auto":
        miss = "direct" if torch.device(device).type == "cuda" and pinned else "copy"
    m0 = loaded.experts[0]
    for m in loaded.experts:
        m.cache = None
    loaded.cache = None  # the old pools go before the new ones are allocated
    gates, slots = (
        placement.gate_tier_split(loaded.offload) if miss == "direct" and gate_tier else (0, loaded.offload.slots)
    )
    cache = offload.ExpertCache(
        slots,
        (m0.num_experts, m0.intermediate_size, m0.hidden_size),
        dtype,
        device,
        mode=miss,
        gate_slots=gates,
        int4=m0.weights.int4,
    )
    for m in loaded.experts:
        cache.add_layer(m.layer_idx, m.weights)
        m.cache = cache
    cache.place_gates()
    loaded.cache = cache
    loaded.host_pinned = pinned


def _load_layer_experts(
    prefix,
    mod: LocalExperts,
    keys: dict,
    handle,
    device,
    dtype,
    *,
    host: bool = False,
    pinned: list | None = None,
    into: ExpertWeights | None = None,
) -> ExpertWeights:
    E, I, H = mod.num_experts, mod.intermediate_size, mod.hidden_size
    shape = (E, I, H)
    if into is not None:  # given storage (the memory-mapped files)
        w = into
    elif host:  # offloaded: the master copies live in host memory, pinned when possible
        from localmoe.experts.placement import host_allocator

        alloc = host_allocator(pinned)
        w = ExpertWeights(*(alloc(shape, dtype) for _ in range(3)))
    else:
        w = ExpertWeights(*(torch.empty(shape, dtype=dtype, device=device) for _ in range(3)))

    def corrupt(file, key, e):
        return RuntimeFailure(
            f"{for_line(file.name)}: cannot read {for_line(key)} ({for_line(e)}); the file is corrupt or truncated"
        )

    def read(key_file, index=None):
        """The tensor (or its expert `index`), its dtype checked from the header first."""
        file, key = key_file
        try:
            sl = handle(file).get_slice(key)
            dt = sl.get_dtype()
        except Exception as e:
            raise corrupt(file, key, e) from None
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


def _int4_storage(shape, dtype, device, host: bool, pinned: list) -> Int4Tensor:
    """An empty int4 stack [E, I, H] on the device, or offloaded in host memory (pinned while pinning works)."""
    if not host:
        return Int4Tensor.empty(shape, dtype, device)
    from localmoe.experts.placement import host_allocator

    return Int4Tensor.empty(shape, dtype, "cpu", alloc=host_allocator(pinned))


# Weights localmoe converts to the run's dtype as it reads them; anything else (int8, fp8, packed 4-bit) is a
# quantized checkpoint whose values mean something only with its scales, which localmoe does not read.
FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
_QUANTIZED_HINT = (
    "localmoe loads float16/bfloat16/float32 checkpoints only (quantized ones are not supported; "
    "--experts int4 quantizes a bf16 checkpoint itself): use the model's bf16 checkpoint"
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
