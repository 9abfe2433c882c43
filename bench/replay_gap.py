"""What a decode step costs beyond its captured graph (GPU, not a test): the engine's greedy decode against the same
graph replayed back to back.

With the greedy token chosen inside the graph (`GraphDecoder.step_greedy`) the captured step feeds itself: each
replay reads the id and position the one before wrote. So `graph.replay()` in a loop is a real decode with no host
work between steps, and its time per replay is the step's GPU time. The engine's decode (`Engine.generate`: the
replay, an event per step, the host reading each token from the pinned ring two steps behind, detokenising) is
timed on the same engine in the same rounds; the difference is what the host loop and the graph boundaries still
cost per token. Random-weight Qwen3.5-35B-A3B, 85 %, prompt 512, context 1024 (the step_ab.py settings).
Usage: PYTHONUNBUFFERED=1 python bench/replay_gap.py [--rounds 3] [--replays 200]
"""

from __future__ import annotations

import statistics
import sys

import torch

from step_ab import replay_us

from localmoe.engine import Engine
from localmoe.events import GenerationSettings


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    n = int(sys.argv[sys.argv.index("--replays") + 1]) if "--replays" in sys.argv else 200
    engine = Engine.random("qwen3.5-35b", device=torch.device("cuda"), dtype=torch.bfloat16)
    engine.set_sparsity(0.85)
    engine.set_context(1024)
    engine.eos_ids = set()
    prompt = torch.randint(0, engine.loaded.config.vocab_size, (512,), generator=torch.Generator().manual_seed(0))
    list(engine.generate(prompt.tolist(), GenerationSettings(max_new_tokens=4)))  # capture
    gen_us, rep_us = [], []
    for r in range(rounds):
        list(engine.generate(prompt.tolist(), GenerationSettings(max_new_tokens=129)))
        gen_us.append(1e6 / engine.stats.decode_tok_s)
        rep_us.append(replay_us(engine, n))  # the chain that generate left: position 640, room for n < 384 more
        print(f"  round {r}: engine decode {gen_us[-1]:.0f} µs/step, graph replays back to back {rep_us[-1]:.0f} "
              f"µs/step", flush=True)
    g, p = statistics.median(gen_us), statistics.median(rep_us)
    print(f"\n| 85%, prompt 512, context 1024, {rounds} rounds (median) | µs/step | tok/s |")
    print("|---|---:|---:|")
    print(f"| engine decode (generate, 129 tokens) | {g:.0f} | {1e6 / g:.1f} |")
    print(f"| the captured step replayed back to back ({n}) | {p:.0f} | {1e6 / p:.1f} |")
    print(f"| beyond the graph, per token | {g - p:.0f} | – |")


if __name__ == "__main__":
    main()
