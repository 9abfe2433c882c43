"""Install a trained ``localmoe-tiny`` checkpoint into the package and write its model card.

Takes the directory written by ``train/train_model.py --out`` (config.json, model
safetensors - one file or shards -, generation_config.json, train_summary.json, optionally
tokenizer files; otherwise ``--tokenizer``), writes the shipped files to
``localmoe/assets/localmoe-tiny/`` (a single bf16 ``model.safetensors``), then verifies the copy on CPU, offline
and in float32: it loads with ``AutoTokenizer``/``AutoModelForCausalLM``, measures held-out
perplexity on ``localmoe/data/heldout.txt`` (non-overlapping 512-token windows, per token of
the model's tokenizer) and greedily answers a few chat prompts. Results go into the model
card ``README.md``.

Usage::

    python train/export.py --src <dir from train_model.py> [--dst localmoe/assets/localmoe-tiny]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import sys  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import localmoe.models.deamoe  # noqa: E402,F401  (registers model_type "deamoe" with the Auto classes)

SHIP = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
PROMPTS = [
    "What is a list comprehension?",
    "What does os.path.join() do?",
    "Explain the json module.",
    "What is a generator?",
    "Hello",
    "How do I create a table in PostgreSQL?",
]


@torch.no_grad()
def heldout_nll(model, tok, text: str, seq: int = 512) -> tuple[float, int]:
    ids = torch.tensor(tok(text)["input_ids"])
    total, count = 0.0, 0
    for s in range(0, ids.numel() - 1, seq):
        x = ids[s : s + seq + 1][None]
        if x.size(1) < 2:
            break
        logits = model(input_ids=x[:, :-1]).logits
        total += F.cross_entropy(logits[0].float(), x[0, 1:], reduction="sum").item()
        count += x.size(1) - 1
    return total / count, int(ids.numel())


@torch.no_grad()
def reply(model, tok, prompt: str, max_new_tokens: int = 120) -> str:
    enc = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, repetition_penalty=1.1)
    return tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip()


CARD = """# {name}

{intro} It knows a little about Python (and Django, Flask, SQLAlchemy,
Werkzeug, Requests, PostgreSQL) and is often wrong: it is a smoke-test model, not an assistant.

| | |
|---|---|
{arch_rows}
| layers / hidden / heads | {num_hidden_layers} / {hidden_size} / {num_attention_heads} q, {num_key_value_heads} kv, head_dim {head_dim} |
| vocab | {vocab_size} (byte-level BPE; `<\\|endoftext\\|>`, `<\\|im_start\\|>`, `<\\|im_end\\|>`), tied embeddings |
| parameters | {params:,} total |
| weights | bf16 safetensors, {size_mb:.1f} MB |
| context | trained on 512-token windows (max_position_embeddings {max_position_embeddings}) |
| chat format | ChatML (`chat_template` in `tokenizer_config.json`), eos `<\\|im_end\\|>` |

## Data

English software documentation as packaged by Debian 12 (bookworm): the Python 3.11
documentation (`python3.11-doc`, PSF licence) plus the Django, Flask, Werkzeug, Requests,
SQLAlchemy and PostgreSQL 15 documentation; exact packages, versions and licences in
`localmoe/data/SOURCES.md`. HTML was converted to markdown-like text ({pretrain_tokens:,}
tokens) and ChatML question/answer pairs were built from the section structure
("What is <section title>?" -> the section's first paragraphs, "What does <function>() do?"
-> its description; {chat_tokens:,} tokens). Held-out pages (`localmoe/data/heldout.txt`)
were never trained on.

## Training

{steps} steps of {batch} x {seq} tokens ({tokens_seen:,} tokens, about {epochs:.0f} passes over
the data), AdamW, cosine LR, bf16 autocast, load-balancing aux loss 0.01, on one {device}
in {train_time_s:.0f} s (experts implementation `{experts_implementation}`); checkpoint chosen at
step {best_step} by loss on validation pages that were not trained on (disjoint from the held-out pages).

Reproduce (see `train/README.md`):

```
{reproduce}
```

## Evaluation

Held-out perplexity on `localmoe/data/heldout.txt` ({heldout_tokens:,} tokens, non-overlapping
512-token windows, float32 on CPU): **{ppl:.2f}** (mean NLL {nll:.4f} nats/token).

## Sample replies (greedy, float32, CPU)

{samples}

## Licence

The weights are derived from the documentation listed in `localmoe/data/SOURCES.md`
(PSF-2.0, BSD-3-Clause, MIT, Apache-2.0, PostgreSQL licences); they are distributed under the
same terms as localmoe, with those notices retained.
"""


def intro(cfg) -> str:
    """The card's first sentence: why the model ships."""
    if cfg.model_type == "deamoe":
        return (
            "The DeaMoE twin of `localmoe-tiny` (same data, tokenizer, token budget and about the same\n"
            "parameters and FLOPs per token), bundled with localmoe so that the DeaMoE layer can be run, evaluated\n"
            "and measured offline (`localmoe run localmoe-tiny-deamoe`, `localmoe eval localmoe-tiny-deamoe`);\n"
            "`localmoe chat` still opens on `localmoe-tiny`."
        )
    return "A very small Mixture-of-Experts chat model bundled with localmoe so that `localmoe chat`\nanswers on first run, offline."


