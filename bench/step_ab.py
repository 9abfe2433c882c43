"""A/B of launch settings on the whole CUDA-graph decode step (GPU, not a test).

Kernel benches time a launch alone or in a short chain; what counts is the step, where each kernel overlaps its
neighbours (PDL) and shares the SMs with them. This builds a random-weight engine once (`--shape ALIAS`, default
qwen3.5-35b; at the model's registry default sparsity unless --sparsity; context 1024 unless --context) and, for
each case, applies a setting, captures the graph again and decodes 129
tokens after a 128-token prompt, then replays the captured step 200 times back to back (the greedy chain continues
inside the graph: the step's GPU time without the host loop, steadier than the decode's tok/s); the cases run in
rounds (A B C A B C ...) so drift between machines' minutes shows as spread.

Cases (comma-separated; settings joined by "+" apply together):
  base                          the tuned defaults
  pdl0                          programmatic dependent launch off
  fused:K=V[;K=V]               sparse_fused launch keywords for every layer, e.g. fused:maxnreg=64;BLOCK_I=4
  attr:CLASS.NAME=V             an attribute of every module of that class, e.g.
                                attr:LocalExperts.dense_tail=1 (sparsity 0 through sparse_fused's tail)
  depth:N                       decode steps launched ahead of the host's token read (Engine.pipeline_depth)
  choice0                       greedy token chosen outside the graph (torch argmax, copies between replays), as
                                before session 8 (Engine.graph_greedy)
  unfuse:CLASS                  the modules of that localmoe class put back to transformers' (e.g. FusedTextModel)
  tablefrom:DEVICE              another device's whole tuned table on this one (e.g. tablefrom:NVIDIA H200 on an
                                H100, which has none: would the H200's entries help it?)
  table:KERNEL:SHAPE:K=V[;K=V]  a decode_params entry of kernels/tuned/<device>.json replaced for this case, e.g.
                                table:gemv:N12352_K2048:BLOCK_N=4;num_warps=4 or
                                table:moe_front:H2048_E256_k8:block_e=2; nothing after the last colon: the
                                launcher's defaults (is a tuned entry worth it?)
Usage: PYTHONUNBUFFERED=1 python bench/step_ab.py CASE[,CASE...] [--shape ALIAS] [--rounds 3] [--sparsity S]
       [--prompt 128] [--context 1024]
e.g. a tuned entry against the default launch: bench/step_ab.py "base,fused:BLOCK_I=8;num_warps=8" --shape olmoe,
     bench/step_ab.py base,table:decode_attention:Hq32_Hkv4_D128: --shape qwen3-30b
"""

from __future__ import annotations

import copy
import statistics
import sys

import torch

from localmoe.engine.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.experts.local_experts import LocalExperts
from localmoe.kernels import pdl, tuning
from localmoe.models.registry import load_registry


def _kv(spec: str) -> dict:
    out = {}
    for item in filter(None, spec.split(";")):
        k, v = item.split("=")
        out[k] = int(v) if v.lstrip("-").isdigit() else v
    return out


# what the current case changed, undone before the next: table entries (None: absent before), modules swapped out,
# attributes set
_UNDO: dict[str, dict] = {"table": {}, "modules": {}, "attrs": {}, "whole": {}}
CONTEXT = 1024  # the static cache's length (--context)


