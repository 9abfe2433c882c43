"""The `localmoe` command line: argument parsing, error reporting, and the `run`/`models`/`pull`/`calibrate`/`chat`
subcommands. Heavy imports (torch, transformers) happen inside the subcommands, so `--help` and `models` stay fast.

Errors a user can meet print one line, `localmoe: error: ...`, on stderr: exit 2 for bad input, 1 for runtime
failures; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from localmoe import __version__
from localmoe.errors import LocalmoeError, UsageError


def _sparsity(value: str) -> float:
    if value.strip().lower() in {"off", "none", "dense"}:
        return 0.0
    try:
        s = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1) or 'off', got {value!r}") from None
    if not 0.0 <= s < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1) (0 or 'off' = dense), got {value}")
    return s


def _sparsity_list(value: str) -> list[float]:
    items = [v for v in value.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError("give at least one sparsity")
    return sorted({_sparsity(v) for v in items})


def _ranged(kind, lo=None, hi=None, lo_open=False, what="value"):
    def parse(value: str):
        try:
            v = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {value!r}") from None
        if lo is not None and (v <= lo if lo_open else v < lo) or hi is not None and v > hi:
            bound = f"{'>' if lo_open else '>='} {lo}" + (f" and <= {hi}" if hi is not None else "")
            raise argparse.ArgumentTypeError(f"{what} must be {bound}, got {value}")
        return v

    return parse


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _add_experts_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experts", choices=["full", "int4"], default="full",
                   help="routed experts' weights: full (the model's dtype, offloaded when they do not fit) or int4 "
                        "(4-bit, groups of 128 with a bf16 scale and minimum; ~3.8x smaller, all kept in VRAM: "
                        "Qwen3.5-35B-A3B fits a 24 GB card)")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    _add_experts_flag(p)
    p.add_argument("--sparsity", type=_sparsity, default=None,
                   help="decode sparsity target in [0,1); 0 or 'off' = dense (default: the model's, from models.toml)")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto", help="default: cuda when present")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--calibration-text", metavar="FILE", default=None, help="text to calibrate thresholds on")
    p.add_argument("--vram", type=_ranged(float, 0.0, lo_open=True, what="--vram"), default=None, metavar="GiB",
                   help="GPU memory budget; experts that do not fit are offloaded to host memory behind a GPU cache "
                        "(default: what the card has free minus 1 GiB)")
    p.add_argument("--offload-miss", choices=["auto", "copy", "direct", "cpu"], default="auto",
                   help="offloaded expert misses: auto (default) = direct on CUDA with pinned memory, else copy; "
                        "direct reads the gate rows and kept rows straight from pinned host memory inside the CUDA "
                        "graph (3.5x copy on the H200); copy copies the expert into the cache then computes; cpu "
                        "computes misses on the CPU")
    p.add_argument("--host-storage", choices=["auto", "pinned", "mmap"], default="auto",
                   help="offloaded experts' master copies: auto (default) = pinned host memory, or memory-mapped "
                        "files under the cache dir when the RAM cannot hold them; mmap forces the files")
    p.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True,
                   help="localmoe's fused decode kernels on CUDA (RMSNorm, Gated DeltaNet step, router, shared expert); "
                        "--no-fused keeps transformers' modules")
    p.add_argument("--context", type=_ranged(int, 16, what="--context"), default=None,
                   help="context length in tokens, prompt + reply (default 8192 or the model's maximum)")


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=_ranged(int, 1, what="--max-new-tokens"), default=512)
    p.add_argument("--temperature", type=_ranged(float, 0.0, 10.0, what="--temperature"), default=0.0,
                   help="0 = greedy (default)")
    p.add_argument("--top-p", type=_ranged(float, 0.0, 1.0, lo_open=True, what="--top-p"), default=1.0)
    p.add_argument("--top-k", type=_ranged(int, 0, what="--top-k"), default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--system", metavar="TEXT", default=None, help="system prompt")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="localmoe", description="Run Mixture-of-Experts LLMs on one desktop GPU, sparse.")
    parser.add_argument("--version", action="version", version=f"localmoe {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("run", help="generate a reply to one prompt, streamed to stdout")
    p.add_argument("model", metavar="MODEL", help="alias (localmoe models), hub repo id, or local directory")
    p.add_argument("prompt", metavar="PROMPT", nargs="?", default="-", help="the prompt; '-' or absent reads stdin")
    _add_engine_flags(p)
    _add_sampling_flags(p)
    p.add_argument("--raw", action="store_true", help="encode the prompt as is, without the chat template")
    p.add_argument("--json", action="store_true", help="end stdout with one JSON object (text, token ids, stats)")
    p.add_argument("--quiet", action="store_true", help="no stats line on stderr")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    p = sub.add_parser("chat", help="open the terminal chat")
    p.add_argument("model", metavar="MODEL", nargs="?", default=None, help="default: the bundled localmoe-tiny")
    _add_engine_flags(p)
    _add_sampling_flags(p)
    p.add_argument("--continue", dest="continue_last", action="store_true", help="resume the last session")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    p = sub.add_parser("eval", help="perplexity and agreement with dense, per sparsity")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--sparsity", type=_sparsity_list, default=[0.0, 0.5, 0.7, 0.85, 0.9],
                   help="comma-separated list (default 0,0.5,0.7,0.85,0.9)")
    p.add_argument("--text", metavar="FILE", default=None, help="default: the held-out split shipped with localmoe")
    p.add_argument("--tokens", type=_ranged(int, 16, what="--tokens"), default=16384)
    p.add_argument("--window", type=_ranged(int, 16, what="--window"), default=512)
    p.add_argument("--threshold-mode", choices=["layer", "expert"], default="layer",
                   help="one threshold per layer (default) or per expert")
    p.add_argument("--tasks", default=None, help="lm-eval tasks (needs the optional lm-eval extra)")
    p.add_argument("--limit", type=int, default=None, help="lm-eval: examples per task")
    p.add_argument("--include-path", default=None, help="lm-eval: folder with extra task YAMLs")
    _add_experts_flag(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    p = sub.add_parser("bench", help="load time, prefill and decode tok/s, memory, byte floor")
    p.add_argument("model", metavar="MODEL", nargs="?", default=None)
    p.add_argument("--shape", metavar="ALIAS", default=None, help="random weights with this registry model's config")
    _add_experts_flag(p)
    p.add_argument("--sparsity", type=_sparsity_list, default=None, help="default: 0 and the model's default")
    p.add_argument("--prompt-tokens", type=_ranged(int, 1, what="--prompt-tokens"), default=512)
    p.add_argument("--decode-tokens", type=_ranged(int, 2, what="--decode-tokens"), default=256)
    p.add_argument("--context", type=_ranged(int, 16, what="--context"), default=None,
                   help="KV cache length (default: prompt + decode + 64; chat and run default to 8192)")
    p.add_argument("--baseline", choices=["transformers", "accelerate"], default=None,
                   help="stock generate in the same run; 'accelerate' offloads with device_map/max_memory (needs --vram)")
    p.add_argument("--no-graph", action="store_true", help="decode eagerly (no CUDA graph)")
    p.add_argument("--compile", action="store_true", help="torch.compile the step before capturing it (experimental)")
    p.add_argument("--vram", type=_ranged(float, 0.0, lo_open=True, what="--vram"), default=None, metavar="GiB",
                   help="GPU memory budget (experts beyond it are offloaded)")
    p.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True,
                   help="fused decode kernels on CUDA (default on; --no-fused: transformers' modules)")
    p.add_argument("--offload-miss", choices=["auto", "copy", "direct", "cpu"], default="auto")
    p.add_argument("--routing", choices=["uniform", "skewed"], default="uniform",
                   help="random weights: how the router spreads tokens (uniform = pessimistic for the expert cache)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    p = sub.add_parser("models", help="list the registry's models")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("pull", help="download a model into the Hugging Face cache")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    p = sub.add_parser("calibrate", help="compute (and cache) sparsity thresholds for a model")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--sparsity", type=_sparsity, required=True)
    p.add_argument("--text", metavar="FILE", default=None, help="calibration text (default: bundled)")
    p.add_argument("--tokens", type=_ranged(int, 16, what="--tokens"), default=None)
    p.add_argument("--threshold-mode", choices=["layer", "expert"], default="layer")
    _add_experts_flag(p)
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        if args.command is None:
            build_parser().print_help()
            return 2
        if not debug:
            _quiet_libraries()
        handler = {"run": cmd_run, "chat": cmd_chat, "models": cmd_models, "pull": cmd_pull,
                   "calibrate": cmd_calibrate, "eval": cmd_eval,
                   "bench": cmd_bench}[args.command]
        return handler(args)
    except LocalmoeError as e:
        if debug:
            raise
        print(f"localmoe: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("localmoe: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - last resort: one line unless --debug
        if debug:
            raise
        if type(e).__name__ == "OutOfMemoryError":
            print("localmoe: error: out of GPU memory: use --device cpu or a smaller model", file=sys.stderr)
            return 1
        first = str(e).splitlines()[0] if str(e) else ""
        print(f"localmoe: error: {type(e).__name__}: {first} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1


def _quiet_libraries() -> None:
    """Library chatter (fallback notices, deprecations) is for --debug; users see localmoe's own lines."""
    import logging
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    logging.getLogger("transformers").setLevel(logging.ERROR)


