"""Checkpoint loading, as named steps (each in the module that owns it):

LoadOptions.check          the host storage and experts format asked for
checkpoint.read_config     `AutoConfig` (no remote code) → the family table decides whether it is supported
checkpoint.check_native    a family of localmoe's own (DeaMoE): its tensors checked against its config (headers
                           only), its unsupported options (int4 experts) refused
skeleton.build             the transformers model on the meta device (buffers real), each MoE block's `experts`
                           replaced by a parameter-free `LocalExperts` (families.FAMILIES; DeaMoE's
                           DepartmentExperts kept)
offload.plan_placement     the token embeddings' place (pinned host memory on CUDA unless tied: host_embedding.py),
                           the VRAM plan for the budget, the non-expert units that spill to host memory
offload.expert_store       where offloaded experts' master copies live (host memory or memory-mapped files)
weights.load_weights       every tensor streamed from the safetensors shards to where it lives, experts expert by
                           expert into localmoe's store (host memory never holds two copies of the weights)
install_decode             the host embedding table pinned, localmoe's decode modules (decode/replacements.py),
                           accelerate's hooks for spilled units
loaded.attach_cache        the GPU expert cache in front of offloaded experts' host copies
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from localmoe.decode import replacements, sinks
from localmoe.errors import UsageError
from localmoe.events import ProgressFn
from localmoe.experts.int4 import EXPERT_FORMATS
from localmoe.models import bnb, gpt_oss_weights, host_embedding
from localmoe.models.checkpoint import check_native, check_tokenizer, read_config, shard_files
from localmoe.models.loaded import LoadedModel, attach_cache
from localmoe.models.offload import EMBEDDINGS, HOST_STORAGE, dispatch_spilled, expert_store, plan_placement
from localmoe.models.skeleton import build
from localmoe.models.weights import load_weights


@dataclass(frozen=True)
class LoadOptions:
    """How to load: `vram_bytes` the VRAM budget (None: everything on the device, no plan); `context` the tokens the
    plan keeps room for; `fused` localmoe's decode modules (CUDA); `offload_miss` the expert cache's miss mode
    ("auto", "direct", "copy", "cpu"); `host_storage` where offloaded experts' master copies live ("auto", "pinned",
    "mmap": memory-mapped files keyed by `store_key` = (model name, revision)); `experts_format` "full", "int4" or
    "nf4" (each layer's routed experts quantized on the device as they load), or "mxfp4" (a gpt-oss checkpoint's
    own, read in place; "full" means it too for such a checkpoint); `embeddings` where the input embedding table
    lives ("auto": pinned host memory on CUDA, as "host" does on any device, unless tied to lm_head; "gpu": with
    the other non-expert weights)."""

    vram_bytes: int | None = None
    context: int = 8192
    fused: bool = True
    offload_miss: str = "auto"
    host_storage: str = "auto"
    store_key: tuple[str, str] | None = None
    experts_format: str = "full"
    embeddings: str = "auto"

    def check(self) -> None:
        if self.host_storage not in HOST_STORAGE:
            raise UsageError(f"host storage must be one of {', '.join(HOST_STORAGE)}, got {self.host_storage!r}")
        if self.embeddings not in EMBEDDINGS:
            raise UsageError(f"--embeddings must be one of gpu, host, got {self.embeddings!r}")
        check_format(self.experts_format)


def check_format(experts_format: str) -> None:
    if experts_format not in EXPERT_FORMATS:
        raise UsageError(f"--experts must be one of {', '.join(EXPERT_FORMATS)}, got {experts_format!r}")
    if experts_format == "nf4":
        bnb.require()


def format_for(config, experts_format: str) -> str:
    """The experts format a checkpoint of `config` loads with when `experts_format` is asked for: an MXFP4
    checkpoint's own (gpt-oss: "full", the default, and "mxfp4" read it in place; int4 and nf4 refused), else the
    one asked for ("mxfp4" refused: localmoe reads MXFP4 experts, it does not make them)."""
    if gpt_oss_weights.checkpoint_format(config):
        return gpt_oss_weights.check_experts_format(experts_format)
    if experts_format == "mxfp4":
        raise UsageError(
            "--experts mxfp4 reads a checkpoint's own MXFP4 experts (gpt-oss); this checkpoint's are not MXFP4: "
            "use --experts int4 or nf4 to quantize them"
        )
    return experts_format


def load_model(
    path: Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    options: LoadOptions | None = None,
    progress: ProgressFn | None = None,
    on_notice=None,
) -> LoadedModel:
    """Build the model from the checkpoint at `path` (`options`: LoadOptions, its defaults when None). Offloaded
    experts' master copies go to pinned host memory, or with `host_storage` "mmap" (or "auto" when the RAM cannot
    hold them) to memory-mapped files (`localmoe.experts.store`) that later loads map without reading the
    checkpoint."""
    options = options or LoadOptions()
    options.check()
    config, text_config, fam = read_config(path)
    if bnb.checkpoint_format(config):  # a bnb-4bit checkpoint: its experts load as they are, NF4
        options = replace(options, experts_format=bnb.check_experts_format(options.experts_format))
        bnb.require()
    options = replace(options, experts_format=format_for(config, options.experts_format))
    check_tokenizer(path)
    if fam.no_int4 and options.experts_format != "full":
        raise UsageError(fam.no_int4)
    check_native(path, fam)
    model, experts = build(text_config, dtype)
    placed = plan_placement(model, text_config, experts, device, dtype, options, on_notice)
    files = shard_files(path)
    files_store = expert_store(placed, options, path, files, dtype, on_notice)
    load_weights(
        model,
        text_config,
        fam,
        experts,
        files,
        placed,
        files_store,
        device=device,
        dtype=dtype,
        experts_format=options.experts_format,
        progress=progress,
    )
    install_decode(model, placed.dmap, device, options.fused, on_notice)
    loaded = LoadedModel(
        model=model, config=text_config, family=fam, experts=list(experts.values()), offload=placed.budget
    )
    if placed.host:
        attach_cache(loaded, dtype, device, placed.memory.pinned, options.offload_miss)
        loaded.host_storage = "mmap" if files_store is not None else "pinned" if placed.memory.pinned else "pageable"
    return loaded


def install_decode(model, dmap: dict[str, torch.device], device: torch.device, fused: bool, on_notice=None) -> None:
    """The loaded model made ready to run: in eval mode without gradients; a host-resident embedding table pinned
    (on the GPU instead, with a notice, when pinning fails); localmoe's fused decode modules
    (decode/replacements.py: RMSNorm, Gated DeltaNet step, router + shared expert) replace transformers' on CUDA
    (default; `--no-fused` opts out) after loading, since loading puts new Parameter objects on them, unless units
    spill (their weights come and go with accelerate's hooks: transformers' modules); then the spilled units' hooks.
    Attention with learned sinks (GPT-OSS) runs through SDPA on every device (decode/sinks.py: no score matrix)."""
    model.eval()
    model.requires_grad_(False)
    sinks.install(model)
    if not host_embedding.pin(model, device) and on_notice:
        on_notice("pinned host memory is short: the token embeddings went to VRAM after all (--embeddings gpu)")
    if fused and not dmap:
        replacements.install(model, device)
    dispatch_spilled(model, dmap, device)