def _set(model, name: str, module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def apply(engine, case: str) -> None:
    """Undoes the previous case, then applies this one: settings joined by "+" apply together."""
    reset(engine)
    for part in case.split("+"):
        _apply_one(engine, part)
    engine.set_context(CONTEXT)  # drops the captured graph: the next generate captures with this case's settings


def reset(engine) -> None:
    pdl.set_enabled(None)
    tuning._tuned_on.cache_clear()
    tuning._tuned_at.cache_clear()
    table = tuning._device_table(torch.cuda.get_device_name())
    table.setdefault("decode_params", {})
    for (kern, shape), kw in _UNDO["table"].items():
        if kw is None:
            table["decode_params"].get(kern, {}).pop(shape, None)
        else:
            table["decode_params"][kern][shape] = kw
    if "table" in _UNDO["whole"]:  # a tablefrom: case: this device's own table back
        table.clear()
        table.update(_UNDO["whole"]["table"])
    for name, m in _UNDO["modules"].items():
        _set(engine.model, name, m)
    for (m, attr), v in _UNDO["attrs"].items():
        setattr(m, attr, v)
    for d in _UNDO.values():
        d.clear()
    for m in engine.model.modules():
        for attr in ("_front", "_launch"):  # per-module launch caches: looked up again at the next call
            if attr in m.__dict__ and not isinstance(m, LocalExperts):
                m.__dict__[attr] = None
        if isinstance(m, LocalExperts):
            m._params = None


def _apply_one(engine, case: str) -> None:
    table = tuning._device_table(torch.cuda.get_device_name())
    if case == "base":
        pass
    elif case == "pdl0":
        pdl.set_enabled(False)
    elif case.startswith("fused:"):
        kw = _kv(case[len("fused:") :])
        for m in engine.model.modules():
            if isinstance(m, LocalExperts):
                cfg = getattr(engine.loaded.config, "text_config", None) or engine.loaded.config
                m._launch(torch.empty(1, device="cuda"), cfg.num_experts_per_tok)["fused"].update(kw)
    elif case.startswith("depth:"):
        _UNDO["attrs"].setdefault((engine, "pipeline_depth"), engine.pipeline_depth)
        engine.pipeline_depth = int(case[len("depth:") :])
    elif case == "choice0":
        _UNDO["attrs"].setdefault((engine, "graph_greedy"), engine.graph_greedy)
        engine.graph_greedy = False
    elif case.startswith("attr:"):
        cls, rest = case[len("attr:") :].split(".", 1)
        attr, v = rest.split("=")
        for m in engine.model.modules():
            if type(m).__name__ == cls:
                _UNDO["attrs"].setdefault((m, attr), getattr(m, attr))
                setattr(m, attr, type(getattr(m, attr))(int(v)) if v.lstrip("-").isdigit() else v)
    elif case.startswith("unfuse:"):
        cls = case[len("unfuse:") :]
        for name, m in list(engine.model.named_modules()):
            if type(m).__name__ == cls:
                _UNDO["modules"][name] = m
                _set(engine.model, name, m._hf)
    elif case.startswith("tablefrom:"):
        other = tuning._device_table(case[len("tablefrom:") :])
        if other is table or "decode_params" not in other:
            raise SystemExit(f"no other device's tuned table matches {case[len('tablefrom:') :]!r}")
        _UNDO["whole"].setdefault("table", copy.deepcopy(table))
        table.clear()
        table.update(copy.deepcopy(other))
    elif case.startswith("table:"):
        _, kern, shape, spec = case.split(":", 3)
        entry = table["decode_params"].setdefault(kern, {})
        _UNDO["table"].setdefault((kern, shape), entry.get(shape))
        entry[shape] = _kv(spec)
    else:
        raise SystemExit(f"unknown case {case!r}")


def main() -> None:
    args = [a for i, a in enumerate(sys.argv[1:], 1) if not a.startswith("--") and not sys.argv[i - 1].startswith("--")]
    cases = args[0].split(",") if args else ["base"]
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    shape = sys.argv[sys.argv.index("--shape") + 1] if "--shape" in sys.argv else "qwen3.5-35b"
    spec = load_registry().get(shape)
    default = spec.sparsity if spec is not None else 0.85
    sparsity = float(sys.argv[sys.argv.index("--sparsity") + 1]) if "--sparsity" in sys.argv else default
    n_prompt = int(sys.argv[sys.argv.index("--prompt") + 1]) if "--prompt" in sys.argv else 128
    global CONTEXT
    CONTEXT = int(sys.argv[sys.argv.index("--context") + 1]) if "--context" in sys.argv else 1024
    engine = Engine.random(shape, device=torch.device("cuda"), dtype=torch.bfloat16)
    engine.set_sparsity(sparsity)
    engine.eos_ids = set()
    prompt = torch.randint(0, engine.loaded.config.vocab_size, (n_prompt,), generator=torch.Generator().manual_seed(0))
    results: dict[str, list[float]] = {c: [] for c in cases}
    prefill: dict[str, list[float]] = {c: [] for c in cases}
    replays: dict[str, list[float]] = {c: [] for c in cases}  # µs per back-to-back replay (greedy chain in the graph)
    for r in range(rounds):
        for case in cases:
            apply(engine, case)
            list(engine.generate(prompt.tolist(), GenerationSettings(max_new_tokens=4)))  # capture
            list(engine.generate(prompt.tolist(), GenerationSettings(max_new_tokens=129)))
            tok_s = engine.stats.decode_tok_s
            results[case].append(tok_s)
            prefill[case].append(engine.stats.prefill_tok_s)
            replays[case].append(replay_us(engine, min(200, CONTEXT - n_prompt - 130)))
            print(
                f"  round {r} {case}: {tok_s:.1f} tok/s ({1e6 / tok_s:.0f} µs/step), replays "
                f"{replays[case][-1]:.1f} µs/step, prefill {engine.stats.prefill_tok_s:.1f} tok/s",
                flush=True,
            )
    base = statistics.median(results[cases[0]])
    print(
        f"\n{shape}, sparsity {sparsity:.0%}, context {CONTEXT}, prompt {n_prompt}, {rounds} rounds "
        "(median; spread = max - min)"
    )
    rbase = statistics.median(replays[cases[0]]) if all(replays[cases[0]]) else 0.0
    print(
        "| case | decode tok/s | µs/step | spread tok/s | vs first | replay µs/step (spread) | vs first | "
        "prefill tok/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for case, v in results.items():
        med = statistics.median(v)
        rp = replays[case]
        rmed = statistics.median(rp)
        rcol = f"{rmed:.1f} ({max(rp) - min(rp):.1f}) | {rbase / rmed - 1:+.2%}" if rmed and rbase else "– | –"
        print(
            f"| {case} | {med:.1f} | {1e6 / med:.0f} | {max(v) - min(v):.1f} | {med / base - 1:+.1%} | {rcol} | "
            f"{statistics.median(prefill[case]):.1f} |"
        )


def replay_us(engine, n: int) -> float:
    """µs per replay of the captured step, back to back: the greedy chain the last generate
    left continues inside the graph, with no host work between steps. 0 when there is no such graph or no room."""
    graph = engine._graph
    if graph is None or graph.graph is None or not graph.chooses or n < 20:
        return 0.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / n


if __name__ == "__main__":
    main()
