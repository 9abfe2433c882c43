"""Prompt reuse across chat turns on the GPU (not a test; run on the H200): correctness, then time to first token.

1. Tiny random checkpoints of each family (float32 on CUDA, the CUDA-graph decoder and its StaticCache): a three-turn
   chat through `Engine.chat`, once with prompt reuse and once without: the same greedy tokens, and how many prompt
   tokens each turn took from the cache.
2. `--shape qwen3.5-35b` (random bf16 weights at the real shapes, `Engine.random`), sparsity 0.85, optionally
   `--vram 24`: a chat whose history grows each turn (token ids built directly: random weights have no tokenizer;
   the assistant's turns in the history are fixed ids, so every run sends the same prompts). Per turn: prompt
   tokens, then time to first token and tokens reused with the state kept at the prompt's end, at the history's end,
   and without reuse; then the last turn's logits rewound against prefilled whole (random weights have near-tied
   logits, so bf16 tokens are compared through the logits, with a different prefill piece size as the scale).

Usage: PYTHONUNBUFFERED=1 python bench/chat_turns.py [--skip-tiny] [--skip-shape] [--vram GIB] [--turns N]
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

root = Path(tempfile.mkdtemp())
os.environ.update(HF_HUB_CACHE=str(root / "hub"), HF_HUB_OFFLINE="1", XDG_CACHE_HOME=str(root / "xdg"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

from localmoe.engine.engine import Engine  # noqa: E402
from localmoe.events import GenerationSettings  # noqa: E402


def chat3(e):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a mixture of experts?"}]
    out = []
    for follow in ("and sparsity?", "thanks", None):
        ids = [ev.token_id for ev in e.chat(msgs, GenerationSettings(max_new_tokens=12))]
        out.append((ids, e.stats.prompt_tokens, e.stats.reused_prompt_tokens))
        if follow:
            msgs = msgs + [
                {"role": "assistant", "content": e.tokenizer.decode(ids, skip_special_tokens=True)},
                {"role": "user", "content": follow},
            ]
    return out


def tiny():
    import tiny_models

    print("family        graph  tokens equal  reused per turn (with) / (without)")
    for fam in tiny_models.SUPPORTED:
        repo = f"{tiny_models.ORG}/tiny-{fam}"
        try:
            folder = tiny_models.save_checkpoint(fam, root / "src" / fam)
            tiny_models.place_in_hf_cache(folder, root / "hub", repo)
            e = Engine.load(repo, device="cuda", dtype="float32", sparsity=0.0)
            e.eos_ids = set()
            a = chat3(e)
            graph = e._graph is not None
            e.reuse_prompts = False
            e._drop_graph()
            b = chat3(e)
            print(
                f"{fam:<13} {str(graph):<6} {str([x[0] for x in a] == [x[0] for x in b]):<13} "
                f"{[x[2] for x in a]} / {[x[2] for x in b]}  (prompts {[x[1] for x in a]})",
                flush=True,
            )
        except Exception as ex:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            print(f"{fam:<13} ERROR {type(ex).__name__}: {ex}"[:160], flush=True)


def conversation(turns: int, first: int, user: int, reply: int, vocab: int, seed: int = 0):
    """[(prompt ids, history length, the next prompt's start: history + header + reply + end)] for a chat whose
    history grows by a reply and a user message each turn."""
    g = torch.Generator().manual_seed(seed)
    lo = min(100, vocab // 4)  # clear of the special tokens at either end

    def rand(n):
        return torch.randint(lo, vocab - lo, (n,), generator=g).tolist()

    header = rand(3)  # "<|im_start|>assistant\n"
    end = rand(2)  # "<|im_end|>\n"
    history = rand(first)
    out = []
    for _ in range(turns):
        answered = history + header + rand(reply) + end
        out.append((history + header, len(history), answered))
        history = answered + rand(user)
    return out


def ttft(e, ids, stable, n_decode):
    t0 = time.perf_counter()
    first, toks = None, []
    for ev in e.generate(ids, GenerationSettings(max_new_tokens=n_decode), stable=stable):
        if first is None:
            first = time.perf_counter() - t0
        toks.append(ev.token_id)
    return first, toks, e.stats


# where the engine keeps the state for the next turn: the prompt's end (a ChatML-style template renders the next turn
# after the whole prompt), the history without the generation header (thinking templates: one more prefill piece),
# or nowhere (every prompt prefilled whole)
MODES = {
    "prompt end": lambda ids, hist: len(ids),
    "history": lambda ids, hist: hist,
    "none": None,
    "+ reply": lambda ids, hist: len(ids),
}  # as "prompt end", then the reply prefilled (prepare_next_turn)


@torch.inference_mode()
def take_reply(e, answered):
    """What Engine.prepare_next_turn does after a reply (ids instead of messages: random weights have no
    tokenizer) -> seconds."""
    t0 = time.perf_counter()
    x = torch.tensor([answered], device=e._device)
    with e._busy:
        if e._graph is not None:
            e._graph.prefill(x, len(answered))
        else:
            e._prefill(x, len(answered))
    if x.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@torch.inference_mode()  # as Engine.generate: the cache's tensors were made in inference mode
def logits_check(e, turns):
    """Last turn's first-token logits: rewound + rest prefilled against prefilled whole; and, for scale, prefilled
    whole in 1024-token pieces against 2048."""
    g = e._graph_decoder()
    if g is None:
        return "no graph"
    prev, last = turns[-2][0], turns[-1][0]
    t = lambda ids: torch.tensor([ids], device="cuda")  # noqa: E731
    e.reuse_prompts = True
    g.prefill(t(prev), len(prev))
    reused = g.prefill(t(last), len(last)).float().clone()
    n = g.reused
    e.reuse_prompts = False
    whole = g.prefill(t(last)).float().clone()
    e.prefill_chunk = 1024
    pieces = g.prefill(t(last)).float().clone()
    e.prefill_chunk = 2048
    return (
        f"last turn's logits, rewound ({n} reused) vs whole: rel. diff {rel(reused, whole):.2e}, argmax equal "
        f"{int(reused.argmax()) == int(whole.argmax())}; 1024- vs 2048-token pieces (no reuse): rel. diff "
        f"{rel(pieces, whole):.2e}, argmax equal {int(pieces.argmax()) == int(whole.argmax())}"
    )


def shape(args):
    dev = torch.device("cuda")
    t = time.perf_counter()
    e = Engine.random("qwen3.5-35b", device=dev, dtype=torch.bfloat16, vram_gib=args.vram, context=8192)
    print(f"built in {time.perf_counter() - t:.1f} s", flush=True)
    e.set_sparsity(0.85)
    run_turns(e, args, f"--vram {args.vram:g}" if args.vram else "resident")


def run_turns(e, args, where):
    e.eos_ids = set()
    vocab = int(e.loaded.config.vocab_size)
    turns = conversation(args.turns, args.first, args.user, args.reply, vocab)
    rows = {}
    for mode in ["warm-up", *MODES]:  # warm-up: graph capture and every piece length's first-call costs
        keep = MODES.get(mode, MODES["history"])
        e.reuse_prompts = keep is not None
        e._forget_prompt()
        for i, (ids, hist, answered) in enumerate(turns):
            t, toks, st = ttft(e, ids, keep(ids, hist) if keep else 0, args.decode)
            rows.setdefault(i, {})[mode] = (
                t,
                st.reused_prompt_tokens,
                st.decode_tok_s,
                take_reply(e, answered) if mode == "+ reply" else 0.0,
            )
        print(f"{mode}: done", flush=True)
    print(
        f"\nchat turns, qwen3.5-35b shapes (random bf16), sparsity 0.85, {where}, decode {args.decode} per turn; "
        "time to first token (s) [tokens reused] by where the state is kept"
    )
    print(
        "| turn | prompt tokens | prompt end + reply (reply prefill s) | prompt end | history | none (prefill "
        "whole) | speed-up | decode tok/s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, (ids, _, _) in enumerate(turns):
        r = rows[i]
        pr, pe, hi, no = r["+ reply"], r["prompt end"], r["history"], r["none"]
        print(
            f"| {i + 1} | {len(ids)} | {pr[0]:.3f} [{pr[1]}] ({pr[3]:.3f}) | {pe[0]:.3f} [{pe[1]}] | "
            f"{hi[0]:.3f} [{hi[1]}] | {no[0]:.3f} | {no[0] / pr[0]:.1f}x | {pr[2]:.1f} / {no[2]:.1f} |",
            flush=True,
        )
    print(logits_check(e, turns))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--skip-tiny", action="store_true")
    p.add_argument("--skip-shape", action="store_true")
    p.add_argument("--vram", type=float, default=None)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first", type=int, default=1500, help="history tokens at the first turn")
    p.add_argument("--user", type=int, default=300, help="tokens of each new user message")
    p.add_argument("--reply", type=int, default=120, help="tokens of each assistant reply in the history")
    p.add_argument("--decode", type=int, default=16)
    a = p.parse_args()
    if not a.skip_tiny:
        tiny()
    if not a.skip_shape:
        shape(a)
