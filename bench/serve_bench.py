"""`localmoe serve` against the in-process Engine, in one run (not a test): the same Engine object serves HTTP from a
thread of this process (uvicorn on a free localhost port, the official `openai` client) and runs in-process.

1. Decode tok/s and time to first token: a random prompt of --prompt-tokens ids, --decode-tokens tokens decoded
   greedily (EOS off), --reps times each way, alternating; every measurement gets a fresh prompt (so prompt reuse
   helps neither). In-process: `Engine.generate`, first event and engine stats. HTTP: a streamed /v1/completions
   request (prompt as token ids): first chunk, last chunk and usage, measured by the client; and the engine's own
   decode rate for that request (the `localmoe` field). The client runs in this process (client, server and engine
   share one interpreter: the harder case) or, with --client-process, in a process of its own.
2. A --turns-turn chat over HTTP (streamed /v1/chat/completions; each user message about --user-words words, each
   reply --reply-tokens tokens; the reply text sent back as the client would), with a --pause between turns as a
   user reading and typing (the server prefills the reply meanwhile), then the same conversation with prompt reuse
   off: time to first token and cached prompt tokens per turn.

Random weights (--shape, CUDA) have no tokenizer: the bundled localmoe-tiny's (ChatML, 8192 ids) is attached, and
lm_head rows past its vocabulary are zeroed so every token the random model picks is one it can spell.

Usage (GPU):  PYTHONUNBUFFERED=1 python bench/serve_bench.py --shape qwen3.5-35b --sparsity 0.85 [--client-process]
      (CPU smoke): python bench/serve_bench.py --model localmoe-tiny --device cpu --prompt-tokens 64 \
                   --decode-tokens 32 --reps 2 --turns 4 --reply-tokens 16 --pause 0.2
Writes $OUT/serve_bench.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import openai
import torch
import uvicorn
from transformers import AutoTokenizer

import localmoe
from localmoe.engine.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.server.app import create_app
from localmoe.server.launch import bind, url

NAME = "bench"
WORDS = "expert router token cache layer sparse decode prefill context memory kernel graph".split()


def make_engine(args) -> Engine:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    context = args.prompt_tokens + args.decode_tokens + 64
    context = max(context, args.turns * (args.user_words * 3 + args.reply_tokens * 2 + 16) + 256)
    if args.shape:
        e = Engine.random(args.shape, device=device, dtype=torch.bfloat16, vram_gib=args.vram, context=context)
        e.set_sparsity(args.sparsity if args.sparsity is not None else 0.0)
        e.tokenizer = AutoTokenizer.from_pretrained(Path(localmoe.__file__).parent / "assets" / "localmoe-tiny")
        with torch.no_grad():
            e.model.get_output_embeddings().weight[len(e.tokenizer) :].zero_()
    else:
        e = Engine.load(args.model, device=str(device), sparsity=args.sparsity, vram_gib=args.vram, context=context)
    e.eos_ids = set()  # every reply runs its full length
    return e


def start_server(engine):
    sock = bind("127.0.0.1", 0)
    app = create_app(engine, names=[NAME], max_queue=4)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, url(sock)


def in_process(engine, prompt, n) -> dict:
    t0, first = time.perf_counter(), None
    for _ in engine.generate(prompt, GenerationSettings(max_new_tokens=n, temperature=0.0)):
        if first is None:
            first = time.perf_counter()
    st = engine.stats
    return {"ttft_s": first - t0, "decode_tok_s": st.decode_tok_s, "tokens": st.generated_tokens}


def over_http(client, prompt, n) -> dict:
    t0, first, last, usage, figures = time.perf_counter(), None, None, None, {}
    stream = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=n,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text and first is None:
            first = now
        if chunk.choices and chunk.choices[0].finish_reason:
            last, figures = now, chunk.model_extra.get("localmoe", {})
        if chunk.usage is not None:
            usage = chunk.usage
    k = usage.completion_tokens
    return {
        "ttft_s": first - t0,
        "decode_tok_s": (k - 1) / (last - first),
        "engine_decode_tok_s": figures.get("decode_tok_s"),
        "tokens": k,
    }


def http_run(base: str, prompt, n) -> dict:
    """over_http from a client process of its own (--client-process)."""
    return over_http(openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=600), prompt, n)


def decode_rows(engine, client, args, pool=None) -> list[dict]:
    """In-process and HTTP runs, alternating; HTTP from this process, or from `pool`'s process."""
    rng = random.Random(0)
    vocab = len(engine.tokenizer)

    def http(prompt, n):
        return pool.apply(http_run, (str(client.base_url), prompt, n)) if pool else over_http(client, prompt, n)

    runs = {"in-process": [], "http": []}
    in_process(engine, [rng.randrange(vocab) for _ in range(args.prompt_tokens)], 8)  # warm-up, graph capture
    http([rng.randrange(vocab) for _ in range(args.prompt_tokens)], 8)
    for rep in range(args.reps):
        for mode in ("in-process", "http") if rep % 2 == 0 else ("http", "in-process"):
            prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
            if mode == "in-process":
                runs[mode].append(in_process(engine, prompt, args.decode_tokens))
            else:
                runs[mode].append(http(prompt, args.decode_tokens))
    rows = []
    for mode, rs in runs.items():
        row = {"mode": mode, **{k: statistics.median(r[k] for r in rs) for k in ("ttft_s", "decode_tok_s", "tokens")}}
        if mode == "http":
            row["engine_decode_tok_s"] = statistics.median(r["engine_decode_tok_s"] for r in rs)
        rows.append(row)
    rows[1]["ratio"] = rows[1]["decode_tok_s"] / rows[0]["decode_tok_s"]
    return rows


