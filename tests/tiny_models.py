"""Tiny random-weight MoE checkpoints of every family, saved the way real checkpoints are stored.

Each family's tiny model is described in its module (localmoe/models/families/<family>.py: `SPEC.tiny`); this
module adds the sizes they all share and the tokenizers. Each model is built from its transformers config, saved
with `save_pretrained` (Qwen3.5 as the hub's multimodal checkpoint with fused experts: `save_original_format=False`;
the others in their original per-expert or Granite/Mixtral layouts; GPT-OSS then rewritten as the hub stores
gpt-oss: MXFP4 expert blocks and scales, bf16 expert biases, config.json's `quantization_config`), given a character-level tokenizer with a ChatML
chat template, and placed in a real Hugging Face cache layout (blobs + snapshots + refs) under `org/name` so it loads
with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
from pathlib import Path

from localmoe.models.families import FAMILIES, FamilySpec

ORG = "localmoe-test"
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = 128

# The families the tests build a tiny checkpoint of, by key (`qwen3_moe`), in the table's order: every family with a
# tiny model, and those localmoe runs.
BUILT = [s.key for s in FAMILIES.values() if s.tiny is not None]
SUPPORTED = [s.key for s in FAMILIES.values() if s.tiny is not None and not s.unsupported]


def char_tokenizer():
    """A character-level fast tokenizer: specials, then printable ASCII and newline (100 ids)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    chars += [chr(0x3B1 + i) for i in range(VOCAB - len(SPECIALS) - len(chars))]  # Greek letters fill the vocab
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", bos_token=None, pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _common(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        eos_token_id=3,
        bos_token_id=1,
        pad_token_id=1,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return base


# Every family in the table runs; tests of the refusal of an unsupported family mark one so (`mark_unsupported`).
UNSUPPORTED_REASON = "GPT-OSS is not yet supported: marked so by the test"


def mark_unsupported(monkeypatch, family: str = "gpt_oss", reason: str = UNSUPPORTED_REASON) -> str:
    """Make `family` unsupported for one test (its FAMILIES row replaced, as a family module with `unsupported`
    set would have it) -> the reason every refusal gives."""
    import dataclasses

    block = spec(family).block_class
    monkeypatch.setitem(FAMILIES, block, dataclasses.replace(FAMILIES[block], unsupported=reason))
    return reason


def spec(family: str) -> FamilySpec:
    """The FamilySpec of a family key (`qwen3_moe`)."""
    return next(s for s in FAMILIES.values() if s.key == family)


def build(family: str):
    """(model, save kwargs) for a family key: the family module's tiny model (`FamilySpec.tiny`) with the sizes all
    share (`_common`), or `qwen3_dense`, a dense Qwen3 (not an MoE: every command must refuse it)."""
    import torch
    import transformers as tf

    torch.manual_seed(1234)
    if family == "qwen3_dense":
        cfg = tf.Qwen3Config(**_common(head_dim=8, intermediate_size=48))
        return tf.AutoModelForCausalLM.from_config(cfg), {}
    tiny = spec(family).tiny
    if tiny is None:
        raise ValueError(family)
    if "text_config" in tiny.config:  # a multimodal checkpoint: the shared sizes are its text model's
        kwargs = {**tiny.config, "text_config": _common(**tiny.config["text_config"])}
    else:
        kwargs = _common(**tiny.config)
    cfg = tf.AutoConfig.for_model(family, **kwargs)
    model = getattr(tf, tiny.model_class)(cfg) if tiny.model_class else tf.AutoModelForCausalLM.from_config(cfg)
    return model, dict(tiny.save)


def save_checkpoint(family: str, folder: Path, *, max_shard_size: str | None = None) -> Path:
    model, kwargs = build(family)
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(folder, **kwargs)
    if family == "gpt_oss":
        mxfp4_folder(folder)
    char_tokenizer().save_pretrained(folder)
    gen = {"eos_token_id": 3, "bos_token_id": 1, "pad_token_id": 1}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return folder


# openai/gpt-oss-20b's config.json: the modules its MXFP4 quantization leaves in bf16
GPT_OSS_QUANTIZATION = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}


