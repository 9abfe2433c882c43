"""Train the byte-level BPE tokenizer for ``localmoe-tiny`` and tokenize the corpus.

Reads ``<work>/pretrain.jsonl`` and ``<work>/chat.jsonl`` (from ``train/prepare_data.py``),
trains an 8192-entry byte-level BPE with the ``tokenizers`` library (special tokens
``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``), writes a transformers-loadable
tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` with a ChatML ``chat_template``)
to ``<work>/tokenizer/``, and writes the token streams as uint16 arrays:

* ``<work>/train.bin``   - training documents and ChatML conversations, shuffled
  (fixed seed), each followed by ``<|endoftext|>``;
* ``<work>/heldout.bin`` - ``localmoe/data/heldout.txt`` tokenized as one document;
* ``<work>/val.bin``     - ``<work>/val.txt`` (validation pages) tokenized the same way.

With ``--tokenizer DIR`` no tokenizer is trained: the one in DIR (``tokenizer.json`` + ``tokenizer_config.json``,
e.g. the shipped ``localmoe/assets/localmoe-tiny``) is copied to ``<work>/tokenizer/`` and tokenizes the streams, so
a second model (``localmoe-tiny-deamoe``) sees exactly the token ids the first one saw.

Usage::

    python train/train_tokenizer.py --work .work/tiny
    python train/train_tokenizer.py --work .work/tiny --tokenizer localmoe/assets/localmoe-tiny
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SEED = 1234
REPO = Path(__file__).resolve().parent.parent
VOCAB_SIZE = 8192
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, optional system message, optional generation prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def render_chat(messages: list[dict]) -> str:
    """Python twin of CHAT_TEMPLATE (used to build the training stream)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content'].strip()}<|im_end|>\n" for m in messages)


def build_tokenizer(texts) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_hf(tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1024,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(tok.token_to_id(s)): {
                "content": s,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for s in SPECIALS
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=str(REPO / ".work" / "tiny"))
    ap.add_argument("--tokenizer", default=None, help="use this tokenizer folder instead of training one")
    args = ap.parse_args()
    work = Path(args.work)
    rng = random.Random(SEED)

    docs = [json.loads(line)["text"] for line in open(work / "pretrain.jsonl", encoding="utf-8")]
    chats = [render_chat(json.loads(line)["messages"]) for line in open(work / "chat.jsonl", encoding="utf-8")]
    items = docs + chats
    rng.shuffle(items)

    if args.tokenizer:
        src = Path(args.tokenizer)
        (work / "tokenizer").mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(src / name, work / "tokenizer" / name)
        tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    else:
        tok = build_tokenizer(items)
        save_hf(tok, work / "tokenizer")
    eot = tok.token_to_id("<|endoftext|>")
    assert [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2], "specials must be ids 0..2"

    ids: list[int] = []
    n_doc_tok = n_chat_tok = 0
    for enc, text in zip(tok.encode_batch(items), items):
        ids.extend(enc.ids)
        ids.append(eot)
        if text.startswith("<|im_start|>"):
            n_chat_tok += len(enc.ids) + 1
        else:
            n_doc_tok += len(enc.ids) + 1
    arr = np.asarray(ids, dtype=np.uint16)
    arr.tofile(work / "train.bin")

    held = (REPO / "localmoe" / "data" / "heldout.txt").read_text(encoding="utf-8")
    held_ids = np.asarray(tok.encode(held).ids, dtype=np.uint16)
    held_ids.tofile(work / "heldout.bin")

    val_ids = np.asarray(tok.encode((work / "val.txt").read_text(encoding="utf-8")).ids, dtype=np.uint16)
    val_ids.tofile(work / "val.bin")

    stats = {
        "vocab_size": tok.get_vocab_size(),
        "train_tokens": int(arr.size),
        "pretrain_tokens": n_doc_tok,
        "chat_tokens": n_chat_tok,
        "heldout_tokens": int(held_ids.size),
        "val_tokens": int(val_ids.size),
        "heldout_chars": len(held),
        "chars_per_token_heldout": round(len(held) / held_ids.size, 3),
    }
    (work / "tokens.json").write_text(json.dumps(stats, indent=2))
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
