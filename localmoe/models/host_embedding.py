"""Token embeddings in host memory (`--embeddings host`, the default on CUDA): the model's input `nn.Embedding`
replaced by `HostEmbedding`, whose table lives in pinned host memory and is read one row per token by the GPU in
place (kernels/embedding_gather.py, through unified addressing; inside the decode step's CUDA graph too). A large
vocabulary's table is read one row per token yet holds GBs of VRAM (gpt-oss-20b: 1.16 GB of its 13.75; Qwen3.5's
248320 x 2048: 1.0 GB): llama.cpp keeps it on the CPU by default; so does localmoe, and the VRAM plan
(models/offload.py) counts it as host bytes, so the GBs go to the expert cache.

Only an untied table moves: a table tied to lm_head (localmoe-tiny, DeaMoE) is also the LM head's weight, read
whole every token, so it stays where the LM head runs. Only a plain `nn.Embedding` (no max_norm) is replaced: a
family's own embedding class (a scaled one) is left as it is.

What this module owns: the module (`HostEmbedding`), the decision (`keep_reason`), the swap on the skeleton
(`install`, before any weight is read: the loader then streams the table to the host, `Placement.device_for`),
pinning it after the load (`pin`), its bytes (`host_bytes`), and `detached`, which hides it from accelerate while
accelerate maps and dispatches the other modules (so no hook copies it to the GPU per forward).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn import functional as F

from localmoe.kernels.embedding_gather import embedding_gather


class HostEmbedding(nn.Module):
    """An input embedding whose table `weight` [V, H] (a Parameter: transformers and localmoe read its dtype and
    shape) lives in host memory, pinned on a CUDA machine. forward(ids on CUDA, table on the host): the rows
    gathered by the GPU from host memory (`embedding_gather`, no host sync); ids where the table is (the CPU):
    F.embedding, as nn.Embedding."""

    def __init__(self, weight: nn.Parameter, padding_idx: int | None = None):
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx = padding_idx

    @classmethod
    def replacing(cls, emb: nn.Embedding) -> HostEmbedding:
        """The same table (the same Parameter object, meta or loaded) behind a HostEmbedding."""
        return cls(emb.weight, emb.padding_idx)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if input_ids.device.type == "cuda" and w.device.type == "cpu":
            rows = embedding_gather(input_ids.reshape(-1), w)  # [T, H] on the GPU
            return rows.view(*input_ids.shape, self.embedding_dim)
        return F.embedding(input_ids.to(w.device), w, self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, host memory{', pinned' if self.pinned else ''}"

    @property
    def pinned(self) -> bool:
        w = self.weight
        return w.device.type == "cpu" and w.numel() > 0 and w.is_pinned()


def tied(model, text_config) -> bool:
    """Whether the input embedding is (or, once loaded, will be) lm_head's weight too."""
    out = model.get_output_embeddings()
    emb = model.get_input_embeddings()
    if out is not None and emb is not None and getattr(out, "weight", None) is emb.weight:
        return True
    return bool(getattr(text_config, "tie_word_embeddings", False)) and out is not None


def keep_reason(model, text_config) -> str | None:
    """Why the input embedding cannot live in host memory (None: it can)."""
    emb = model.get_input_embeddings()
    if isinstance(emb, HostEmbedding):
        return None
    if tied(model, text_config):
        return "tied to lm_head (the LM head reads it whole every token)"
    if type(emb) is not nn.Embedding or emb.max_norm is not None:
        return f"{type(emb).__name__} is not a plain embedding table"
    return None


def install(model, text_config) -> str | None:
    """The input embedding replaced by a HostEmbedding holding the same Parameter (the skeleton's, on the meta
    device); returns its module name ("model.embed_tokens"), or None when `keep_reason` says it stays."""
    if keep_reason(model, text_config) is not None:
        return None
    emb = model.get_input_embeddings()
    name = next(n for n, m in model.named_modules() if m is emb)
    if not isinstance(emb, HostEmbedding):
        model.set_input_embeddings(HostEmbedding.replacing(emb))
    return name


def host_embedding(model) -> HostEmbedding | None:
    emb = model.get_input_embeddings()
    return emb if isinstance(emb, HostEmbedding) else None


def host_bytes(model, element_bytes: int | None = None) -> int:
    """Bytes of the host-resident embedding table (in `element_bytes` per weight when given: the plan's dtype);
    0 without one."""
    emb = host_embedding(model)
    if emb is None:
        return 0
    return emb.weight.numel() * (element_bytes or emb.weight.element_size())


def pin(model, device: torch.device) -> bool:
    """After loading, on CUDA: the host table moved into pinned memory (the GPU reads only pinned host memory).
    False when pinning failed: the table then goes to `device` (as `--embeddings gpu`; the caller says so)."""
    emb = host_embedding(model)
    if emb is None or device.type != "cuda" or emb.weight.device.type != "cpu" or emb.pinned:
        return True
    try:
        emb.weight.data = emb.weight.data.pin_memory()
        return True
    except RuntimeError:
        emb.weight.data = emb.weight.data.to(device)
        return False


class _Placeholder(nn.Module):
    """Stands in for a HostEmbedding while accelerate maps or dispatches the model: no parameters."""


@contextlib.contextmanager
def detached(model):
    """The HostEmbedding out of the model for the block (a parameter-free placeholder in its slot): accelerate's
    device map does not spend the GPU's share on it and its dispatch attaches no hook that would copy it to the
    GPU per forward. Put back on the way out."""
    emb = host_embedding(model)
    if emb is None:
        yield
        return
    model.set_input_embeddings(_Placeholder())
    try:
        yield
    finally:
        model.set_input_embeddings(emb)