def mxfp4_folder(folder: Path) -> Path:
    """A GPT-OSS checkpoint saved by transformers (experts `gate_up_proj` [E, H, 2I], gate and up columns interleaved,
    and `down_proj` [E, I, H]) rewritten in place as the hub stores gpt-oss: each projection quantized to MXFP4
    (kernels/mxfp4.py `quantize_mxfp4`) and stored as `*_blocks` / `*_scales` uint8 in the hub's layout, the expert
    biases in bf16, config.json's `quantization_config` that of openai/gpt-oss-20b."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from localmoe.kernels.mxfp4 import down_t_to_hub, gate_up_to_hub, quantize_mxfp4

    for shard in sorted(folder.glob("*.safetensors")):
        out = {}
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                if key.endswith("mlp.experts.gate_up_proj"):
                    rows = t.transpose(1, 2)  # [E, 2I, H]: gate rows at even indices, up at odd
                    gate, up = (quantize_mxfp4(rows[:, i::2].contiguous()) for i in (0, 1))
                    out[key + "_blocks"], out[key + "_scales"] = gate_up_to_hub(gate, up)
                elif key.endswith("mlp.experts.down_proj"):  # [E, I, H]: the transposed down, blocks along I
                    out[key + "_blocks"], out[key + "_scales"] = down_t_to_hub(quantize_mxfp4(t, along_rows=False))
                elif ".experts." in key and key.endswith("_bias"):
                    out[key] = t.to(torch.bfloat16)
                else:
                    out[key] = t
        save_file(out, str(shard), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        wm = data["weight_map"]
        for shard in sorted(folder.glob("*.safetensors")):
            with safe_open(str(shard), "pt") as f:
                wm.update({k: shard.name for k in f.keys()})
        for key in [k for k in wm if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            del wm[key]
        index.write_text(json.dumps(data))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = GPT_OSS_QUANTIZATION
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def place_in_hf_cache(src: Path, hub_cache: Path, repo_id: str) -> Path:
    """Copy a checkpoint folder into `hub_cache` the way huggingface_hub stores downloads."""
    repo_dir = hub_cache / f"models--{repo_id.replace('/', '--')}"
    digest = hashlib.sha1()
    for f in sorted(src.iterdir()):
        digest.update(f.name.encode())
        digest.update(f.read_bytes())
    commit = digest.hexdigest()
    snap = repo_dir / "snapshots" / commit
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            shutil.copyfile(f, blob)
        link = snap / f.name
        if link.exists() or link.is_symlink():
            link.unlink()
        os.symlink(os.path.relpath(blob, snap), link)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return snap


def repeating_tokenizer(token_text: str):
    """The character-level tokenizer with id 0 decoding to `token_text` (never produced by encoding: the
    pre-tokenizer splits single characters); `<unk>` moves to the last id, the other specials keep theirs."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    chars += [chr(0x3B1 + i) for i in range(VOCAB - len(SPECIALS) - len(chars))]
    vocab = {tok: i for i, tok in enumerate([token_text] + SPECIALS[1:] + chars[:-1] + [SPECIALS[0]])}
    assert len(vocab) == VOCAB and vocab[token_text] == 0
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", bos_token=None, pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_repeating_checkpoint(folder: Path, token_text: str) -> Path:
    """A tiny Qwen3-MoE checkpoint whose greedy reply is `token_text` over and over: its lm_head is zero, so every
    logit is 0 and greedy decoding (argmax: the first of equal values) picks id 0, which decodes to `token_text`,
    at every step until --max-new-tokens or the context ends it. For output-safety tests (a `token_text` carrying
    terminal control sequences) and signal tests (a long `token_text` fills a pipe within a few tokens)."""
    import torch

    model, kwargs = build("qwen3_moe")
    with torch.no_grad():
        model.lm_head.weight.zero_()
    model.save_pretrained(folder, **kwargs)
    repeating_tokenizer(token_text).save_pretrained(folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 3, "bos_token_id": 1, "pad_token_id": 1})
    )
    return folder


