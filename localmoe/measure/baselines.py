"""The baselines `localmoe bench --baseline` measures in the same run: stock transformers `generate` with its grouped
experts (`transformers_baseline`), and stock transformers with accelerate placing what does not fit in VRAM on the
CPU (`accelerate_baseline`); both with the random weights `models.random_weights` gives localmoe's engine. Owns
`BenchRow`, the row type of every engine configuration the bench prints.

May import models/ and the leaf modules.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch
from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from transformers import AutoModelForCausalLM

from localmoe.models.random_weights import param_owners, random_value


@dataclass
class BenchRow:  # one engine configuration's figures
    name: str
    sparsity: float
    prefill_tok_s: float
    decode_tok_s: float
    peak_gpu_mem_gb: float
    floor_tok_s: float  # bytes a decode step must read / measured copy bandwidth
    fraction_of_floor: float
    sparsity_realized: float = 0.0
    graph: bool = False
    cache_hit_rate: float | None = None
    h2d_mb_per_token: float | None = None
    repetition_penalty: float = 1.0
    step_mb: float = 0.0  # MB one decode step must read (step_bytes)
    department_hit_rate: float | None = None  # an offloaded DeaMoE's two pools
    private_hit_rate: float | None = None


def transformers_baseline(config, device, dtype, prompt, n_decode: int, impl: str) -> BenchRow:
    """Stock transformers' `generate` with `config`, random weights on `device`, its experts implementation `impl`
    (e.g. "grouped_mm"): prefill and decode tok/s of the same prompt, the same way localmoe's rows measure them."""
    config._experts_implementation = impl
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    owners = param_owners(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(random_value(name, p.shape, owners[name], dtype=dtype, device=device, gen=gen))
        for mod in model.modules():  # non-persistent buffers (rotary inv_freq) were left empty by to_empty
            if hasattr(mod, "inv_freq") and hasattr(mod, "rope_init_fn"):
                inv, _ = mod.rope_init_fn(mod.config, device)
                mod.inv_freq.copy_(inv)
    model.eval()
    ids = torch.tensor([prompt], device=device)
    kw = dict(do_sample=False, min_new_tokens=n_decode, max_new_tokens=n_decode, attention_mask=torch.ones_like(ids))
    model.generate(
        ids[:, :16], **{**kw, "min_new_tokens": 4, "max_new_tokens": 4, "attention_mask": torch.ones_like(ids[:, :16])}
    )
    model(input_ids=ids)  # warm-up at the measured prompt length, as localmoe's rows
    torch.cuda.synchronize() if device.type == "cuda" else None
    t0 = time.perf_counter()
    model(input_ids=ids)
    torch.cuda.synchronize() if device.type == "cuda" else None
    t1 = time.perf_counter()
    model.generate(ids, **kw)
    torch.cuda.synchronize() if device.type == "cuda" else None
    t2 = time.perf_counter()
    prefill = len(prompt) / (t1 - t0)
    decode = n_decode / max((t2 - t1) - (t1 - t0), 1e-9)
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0
    del model
    gc.collect()
    return BenchRow(
        name=f"transformers generate ({impl})",
        sparsity=0.0,
        prefill_tok_s=prefill,
        decode_tok_s=decode,
        peak_gpu_mem_gb=peak,
        floor_tok_s=0.0,
        fraction_of_floor=0.0,
    )


def accelerate_baseline(config, device, dtype, prompt, n_decode: int, vram_gib: float) -> BenchRow:
    """Stock transformers with accelerate placing what does not fit in `vram_gib` on the CPU (device_map with
    max_memory): its hooks copy offloaded weights to the GPU on every forward."""
    config._experts_implementation = "grouped_mm"
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gpu = device.index or 0 if device.type == "cuda" else "cpu"
    max_memory = {gpu: f"{vram_gib}GiB", "cpu": "1000GiB"} if device.type == "cuda" else {"cpu": "1000GiB"}
    device_map = infer_auto_device_map(
        model, max_memory=max_memory, no_split_module_classes=model._no_split_modules, dtype=dtype
    )
    gen = torch.Generator(device=device).manual_seed(0)  # drawn on the device (fast), then moved where it goes
    owners = param_owners(model)
    for name, p in list(model.named_parameters()):
        where = next(
            (
                d
                for prefix, d in sorted(device_map.items(), key=lambda kv: -len(kv[0]))
                if name == prefix or name.startswith(prefix + ".") or prefix == ""
            ),
            "cpu",
        )
        t = random_value(name, p.shape, owners[name], dtype=dtype, device=device, gen=gen)
        set_module_tensor_to_device(model, name, "cpu" if where == "cpu" else device, value=t)
    model = dispatch_model(model, device_map=device_map)
    model.eval()
    ids = torch.tensor([prompt[:32]], device=device)
    kw = dict(do_sample=False, min_new_tokens=n_decode, max_new_tokens=n_decode, attention_mask=torch.ones_like(ids))
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, **kw)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    on_cpu = sum(1 for d in device_map.values() if d == "cpu")
    del model
    gc.collect()
    return BenchRow(
        name=f"accelerate offload ({on_cpu} modules on CPU)",
        sparsity=0.0,
        prefill_tok_s=0.0,
        decode_tok_s=n_decode / dt,
        peak_gpu_mem_gb=torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0,
        floor_tok_s=0.0,
        fraction_of_floor=0.0,
    )