def conversation(engine, client, args, reuse: bool) -> list[dict]:
    engine.reuse_prompts = reuse
    engine._forget_prompt()
    rng = random.Random(1)
    msgs = [{"role": "system", "content": "You answer questions about mixture-of-experts inference."}]
    turns = []
    for t in range(args.turns):
        words = " ".join(rng.choice(WORDS) for _ in range(args.user_words))
        msgs.append({"role": "user", "content": f"Question {t + 1}: {words}?"})
        t0, first, text, usage = time.perf_counter(), None, [], None
        stream = client.chat.completions.create(
            model=NAME,
            messages=msgs,
            max_tokens=args.reply_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        msgs.append({"role": "assistant", "content": "".join(text)})
        turns.append(
            {
                "turn": t + 1,
                "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                "ttft_s": (first or time.perf_counter()) - t0,
            }
        )
        time.sleep(args.pause)
    engine.reuse_prompts = True
    return turns


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default=None, help="random weights at this registry model's shapes (CUDA)")
    p.add_argument("--model", default="localmoe-tiny", help="a real model when no --shape (default: localmoe-tiny)")
    p.add_argument("--device", default=None)
    p.add_argument("--sparsity", type=float, default=None)
    p.add_argument("--vram", type=float, default=None)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--user-words", type=int, default=40)
    p.add_argument("--reply-tokens", type=int, default=64)
    p.add_argument("--pause", type=float, default=0.5, help="seconds between turns (a user reading and typing)")
    p.add_argument(
        "--client-process",
        action="store_true",
        help="the decode rows' HTTP client in a process of its own (as an editor or agent is), not this one",
    )
    args = p.parse_args()
    engine = make_engine(args)
    server, thread, base = start_server(engine)
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
    print(f"{engine.model_name} on {engine.device}, sparsity {engine.sparsity:.0%}, context {engine.context}")
    if args.client_process:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            rows = decode_rows(engine, client, args, pool)
    else:
        rows = decode_rows(engine, client, args)
    where = "another process" if args.client_process else "this process"
    print(
        f"\ndecode: prompt {args.prompt_tokens}, {args.decode_tokens} tokens, median of {args.reps}, client in {where}"
    )
    print("| mode | time to first token (s) | decode tok/s | engine decode tok/s | HTTP / in-process |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        eng = f"{r['engine_decode_tok_s']:.1f}" if "engine_decode_tok_s" in r else "–"
        ratio = f"{r['ratio']:.1%}" if "ratio" in r else "–"
        print(f"| {r['mode']} | {r['ttft_s']:.3f} | {r['decode_tok_s']:.1f} | {eng} | {ratio} |")
    client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)  # warm-up
    chats = {"reuse": conversation(engine, client, args, True), "no reuse": conversation(engine, client, args, False)}
    print(f"\nconversation over HTTP: {args.turns} turns, {args.reply_tokens}-token replies, pause {args.pause} s")
    print("| turn | prompt tokens | cached (reuse) | TTFT reuse (s) | TTFT no reuse (s) |")
    print("|---:|---:|---:|---:|---:|")
    for a, b in zip(chats["reuse"], chats["no reuse"]):
        print(f"| {a['turn']} | {a['prompt_tokens']} | {a['cached_tokens']} | {a['ttft_s']:.3f} | {b['ttft_s']:.3f} |")
    later = {k: statistics.mean(t["ttft_s"] for t in v[1:]) for k, v in chats.items() if len(v) > 1}
    if later:
        print(f"mean TTFT, turns 2-{args.turns}: reuse {later['reuse']:.3f} s, no reuse {later['no reuse']:.3f} s")
    server.should_exit = True
    thread.join(timeout=10)
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "serve_bench.json"
        result = {
            "model": engine.model_name,
            "device": engine.device,
            "client_process": args.client_process,
            "decode": rows,
            "conversation": chats,
        }
        out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