def reproduce(cfg, summary: dict, dst: Path) -> str:
    """The commands that made the checkpoint (train/README.md), with this run's arguments."""
    a = summary["args"]
    if cfg.model_type == "deamoe":
        out = ".work/tiny/out-deamoe"
        return (
            "python train/prepare_data.py --work .work/tiny\n"
            "python train/train_tokenizer.py --work .work/tiny --tokenizer localmoe/assets/localmoe-tiny\n"
            f"python train/train_model.py --arch deamoe --data .work/tiny/carry --out {out} --steps {summary['steps']} "
            f"\\\n    --batch {summary['batch']} --warmup {a['warmup']} --lr {a['lr']} --eval-every {a['eval_every']}\n"
            f"python train/export.py --src {out} --dst localmoe/assets/{dst.name} --tokenizer .work/tiny/tokenizer"
        )
    return (
        "python train/prepare_data.py && python train/train_tokenizer.py\n"
        f"python train/train_model.py --data .work/tiny/carry --out .work/tiny/out --steps {summary['steps']} "
        f"--batch {summary['batch']} \\\n    --warmup {a['warmup']} --lr {a['lr']} --eval-every {a['eval_every']} "
        f"--experts-impl {summary['experts_implementation']}\n"
        "python train/export.py --src .work/tiny/out"
    )


def arch_rows(cfg) -> str:
    """The card's architecture and experts rows."""
    if cfg.model_type == "deamoe":
        return (
            "| architecture | `deamoe` (`DeaMoeForCausalLM`, localmoe.models.deamoe): Qwen3-MoE attention, DeaMoE "
            "department experts |\n"
            f"| experts | {cfg.num_departments} departments x {cfg.experts_per_department} experts, shared "
            f"gate/up/down of width {cfg.department_size} per department, a private [{cfg.department_size}, "
            f"{cfg.department_size}] per expert (identity init), top-{cfg.num_experts_per_tok} within the best "
            f"{cfg.topk_group} departments, `norm_topk_prob=True`, every layer sparse |"
        )
    return (
        "| architecture | `qwen3_moe` (`Qwen3MoeForCausalLM`), SwiGLU experts |\n"
        f"| experts | {cfg.num_experts} experts x moe_intermediate {cfg.moe_intermediate_size}, "
        f"top-{cfg.num_experts_per_tok}, `norm_topk_prob=True`, every layer sparse |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", required=True)
    ap.add_argument("--dst", default=str(REPO / "localmoe" / "assets" / "localmoe-tiny"))
    ap.add_argument(
        "--tokenizer",
        default=str(REPO / ".work" / "tiny" / "tokenizer"),
        help="tokenizer dir, used when --src has no tokenizer files",
    )
    args = ap.parse_args()
    src, dst = Path(args.src), Path(args.dst)
    dst.mkdir(parents=True, exist_ok=True)
    if (src / "model.safetensors").exists():
        for f in SHIP:
            shutil.copyfile(src / f if (src / f).exists() else Path(args.tokenizer) / f, dst / f)
            os.chmod(dst / f, 0o644)
    else:  # sharded checkpoint (device file-size limit): re-save as one bf16 file
        m = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
        m.save_pretrained(dst, safe_serialization=True)
        del m
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(Path(args.tokenizer) / f, dst / f)
    for f in SHIP:
        os.chmod(dst / f, 0o644)
    assert sorted(p.name for p in dst.iterdir() if p.name != "README.md") == sorted(SHIP), list(dst.iterdir())
    summary = json.loads((src / "train_summary.json").read_text())

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(dst))
    model = AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32)
    model.eval()
    cfg = model.config
    nll, n_tok = heldout_nll(model, tok, (REPO / "localmoe" / "data" / "heldout.txt").read_text(encoding="utf-8"))
    samples = []
    for p in PROMPTS:
        r = reply(model, tok, p)
        print(f">>> {p}\n{r}\n", flush=True)
        samples.append(f"**User:** {p}\n\n**{dst.name}:**\n\n> " + r.replace("\n", "\n> ").replace("```", "'''"))
    stats = (
        json.loads((REPO / ".work" / "tiny" / "tokens.json").read_text())
        if (REPO / ".work" / "tiny" / "tokens.json").exists()
        else {}
    )
    card = CARD.format(
        **{
            k: getattr(cfg, k)
            for k in (
                "num_hidden_layers",
                "hidden_size",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "vocab_size",
                "max_position_embeddings",
            )
        },
        name=dst.name,
        intro=intro(cfg),
        reproduce=reproduce(cfg, summary, dst),
        arch_rows=arch_rows(cfg),
        params=sum(p.numel() for p in model.parameters()),
        size_mb=(dst / "model.safetensors").stat().st_size / 1e6,
        pretrain_tokens=stats.get("pretrain_tokens", 0),
        chat_tokens=stats.get("chat_tokens", 0),
        epochs=summary["tokens_seen"] / max(1, stats.get("train_tokens", summary["tokens_seen"])),
        warmup=summary["args"]["warmup"],
        lr=summary["args"]["lr"],
        eval_every=summary["args"]["eval_every"],
        ppl=math.exp(nll),
        nll=nll,
        heldout_tokens=n_tok,
        samples="\n\n".join(samples),
        **{
            k: summary[k]
            for k in (
                "steps",
                "batch",
                "seq",
                "tokens_seen",
                "device",
                "train_time_s",
                "experts_implementation",
                "best_step",
            )
        },
    )
    (dst / "README.md").write_text(card)
    print(
        f"held-out: nll {nll:.4f} ppl {math.exp(nll):.2f} over {n_tok} tokens "
        f"(device-side bf16: ppl {summary['heldout_ppl']:.2f})"
    )


if __name__ == "__main__":
    main()
