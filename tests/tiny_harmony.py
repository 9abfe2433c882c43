"""A tiny model that speaks OpenAI's harmony format (gpt-oss's chat format), for tests/test_harmony.py.

`harmony_tokenizer()`: the character-level tokenizer of tests/tiny_models.py with harmony's markers as SPECIAL tokens
(as o200k_harmony has them: `<|start|>`, `<|end|>`, `<|message|>`, `<|channel|>`, `<|constrain|>`, `<|return|>`,
`<|call|>`, `<|endoftext|>`), the words `assistant`, `analysis`, `final` and `commentary` as single tokens, and
HARMONY_TEMPLATE, gpt-oss's chat template cut down to what a chat without tools renders (system and developer
messages, `reasoning_effort`, past assistant turns as their final answer only, the generation prompt
`<|start|>assistant`).

`save_harmony_checkpoint(folder)`: a tiny Qwen3-MoE (tiny_models.build) whose greedy reply to any conversation
without a "?" is HARMONY_REPLY, an analysis message then a final one. A next-token table alone cannot write it
(`<|channel|>` is followed by `analysis` once and by `final` later), so the model keeps one bit of context, "the
reply has written its `?`", in its first attention layer: every query points one way, only the `?` token has a key
there, so once a `?` is in the context every position attends to it and adds a fixed vector (the phase) to the
residual; lm_head reads the current token's embedding (the script: successor logit 40; `final` -20 after
`<|message|>`, `O` -20 after `<|channel|>`) and the phase (+30 for `final` and `O`, -30 for `analysis` and `W`).
Everything else is zeroed as in tiny_models.scripted_qwen3_moe.
generation_config.json carries gpt-oss's eos ids but `<|call|>` (the engine adds harmony's stops itself), greedy.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import tiny_models

HARMONY_REPO = f"{tiny_models.ORG}/tiny-harmony"
SPECIALS = [
    "<unk>",
    "<|endoftext|>",
    "<|startoftext|>",
    "<|return|>",  # id 3: the tiny configs' eos_token_id, as <|return|> is gpt-oss's config.json eos
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|call|>",
]
WORDS = ["assistant", "analysis", "final", "commentary"]
EOS = ["<|return|>", "<|endoftext|>"]  # gpt-oss's generation_config also lists <|call|>: left out, the engine adds it

# gpt-oss's chat template (openai/gpt-oss-20b chat_template.jinja) without tools and builtin tools
HARMONY_TEMPLATE = r"""{%- if model_identity is not defined -%}
{%- set model_identity = "You are ChatGPT, a large language model trained by OpenAI." -%}
{%- endif -%}
{%- if reasoning_effort is not defined -%}{%- set reasoning_effort = "medium" -%}{%- endif -%}
{{- "<|start|>system<|message|>" + model_identity + "\nKnowledge cutoff: 2024-06\n" -}}
{{- "Current date: " + strftime_now("%Y-%m-%d") + "\n\nReasoning: " + reasoning_effort + "\n\n" -}}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>" -}}
{%- if messages[0].role == "developer" or messages[0].role == "system" -%}
{%- set developer_message = messages[0].content -%}{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set developer_message = "" -%}{%- set loop_messages = messages -%}
{%- endif -%}
{%- if developer_message -%}
{{- "<|start|>developer<|message|># Instructions\n\n" + developer_message + "\n\n<|end|>" -}}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if message.role == "assistant" -%}
{%- if "<|channel|>analysis<|message|>" in message.content or "<|channel|>final<|message|>" in message.content -%}
{{- raise_exception("You have passed a message containing <|channel|> tags in the content field.") -}}
{%- endif -%}
{%- if loop.last and not add_generation_prompt -%}
{%- if "thinking" in message -%}
{{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" -}}
{%- endif -%}
{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" -}}
{%- else -%}
{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" -}}
{%- endif -%}
{%- elif message.role == "user" -%}
{{- "<|start|>user<|message|>" + message.content + "<|end|>" -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""

HARMONY_REASONING, HARMONY_ANSWER = "Why?", "OK"
HARMONY_REPLY = "<|channel|>analysis<|message|>Why?<|end|><|start|>assistant<|channel|>final<|message|>OK<|return|>"
PHASE = "?"  # the token that switches the phase on (in the analysis only: never in the tests' prompts)
# each token's successor without the phase; with it, <|channel|> -> final and <|message|> -> O
SCRIPT = [
    ("assistant", "<|channel|>"),
    ("<|channel|>", "analysis"),
    ("analysis", "<|message|>"),
    ("<|message|>", "W"),
    ("W", "h"),
    ("h", "y"),
    ("y", "?"),
    ("?", "<|end|>"),
    ("<|end|>", "<|start|>"),
    ("<|start|>", "assistant"),
    ("final", "<|message|>"),
    ("O", "K"),
    ("K", "<|return|>"),
]
PHASE_RAISES, PHASE_LOWERS = ("final", "O"), ("analysis", "W")
SCRIPT_LOGIT, PHASE_LOGIT = 40.0, 30.0


def harmony_tokenizer(template: str = HARMONY_TEMPLATE):
    """The character-level tokenizer with harmony's markers as special tokens, WORDS as tokens, `template`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    fill = tiny_models.VOCAB - len(SPECIALS) - len(WORDS) - len(chars)
    chars += [chr(0x3B1 + i) for i in range(fill)]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS + chars)}
    assert len(vocab) == tiny_models.VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in WORDS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|return|>", bos_token=None, pad_token="<|endoftext|>"
    )
    fast.chat_template = template
    return fast


def scripted_harmony_model(tok):
    """The tiny Qwen3-MoE described in the module docstring -> (model, save_pretrained keywords)."""
    import torch

    model, kwargs = tiny_models.build("qwen3_moe")
    cfg = model.config
    H, D = cfg.hidden_size, cfg.head_dim
    ids = {t: tok.convert_tokens_to_ids(t) for pair in SCRIPT for t in pair}
    script_ids = sorted(ids.values())
    basis, _ = torch.linalg.qr(torch.randn(H, H, generator=torch.Generator().manual_seed(7)))
    common, phase = basis[:, H - 1], basis[:, H - 2]  # unused by any token: queries' direction; the phase's
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        script = torch.stack([basis[:, i] for i in range(len(script_ids))])  # [n, H] rows: the script's tokens
        # every other token: orthogonal to the script's tokens and the two directions, then all get `common`
        others = emb - (emb @ basis[:, : len(script_ids)]) @ basis[:, : len(script_ids)].T
        others = others - torch.outer(others @ common, common) - torch.outer(others @ phase, phase)
        emb.copy_(others)
        for i, t in enumerate(script_ids):
            emb[t] = script[i] * H**0.5
        emb += common
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.experts.down_proj.zero_()
            layer.input_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        # layer 0 attends to the phase token from anywhere after it (its key alone lies along every query)
        attn = model.model.layers[0].self_attn
        key = script[script_ids.index(ids[PHASE])]  # the phase token's (unit) direction
        lo = D // 2 - 1  # the lowest rope frequency: scores barely turn with distance
        for w in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight):
            w.zero_()
        for h in range(cfg.num_attention_heads):
            attn.q_proj.weight[h * D + lo] = common
        for h in range(cfg.num_key_value_heads):
            attn.k_proj.weight[h * D + lo] = key * 1e3
            attn.k_proj.weight[h * D] = common  # every other key is normalised along a dimension no query has
            attn.v_proj.weight[h * D] = key
        attn.q_norm.weight.fill_(3.0)
        attn.k_norm.weight.fill_(3.0)
        x = emb[ids[PHASE]]
        value = float(key @ (x / x.pow(2).mean().sqrt()))  # v of the phase token, dim 0 of each kv head
        attn.o_proj.weight[:, 0] = phase / value  # head 0's dim 0 -> the phase direction, size 1
        head = model.lm_head.weight
        head.zero_()
        for a, b in SCRIPT:  # the predecessor's direction (without `common`): logit SCRIPT_LOGIT after the norm
            head[ids[b]] += SCRIPT_LOGIT * script[script_ids.index(ids[a])] / H**0.5
        for t in PHASE_RAISES:
            head[ids[t]] += PHASE_LOGIT * phase
        for t, at in zip(PHASE_RAISES, ("<|message|>", "<|channel|>")):  # each raised token only where it is due
            head[ids[t]] -= (SCRIPT_LOGIT / 2) * script[script_ids.index(ids[at])] / H**0.5
        for t in PHASE_LOWERS:
            head[ids[t]] -= PHASE_LOGIT * phase
    return model, kwargs


def save_harmony_checkpoint(folder: Path) -> Path:
    """The scripted harmony model, its tokenizer and a generation_config (EOS, greedy) in `folder`."""
    tok = harmony_tokenizer()
    model, kwargs = scripted_harmony_model(tok)
    model.save_pretrained(folder, **kwargs)
    tok.save_pretrained(folder)
    eos = [tok.convert_tokens_to_ids(t) for t in EOS]
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "bos_token_id": 2, "pad_token_id": 1})
    )
    return folder
