"""The `localmoe` command's parser: `build_parser()`, the flag groups the subcommands share (engine, experts,
sampling), and the validators that turn a bad value into a one-line usage error (exit 2).
"""

from __future__ import annotations

import argparse
import math

from localmoe import __version__
from localmoe.errors import UsageError

SEED_MAX = (1 << 64) - 1  # torch.Generator.manual_seed takes [-2**63, 2**64 - 1]; localmoe takes the unsigned range
CONTEXT_MAX = 1 << 24  # tokens
VRAM_MAX_GIB = 65536.0


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
        if kind is float and not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{what} must be a finite number, got {value}")
        if lo is not None and (v <= lo if lo_open else v < lo) or hi is not None and v > hi:
            bound = f"{'>' if lo_open else '>='} {lo}" + (f" and <= {hi}" if hi is not None else "")
            raise argparse.ArgumentTypeError(f"{what} must be {bound}, got {value}")
        return v

    return parse


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _add_experts_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--experts",
        choices=["full", "int4"],
        default="full",
        help="routed experts' weights: full (the model's dtype, offloaded when they do not fit) or int4 "
        "(4-bit, groups of 128 with a bf16 scale and minimum; ~3.8x smaller, all kept in VRAM: "
        "Qwen3.5-35B-A3B fits a 24 GB card)",
    )


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    _add_experts_flag(p)
    p.add_argument(
        "--sparsity",
        type=_sparsity,
        default=None,
        help="decode sparsity target in [0,1); 0 or 'off' = dense (default: the model's, from models.toml)",
    )
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto", help="default: cuda when present")
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="default: bfloat16 on GPU, float32 on CPU",
    )
    p.add_argument("--calibration-text", metavar="FILE", default=None, help="text to calibrate thresholds on")
    p.add_argument(
        "--vram",
        type=_ranged(float, 0.0, VRAM_MAX_GIB, lo_open=True, what="--vram"),
        default=None,
        metavar="GiB",
        help="GPU memory budget; experts that do not fit are offloaded to host memory behind "
        "a GPU cache (default: what the card has free minus 1 GiB)",
    )
    p.add_argument(
        "--host-storage",
        choices=["auto", "pinned", "mmap"],
        default="auto",
        help="offloaded experts' master copies: auto (default) = pinned host memory, or memory-mapped "
        "files under the cache dir when the RAM cannot hold them; mmap forces the files",
    )
    p.add_argument(
        "--context",
        type=_ranged(int, 16, CONTEXT_MAX, what="--context"),
        default=None,
        help="context length in tokens, prompt + reply (default 8192 or the model's maximum)",
    )


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=_ranged(int, 1, what="--max-new-tokens"), default=512)
    p.add_argument(
        "--temperature",
        type=_ranged(float, 0.0, 10.0, what="--temperature"),
        default=None,
        help="0 = greedy (default: the model's generation_config.json; greedy when it does not sample)",
    )
    p.add_argument(
        "--top-p",
        type=_ranged(float, 0.0, 1.0, lo_open=True, what="--top-p"),
        default=None,
        help="default: the model's (else 1 = off)",
    )
    p.add_argument("--top-k", type=_ranged(int, 0, what="--top-k"), default=None, help="0 = off (default: the model's)")
    p.add_argument(
        "--repeat-penalty",
        dest="repeat_penalty",
        metavar="P",
        type=_ranged(float, 0.0, 10.0, lo_open=True, what="--repeat-penalty"),
        default=None,
        help="repetition penalty over the prompt and reply so far, as transformers' (1 = off; default: the model's)",
    )
    p.add_argument(
        "--stop",
        metavar="STRING",
        action="append",
        default=None,
        help="end the reply at this text (not printed); repeat for several",
    )
    p.add_argument(
        "--seed", type=_ranged(int, 0, SEED_MAX, what="--seed"), default=None, help=f"sampling seed in [0, {SEED_MAX}]"
    )
    p.add_argument("--system", metavar="TEXT", default=None, help="system prompt (not with --raw)")
    p.add_argument(
        "--think",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a thinking model's reasoning before the answer: --think / --no-think set the chat "
        "template's enable_thinking (default: the template's)",
    )


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
    p.add_argument(
        "--raw", action="store_true", help="encode the prompt as is, without the chat template (so no --system)"
    )
    p.add_argument(
        "--show-reasoning",
        action="store_true",
        help="stream a thinking model's reasoning on stderr (stdout gets the answer only)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (exact text and reasoning, token ids, stats) instead of streaming",
    )
    p.add_argument("--quiet", action="store_true", help="no plan line or stats line on stderr")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    p = sub.add_parser("show", help="what a model needs, from its config alone (no weights downloaded)")
    p.add_argument("model", metavar="MODEL", help="alias (localmoe models), hub repo id, or local directory")
    p.add_argument(
        "--vram",
        type=_ranged(float, 0.0, VRAM_MAX_GIB, lo_open=True, what="--vram"),
        default=None,
        metavar="GiB",
        help="the GPU budget to plan for (default: what this machine's card has free minus 1 GiB; none without a GPU)",
    )
    _add_experts_flag(p)
    p.add_argument(
        "--context",
        type=_ranged(int, 16, CONTEXT_MAX, what="--context"),
        default=None,
        help="context to size the KV/state for (default 8192 or the model's maximum)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object, numbers as numbers (bytes, parameters)")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    p = sub.add_parser("chat", help="open the terminal chat")
    p.add_argument("model", metavar="MODEL", nargs="?", default=None, help="default: the bundled localmoe-tiny")
    _add_engine_flags(p)
    _add_sampling_flags(p)
    p.add_argument("--continue", dest="continue_last", action="store_true", help="resume the last session")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    p = sub.add_parser("eval", help="perplexity and agreement with dense, per sparsity")
    p.add_argument("model", metavar="MODEL")
    p.add_argument(
        "--sparsity",
        type=_sparsity_list,
        default=[0.0, 0.5, 0.7, 0.85, 0.9],
        help="comma-separated list (default 0,0.5,0.7,0.85,0.9)",
    )
    p.add_argument("--text", metavar="FILE", default=None, help="default: the held-out split shipped with localmoe")
    p.add_argument("--tokens", type=_ranged(int, 16, what="--tokens"), default=16384)
    p.add_argument("--window", type=_ranged(int, 16, what="--window"), default=512)
    p.add_argument("--tasks", default=None, help="lm-eval tasks (needs the optional lm-eval extra)")
    p.add_argument("--limit", type=_ranged(int, 1, what="--limit"), default=None, help="lm-eval: examples per task")
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
    p.add_argument(
        "--context",
        type=_ranged(int, 16, CONTEXT_MAX, what="--context"),
        default=None,
        help="KV cache length (default: prompt + decode + 64; chat and run default to 8192)",
    )
    p.add_argument(
        "--baseline",
        choices=["transformers", "accelerate"],
        default=None,
        help="stock generate in the same run; 'accelerate' offloads with device_map/max_memory (needs --vram)",
    )
    p.add_argument("--no-graph", action="store_true", help="decode eagerly (no CUDA graph)")
    p.add_argument(
        "--vram",
        type=_ranged(float, 0.0, VRAM_MAX_GIB, lo_open=True, what="--vram"),
        default=None,
        metavar="GiB",
        help="GPU memory budget (experts beyond it are offloaded)",
    )
    p.add_argument(
        "--routing",
        choices=["uniform", "skewed"],
        default="uniform",
        help="random weights: how the router spreads tokens (uniform = pessimistic for the expert cache)",
    )
    p.add_argument(
        "--repeat-penalty",
        dest="repeat_penalty",
        metavar="P",
        type=_ranged(float, 0.0, 10.0, lo_open=True, what="--repeat-penalty"),
        default=None,
        help="also decode with this repetition penalty: a row with it after each row without (same run)",
    )
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
    _add_experts_flag(p)
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return parser