# -- subcommands -------------------------------------------------------------------------------------------
def _stderr_progress():
    """A ProgressFn drawing one updating line per stage on stderr (only on a terminal)."""
    state = {"stage": None}
    tty = sys.stderr.isatty()

    def progress(stage: str, done: int, total: int | None) -> None:
        if stage == "download" or not tty:
            return  # huggingface_hub draws its own bars
        if state["stage"] not in (None, stage):
            sys.stderr.write("\n")
        state["stage"] = stage
        frac = f"{done}/{total}" if total else str(done)
        sys.stderr.write(f"\r{stage:>10}: {frac}")
        if total and done >= total:
            sys.stderr.write("\n")
            state["stage"] = None
        sys.stderr.flush()

    return progress


def _settings(args):
    from localmoe.events import GenerationSettings

    return GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed)


def _load_engine(args, progress=None):
    from localmoe.engine import Engine

    quiet = progress is not None or getattr(args, "quiet", False)
    notice = None if quiet else (lambda text: print(f"localmoe: note: {text}", file=sys.stderr))
    return Engine.load(args.model, device=args.device, dtype=args.dtype, sparsity=args.sparsity,
                       progress=progress or _stderr_progress(), calibration_text=args.calibration_text,
                       vram_gib=args.vram, context=args.context, on_notice=notice, fused=args.fused,
                       offload_miss=args.offload_miss, host_storage=args.host_storage, experts=args.experts)