# -- a thinking model: Qwen3's chat template shape, <think>/</think> as tokens, a scripted reply -----------------------
THINK_REPO = f"{ORG}/tiny-think"
# Qwen3's template, cut down: `enable_thinking` false closes an empty block in the generation prompt; a past
# assistant turn after the last user message is rendered with its reasoning (`reasoning_content`, or a <think> block
# in its content), earlier ones without.
THINK_TEMPLATE = r"""{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m['role'] == 'assistant' -%}
{%- set content = m['content'] -%}
{%- set reasoning = '' -%}
{%- if m['reasoning_content'] is defined and m['reasoning_content'] is string -%}
{%- set reasoning = m['reasoning_content'] -%}
{%- elif '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
{%- set content = content.split('</think>')[-1].lstrip('\n') -%}
{%- endif -%}
{%- if loop.index0 > ns.last_user and reasoning -%}
{{ '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') + '<|im_end|>\n' }}
{%- else -%}
{{ '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}
{%- endif -%}
{%- else -%}
{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\n\n</think>\n\n' }}{%- endif -%}
{%- endif -%}"""
THINK_TOKENS = ["<think>", "</think>", "\n\n"]  # in the vocabulary's last three ids, matched before characters
# The scripted reply: each token's successor. With thinking on the prompt ends in "\n" (the generation header):
# "<think>Why?</think>\n\nOK" then EOS; with thinking off it ends in "\n\n" (the closed empty block): "OK" then EOS.
# A template that opens the block in the prompt (ending in "<think>") gets "Why?</think>\n\nOK".
THINK_SCRIPT = [
    ("\n", "<think>"),
    ("<think>", "W"),
    ("W", "h"),
    ("h", "y"),
    ("y", "?"),
    ("?", "</think>"),
    ("</think>", "\n\n"),
    ("\n\n", "O"),
    ("O", "K"),
    ("K", "<|im_end|>"),
]
THINK_REASONING, THINK_ANSWER = "Why?", "OK"


def added_tokens_tokenizer(added: list[str], template: str):
    """A character-level tokenizer with `added` as tokens (not special: they decode to their text, as Qwen3's
    <think> and <tool_call> do) and the chat `template`; VOCAB entries in all."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    chars += [chr(0x3B1 + i) for i in range(VOCAB - len(SPECIALS) - len(chars) - len(added))]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars + added)}
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", bos_token=None, pad_token="<|endoftext|>"
    )
    fast.chat_template = template
    return fast


def think_tokenizer():
    """The character-level tokenizer with <think>, </think> and "\\n\\n" as tokens and THINK_TEMPLATE."""
    return added_tokens_tokenizer(THINK_TOKENS, THINK_TEMPLATE)


def scripted_qwen3_moe(tok, script):
    """A tiny Qwen3-MoE whose reply follows `script` (pairs: token, its successor) under the tokenizer `tok`: every
    attention output and expert is zero, so the last hidden state is the current token's embedding; the script's
    tokens get orthonormal embeddings and lm_head row `next` is 20x the (normalised) embedding of its predecessor, so
    the successor's logit is 20 and every other 0 (a token with several predecessors follows each): greedy and
    sampled replies alike follow the script. -> (model, save_pretrained keywords)."""
    import torch

    model, kwargs = build("qwen3_moe")
    ids = {t: tok.convert_tokens_to_ids(t) for pair in script for t in pair}
    H = model.config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.experts.down_proj.zero_()
        basis, _ = torch.linalg.qr(torch.randn(H, H, generator=torch.Generator().manual_seed(7)))
        emb = model.model.embed_tokens.weight
        for i, t in enumerate(sorted(ids.values())):
            emb[t] = basis[i] * H**0.5  # rms 1: the final RMSNorm leaves it as it is
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        for a, b in script:
            model.lm_head.weight[ids[b]] += 20.0 * emb[ids[a]] / H
    return model, kwargs


def save_think_checkpoint(folder: Path) -> Path:
    """A tiny Qwen3-MoE whose reply follows THINK_SCRIPT (`scripted_qwen3_moe`). generation_config.json is Qwen3's
    (sampling, temperature 0.6, top-k 20, top-p 0.95)."""
    tok = think_tokenizer()
    model, kwargs = scripted_qwen3_moe(tok, THINK_SCRIPT)
    model.save_pretrained(folder, **kwargs)
    tok.save_pretrained(folder)
    (folder / "generation_config.json").write_text(
        json.dumps(
            {
                "do_sample": True,
                "temperature": 0.6,
                "top_k": 20,
                "top_p": 0.95,
                "eos_token_id": 3,
                "bos_token_id": 1,
                "pad_token_id": 1,
            }
        )
    )
    return folder
