"""`localmoe bench`: what a user cares about, measured on their GPU — load time, prefill tok/s (512-token prompt),
decode tok/s (256 tokens) at sparsity 0 and the model's default, peak GPU memory, and the step's byte floor.

`--shape ALIAS` builds random weights with the real config (localmoe/data/shapes.json) when the checkpoint is not
on disk, so hardware can be measured without a download. `--repeat-penalty P` adds, for each sparsity, a row
decoding with the repetition penalty P after the row without it (same engine, same captured graph). Random routers
spread tokens evenly over the experts, the
pessimistic case for the expert cache under `--vram`; `--routing skewed` gives each layer a few hot experts as trained
MoEs have (random_weights.SKEW_ALPHA). `--baseline transformers` adds stock `generate` with the same config in the same
run.
Prints a table, or JSON with `--json`.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass

import torch

from localmoe.devices import host_bandwidth, pick_device, pick_dtype
from localmoe.engine import model_facts
from localmoe.engine.engine import Engine
from localmoe.errors import UsageError
from localmoe.events import GenerationSettings
from localmoe.experts import predicted, predictor
from localmoe.measure.baselines import BenchRow, accelerate_baseline, transformers_baseline


def copy_bandwidth(device) -> float:
    """Device-to-device copy, bytes read + written per second."""
    if device.type != "cuda":
        return 0.0
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    bw = 2 * n * 10 / (time.perf_counter() - t)
    del a, b
    return bw


@dataclass
class PrefillRow:  # a timed prompt length's prefill at one sparsity (the median of TTFT_REPS)
    prompt_tokens: int
    sparsity: float
    prefill_tok_s: float
    ttft_s: float
    pcie_s: float | None = None  # offloaded: the PCIe-bound time (each piece copies every absent expert once)
    of_pcie: float | None = None  # pcie_s / ttft_s


TTFT_REPS = 3  # timed prefills per prompt length (the median is reported): one run moves by up to ~35% offloaded


def _prefill(engine, sparsity: float, prompt: list[int], progress, h2d: float) -> PrefillRow:
    """Time to first token of `prompt`: a warm-up call (first-call costs not counted), then the median of TTFT_REPS
    timed calls. Offloaded, against the PCIe ceiling: pieces of `engine.prefill_chunk` tokens, each moving every
    expert part absent from VRAM once (`cache.absent_bytes()`; prefill admits nothing) at the measured pinned
    bandwidth `h2d`."""
    if engine.sparsity != sparsity:
        engine.set_sparsity(sparsity, progress)
    timed = []
    for rep in range(1 + TTFT_REPS):
        for _ in engine.generate(prompt, GenerationSettings(max_new_tokens=1)):
            pass
        if rep:
            timed.append((engine.stats.ttft_s, engine.stats.prefill_tok_s))
    ttft, tok_s = sorted(timed)[len(timed) // 2]
    absent = getattr(engine.loaded.cache, "absent_bytes", None)
    if absent is None or not h2d:
        return PrefillRow(len(prompt), sparsity, tok_s, ttft)
    pcie = -(-len(prompt) // engine.prefill_chunk) * absent() / h2d
    return PrefillRow(len(prompt), sparsity, tok_s, ttft, pcie, pcie / max(ttft, 1e-9))


def step_bytes(engine, sparsity: float) -> float:
    """Bytes one decode step must read: every non-expert weight except the embedding table (one row; all of it when
    lm_head shares it), plus the k routed experts' gate rows (dense) and their kept up/down rows per MoE layer
    (model_facts.step_floor, as `localmoe show` reports it)."""

    f = model_facts.facts(engine.model, engine.loaded.config, engine.loaded.experts)
    w = engine.loaded.experts[0].weights  # DeaMoE: a department's [h, H] matrices (f.expert_width = h)
    matrix = f.expert_width * f.hidden * w.w_gate.element_size()
    need = model_facts.step_floor(f, matrix, sparsity)
    preds = [getattr(m, "predictor", None) for m in engine.loaded.experts]
    if sparsity and preds and all(p is not None and p.candidate_share is not None for p in preds):
        # the gate predictor: B_d per touched department, C_e and the candidates' gate rows instead of whole gates
        need += sum(predicted.routed_gate_bytes(p, matrix, f.top_k) - f.top_k * matrix for p in preds)
    return need


def _run(engine, sparsity, prompt, n_decode, name, bw, progress, penalty: float = 1.0) -> BenchRow:
    if engine.sparsity != sparsity or engine._graph is None:
        engine.set_sparsity(sparsity, progress)
    settings = GenerationSettings(max_new_tokens=n_decode, repetition_penalty=penalty)
    eos = engine.eos_ids
    engine.eos_ids = set()  # decode the full length
    try:
        # warm-up at the measured prompt length (first-call costs of the prefill's shapes) and graph capture
        for _ in engine.generate(prompt, GenerationSettings(max_new_tokens=8, repetition_penalty=penalty)):
            pass
        for _ in engine.generate(prompt, settings):
            pass
    finally:
        engine.eos_ids = eos
    st = engine.stats
    need = step_bytes(engine, sparsity)
    floor = bw / need if bw else 0.0
    return BenchRow(
        name=name,
        sparsity=sparsity,
        prefill_tok_s=st.prefill_tok_s,
        decode_tok_s=st.decode_tok_s,
        peak_gpu_mem_gb=st.peak_gpu_mem_gb,
        floor_tok_s=floor,
        fraction_of_floor=(st.decode_tok_s / floor) if floor else 0.0,
        sparsity_realized=st.sparsity_realized,
        graph=engine._graph is not None,
        cache_hit_rate=st.cache_hit_rate,
        h2d_mb_per_token=None if st.h2d_bytes_per_token is None else st.h2d_bytes_per_token / 1e6,
        repetition_penalty=penalty,
        step_mb=need / 1e6,
        department_hit_rate=getattr(st, "department_hit_rate", None),
        private_hit_rate=getattr(st, "private_hit_rate", None),
    )


def _empty_host_cache() -> None:
    """Hand freed pinned host memory back to the OS (torch caches it like device memory); no-op where unsupported."""
    fn = getattr(torch._C, "_accelerator_emptyHostCache", None) or getattr(torch._C, "_host_emptyCache", None)
    if fn is not None:
        try:
            fn()
        except RuntimeError:  # no accelerator
            pass


def bench(
    model: str | None,
    *,
    shape: str | None,
    sparsities: list[float] | None,
    device: str | None,
    dtype: str | None,
    prompt_tokens: int | list[int] = 512,
    decode_tokens: int = 256,
    baseline: str | None = None,
    graphs: bool = True,
    vram_gib: float | None = None,
    fused: bool = True,
    offload_miss: str = "auto",
    routing: str = "uniform",
    context: int | None = None,
    progress=None,
    experts: str = "full",
    repetition_penalty: float | None = None,
    departments: int | list[int] = 0,
    rank: int | None = None,
    embeddings: str | None = None,
    z_sparsity: float = 0.0,
) -> dict:
    """`departments`: the gate predictor's department count, or a list of them measured in turn on the same engine
    (0: today's exact sparse path; each count > 0 adds a row per sparsity > 0 named after it). `z_sparsity`:
    DeaMoE's second threshold on the sparse rows (Engine.set_z_sparsity)."""

    if routing != "uniform" and not shape:
        raise UsageError("--routing needs --shape: it sets random weights' routers; a real model routes as trained")
    if baseline == "accelerate" and vram_gib is None:
        raise UsageError("--baseline accelerate needs --vram (the budget accelerate places the model under)")
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    lengths = sorted(set(prompt_tokens)) if isinstance(prompt_tokens, list) else [prompt_tokens]
    prompt_tokens = lengths[0]  # decode after the shortest; given several, each one's time to first token
    timed_lengths = lengths if len(lengths) > 1 else []
    t0 = time.perf_counter()
    note = progress and (lambda s: progress(f"note: {s}", 0, None))
    context = context or max(lengths[-1] + 1, prompt_tokens + decode_tokens) + 64
    if context < max(lengths[-1] + 1, prompt_tokens + decode_tokens):
        raise UsageError(
            f"--context {context} is shorter than the longest --prompt-tokens ({lengths[-1]}) or the shortest plus "
            f"--decode-tokens ({prompt_tokens + decode_tokens})"
        )
    if shape:
        engine = Engine.random(
            shape,
            device=dev,
            dtype=dt,
            vram_gib=vram_gib,
            context=context,
            on_notice=note,
            fused=fused,
            offload_miss=offload_miss,
            routing=routing,
            experts=experts,
            embeddings=embeddings,
        )
    else:
        engine = Engine.load(
            model,
            device=device,
            dtype=dtype,
            sparsity=0.0,
            progress=progress,
            vram_gib=vram_gib,
            context=context,
            on_notice=note,
            fused=fused,
            offload_miss=offload_miss,
            experts=experts,
            embeddings=embeddings,
        )
    counts = departments if isinstance(departments, list) else [departments]
    engine.set_departments(counts[0], rank)  # the gate predictor on the sparse rows (fitted when they calibrate)
    engine.set_z_sparsity(z_sparsity)  # DeaMoE: τ_z on the sparse rows (calibrated with them)
    default = engine.resolved.default_sparsity
    if dev.type == "cuda":
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    engine.use_graphs = engine.use_graphs and graphs and dev.type == "cuda"
    if sparsities is None:
        sparsities = sorted({0.0, default if default is not None else 0.5})
    gen = torch.Generator().manual_seed(0)
    vocab = engine.loaded.config.vocab_size
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist()
    bw = copy_bandwidth(dev)
    penalties = [1.0] + ([repetition_penalty] if repetition_penalty not in (None, 1.0) else [])
    rows = []
    for n in counts:
        r = rank or (n and predictor.default_rank(engine.loaded.experts[0].hidden_size))
        name = f"localmoe, predictor {n}x{r}" if n else "localmoe"
        engine.set_departments(n, rank)  # fitted and applied by the next set_sparsity (_run's)
        for s in sparsities:
            if n and not s:
                continue  # the predictor only acts on the sparse path: its dense row is the plain one
            rows += [_run(engine, s, prompt, decode_tokens, name, bw, progress, p) for p in penalties]
    h2d = host_bandwidth(dev) if timed_lengths and engine.loaded.cache is not None else 0.0
    prefills = [
        _prefill(engine, s, torch.randint(0, vocab, (n,), generator=gen).tolist(), progress, h2d)
        for n in timed_lengths
        for s in sparsities
    ]
    config = engine.loaded.config
    name = engine.model_name
    experts_format = engine.experts_format
    chunk, fit = engine.prefill_chunk, engine.prefill_fit
    del engine
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        _empty_host_cache()  # the offloaded experts' pinned master copies: the baseline needs that RAM
        torch.cuda.reset_peak_memory_stats(dev)
    if baseline == "transformers":
        rows.append(transformers_baseline(config, dev, dt, prompt, min(decode_tokens, 64), "grouped_mm"))
    elif baseline == "accelerate":
        rows.append(accelerate_baseline(config, dev, dt, prompt, min(decode_tokens, 4), vram_gib))
    return {
        "model": name,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(dt).replace("torch.", ""),
        "load_s": load_s,
        "copy_gb_s": bw / 1e9,
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "context": context,
        "routing": routing,
        "experts": experts_format,
        "departments": counts if len(counts) > 1 else counts[0],
        "z_sparsity": z_sparsity,
        "rows": [asdict(r) for r in rows],
        "prefill_rows": [asdict(r) for r in prefills],
        "host_to_device_gb_s": h2d / 1e9,
        "prefill_chunk": chunk,
        "staging_span": fit.span if fit is not None else None,
        "dequant_bytes": fit.dequant_bytes if fit is not None else None,
        "prefill_fit": fit.line() if fit is not None else f"prefill pieces of up to {chunk} tokens (no VRAM budget)",
    }


def table(result: dict) -> str:
    lines = [
        f"{result['model']} on {result['device']} ({result['dtype']}), load {result['load_s']:.1f} s, "
        f"copy bandwidth {result['copy_gb_s']:.0f} GB/s, prompt {result['prompt_tokens']}, "
        f"decode {result['decode_tokens']}, context {result.get('context', '?')}"
        + (f", {result['routing']} routing" if result.get("routing", "uniform") != "uniform" else "")
        + (f", {result['experts']} experts" if result.get("experts", "full") != "full" else "")
        + (
            f", gate predictor with {result['departments']} departments"
            if result.get("departments") and not isinstance(result["departments"], list)
            else ""
        )
        + (f", z sparsity {result['z_sparsity']:.0%}" if result.get("z_sparsity") else ""),
        f"{'engine':<34} {'sparsity':>8} {'prefill tok/s':>13} {'decode tok/s':>12} {'step MB':>8} {'floor tok/s':>11} "
        f"{'of floor':>8} {'realised':>8} {'peak GB':>8}",
    ]
    if result.get("prefill_fit"):
        lines.insert(1, result["prefill_fit"])
    for r in result["rows"]:
        name = (
            r["name"]
            + (" [graph]" if r.get("graph") else "")
            + (f" rep.pen. {r['repetition_penalty']:g}" if r.get("repetition_penalty", 1.0) != 1.0 else "")
        )
        floor = (
            f"{r['floor_tok_s']:>11.0f} {r['fraction_of_floor']:>8.1%} "
            if r["floor_tok_s"] > 0
            else f"{'–':>11} {'–':>8} "
        )  # baselines and CPU rows have no byte floor
        step = f"{r.get('step_mb', 0.0):>8.0f} " if r["floor_tok_s"] > 0 else f"{'–':>8} "
        dept = (
            f" (departments {r['department_hit_rate']:.0%}, private {r['private_hit_rate']:.0%})"
            if r.get("department_hit_rate") is not None
            else ""
        )
        lines.append(
            f"{name:<34} {r['sparsity']:>8.0%} {r['prefill_tok_s']:>13.1f} {r['decode_tok_s']:>12.1f} "
            + step
            + floor
            + (f"{r['sparsity_realized']:>8.1%} " if r["name"].startswith("localmoe") else f"{'–':>8} ")
            + f"{r['peak_gpu_mem_gb']:>8.1f}"
            + (
                f"  cache {r['cache_hit_rate']:.0%} hits{dept}, {r['h2d_mb_per_token']:.0f} MB/token H2D"
                if r.get("cache_hit_rate") is not None
                else ""
            )
        )
    if result.get("prefill_rows"):
        h2d = result.get("host_to_device_gb_s") or 0.0
        lines.append(
            f"time to first token (median of {TTFT_REPS})"
            + (
                f"; pinned host→GPU {h2d:.1f} GB/s, PCIe-bound time: absent experts' bytes per piece / that"
                if h2d
                else ""
            )
        )
        lines.append(
            f"{'prompt':>8} {'sparsity':>8} {'prefill tok/s':>13} {'first token s':>13} {'PCIe s':>8} {'of PCIe':>8}"
        )
        for r in result["prefill_rows"]:
            pcie = f"{r['pcie_s']:>8.2f} {r['of_pcie']:>8.1%}" if r.get("pcie_s") is not None else f"{'–':>8} {'–':>8}"
            lines.append(
                f"{r['prompt_tokens']:>8} {r['sparsity']:>8.0%} {r['prefill_tok_s']:>13.1f} {r['ttft_s']:>13.2f} "
                + pcie
            )
    return "\n".join(lines)