def cmd_run(args) -> int:
    prompt = args.prompt
    if prompt == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise UsageError("no prompt: pass PROMPT or pipe it on stdin")
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise UsageError("the prompt is empty: give some text")
    engine = _load_engine(args)
    if args.raw:
        ids = engine.encode_raw(prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        ids = engine.encode_chat(messages + [{"role": "user", "content": prompt}])
    text, token_ids = [], []
    for ev in engine.generate(ids, _settings(args)):
        token_ids.append(ev.token_id)
        text.append(ev.text)
        if not args.json:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
    stats = engine.stats
    if args.json:
        sys.stdout.write(json.dumps({"model": engine.model_name, "text": "".join(text), "token_ids": token_ids,
                                     "stats": _stats_json(stats)}) + "\n")
    else:
        sys.stdout.write("\n")
        if not args.quiet:
            print(_stats_line(stats, engine), file=sys.stderr)
    sys.stdout.flush()
    return 0


def _stats_json(stats) -> dict:
    keys = ("prompt_tokens", "generated_tokens", "prefill_tok_s", "decode_tok_s", "sparsity_target",
            "sparsity_realized", "peak_gpu_mem_gb", "cache_hit_rate", "h2d_bytes_per_token", "finish_reason")
    d = stats.as_json()
    return {k: d.get(k) for k in keys}


def _stats_line(stats, engine) -> str:
    return (f"[{engine.model_name} on {engine.device}] prompt {stats.prompt_tokens} tok, "
            f"{stats.prefill_tok_s:.1f} tok/s prefill | {stats.generated_tokens} tok, {stats.decode_tok_s:.1f} tok/s decode"
            f" | sparsity {stats.sparsity_target:.0%} target, {stats.sparsity_realized:.1%} realised"
            + (f" | peak GPU {stats.peak_gpu_mem_gb:.2f} GB" if stats.peak_gpu_mem_gb else "")
            + (f" | expert cache {stats.cache_hit_rate:.0%} hits, {stats.h2d_bytes_per_token / 1e6:.1f} MB/token copied"
               if stats.cache_hit_rate is not None else ""))


def cmd_models(args) -> int:
    from localmoe.hub import is_downloaded
    from localmoe.registry import load_registry

    reg = load_registry()
    rows = [(s.alias + (" (default)" if s.alias == reg.default else ""), s.repo, f"{s.bf16_gb:g} GB",
             f"{s.sparsity:.1%}", "yes" if is_downloaded(s) else "no") for s in reg.models.values()]
    if args.json:
        print(json.dumps([dict(zip(("alias", "repo", "bf16_size", "default_sparsity", "downloaded"), r)) for r in rows]))
        return 0
    head = ("ALIAS", "REPO", "BF16 SIZE", "SPARSITY", "DOWNLOADED")
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for r in (head, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip())
    return 0


def cmd_pull(args) -> int:
    from localmoe import hub

    resolved = hub.resolve(args.model, download_missing=True)
    print(f"{resolved.name}: {resolved.path}")
    return 0


def cmd_calibrate(args) -> int:
    from localmoe import sparsity as sp
    from localmoe.engine import Engine

    if args.sparsity == 0.0:
        raise UsageError("--sparsity 0 is the dense path and needs no calibration")
    engine = Engine.load(args.model, device=args.device, dtype=args.dtype, sparsity=0.0, progress=_stderr_progress(),
                         experts=args.experts)
    table = sp.thresholds_for(engine, args.sparsity, progress=_stderr_progress(), text=args.text,
                              tokens=args.tokens or sp.DEFAULT_TOKENS, force=True, mode=args.threshold_mode)
    path = sp.cache_path(engine.model_name, engine.resolved.revision, args.sparsity, args.threshold_mode,
                         engine.experts_format)
    print(f"calibrated {engine.model_name} at sparsity {args.sparsity:.1%} on {table.meta.get('tokens')} tokens "
          f"of {table.meta['calibration_set']}: thresholds saved to {path}")
    return 0


def cmd_chat(args) -> int:
    from localmoe.registry import load_registry

    model = args.model or load_registry().default
    if not model:
        raise UsageError("no default model: pass MODEL (see `localmoe models`)")
    args.model = model
    from localmoe.tui.app import run_chat

    return run_chat(lambda progress: _load_engine(args, progress), model_label=model, settings=_settings(args),
                    sparsity=args.sparsity, system=args.system, continue_last=args.continue_last)


def cmd_eval(args) -> int:
    from localmoe.engine import Engine

    engine = Engine.load(args.model, device=args.device, dtype=args.dtype, sparsity=0.0, progress=_stderr_progress(),
                         experts=args.experts)
    engine.threshold_mode = args.threshold_mode
    if args.tasks:
        from localmoe.harness import run_tasks

        results = run_tasks(engine, args.tasks.split(","), args.sparsity, limit=args.limit,
                            include_path=args.include_path, progress=_stderr_progress())
        print(json.dumps(results) if args.json else results["table"])
        return 0
    from localmoe.evaluate import evaluate

    report = evaluate(engine, args.sparsity, text=args.text, tokens=args.tokens, window=args.window,
                      progress=_stderr_progress())
    print(json.dumps(report.as_json()) if args.json else report.table())
    return 0


def cmd_bench(args) -> int:
    from localmoe.benchmark import bench, table

    if not args.model and not args.shape:
        raise UsageError("give MODEL or --shape ALIAS (random weights with that model's config)")
    result = bench(args.model, shape=args.shape, sparsities=args.sparsity, device=args.device, dtype=args.dtype,
                   prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens, context=args.context,
                   baseline=args.baseline,
                   graphs=not args.no_graph, compile=args.compile, vram_gib=args.vram, fused=args.fused,
                   offload_miss=args.offload_miss, routing=args.routing, experts=args.experts,
                   progress=_stderr_progress())
    print(json.dumps(result) if args.json else table(result))
    return 0
