"""The flags the subcommands share and the values they take: the flag groups (engine, sampling, device, experts,
--vram, --context, --json, --debug), each help stating its default, and the validators that turn a bad value into a
one-line usage error (exit 2) through `Parser.error`.
"""

from __future__ import annotations

import argparse
import math

from localmoe.errors import UsageError

SEED_MAX = (1 << 64) - 1  # torch.Generator.manual_seed takes [-2**63, 2**64 - 1]; localmoe takes the unsigned range
CONTEXT_MAX = 1 << 24  # tokens
VRAM_MAX_GIB = 65536.0


def sparsity(value: str) -> float:
    if value.strip().lower() in {"off", "none", "dense"}:
        return 0.0
    try:
        s = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1) or 'off', got {value!r}") from None
    if not 0.0 <= s < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1) (0 or 'off' = dense), got {value}")
    return s


def sparsity_list(value: str) -> list[float]:
    items = [v for v in value.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError("give at least one sparsity")
    return sorted({sparsity(v) for v in items})


def token_counts(value: str) -> list[int]:
    """`bench --prompt-tokens`: one token count or a comma-separated list of them (each at least 1)."""
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token counts such as 512 or 512,2048,8192, got {value!r}") from None
    if not items or min(items) < 1:
        raise argparse.ArgumentTypeError(f"--prompt-tokens must be >= 1, got {value}")
    return sorted(set(items))


def ranged(kind, lo=None, hi=None, lo_open=False, what="value"):
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


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def add_debug_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors (default: off)")


def add_json_flag(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--json", action="store_true", help=f"{what} (default: off)")


def add_device_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device", choices=["cpu", "cuda", "auto"], default="auto", help="(default: auto, cuda when present)"
    )
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="(default: bfloat16 on GPU, float32 on CPU)",
    )
    p.add_argument(
        "--embeddings",
        choices=["gpu", "host"],
        default=None,
        help="where the input token embedding table lives: host = pinned host memory, read one row per token by "
        "the GPU (its VRAM goes to the expert cache; a table tied to lm_head stays in VRAM), gpu = in VRAM "
        "(default: host)",
    )


def add_vram_flag(p: argparse.ArgumentParser, text: str) -> None:
    p.add_argument(
        "--vram",
        type=ranged(float, 0.0, VRAM_MAX_GIB, lo_open=True, what="--vram"),
        default=None,
        metavar="GiB",
        help=text,
    )


def add_context_flag(p: argparse.ArgumentParser, text: str) -> None:
    p.add_argument("--context", type=ranged(int, 16, CONTEXT_MAX, what="--context"), default=None, help=text)


EXPERTS_FORMATS = ("full", "int4", "nf4", "mxfp4")


def experts_list(value: str) -> list[str]:
    """`--experts` of eval and bench: one format or a comma-separated list, measured one after the other."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in EXPERTS_FORMATS]
    if not items or bad:
        got = ", ".join(repr(v) for v in bad) or "nothing"
        raise argparse.ArgumentTypeError(f"choose from {', '.join(EXPERTS_FORMATS)} (comma-separated), got {got}")
    return list(dict.fromkeys(items))


def add_experts_flag(p: argparse.ArgumentParser, many: bool = False) -> None:
    """`many`: a comma-separated list (eval, bench: each format measured in turn, one table each)."""
    p.add_argument(
        "--experts",
        **(dict(type=experts_list, default=["full"]) if many else dict(choices=EXPERTS_FORMATS, default="full")),
        help="routed experts' weights: full (the model's dtype, offloaded when they do not fit), int4 "
        "(4-bit, groups of 128 with a bf16 scale and minimum; ~3.8x smaller, all kept in VRAM: "
        "Qwen3.5-35B-A3B fits a 24 GB card) or nf4 (bitsandbytes' 4-bit NormalFloat, blocks of 64; what "
        "bnb-4bit checkpoints hold, which load as nf4); gpt-oss checkpoints' MXFP4 experts load as they are "
        "(full or mxfp4)" + ("; a comma-separated list measures each in turn" if many else "") + " (default: full)",
    )


def department_list(value: str) -> list[int]:
    """`eval --departments`: one count or a comma-separated list of them (each >= 0; 0 = the exact sparse path)."""
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected department counts such as 0,1,4,8, got {value!r}") from None
    if not items or min(items) < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = off), got {value}")
    return list(dict.fromkeys(items))


def add_predictor_flags(p: argparse.ArgumentParser, many: bool = False) -> None:
    """`--departments N` and `--rank R`: the department-shared gate predictor of the sparse path (issue #23)."""
    p.add_argument(
        "--departments",
        type=department_list if many else ranged(int, 0, what="--departments"),
        default=[0] if many else 0,
        metavar="N",
        help="experimental: predict each routed expert's gate from N department-shared low-rank bases and read "
        "only the predicted neurons' gate rows (0 = off: the exact sparse path"
        + ("; a comma-separated list scores each" if many else "")
        + ") (default: 0)",
    )
    p.add_argument(
        "--rank",
        type=ranged(int, 1, what="--rank"),
        default=None,
        metavar="R",
        help="the predictor's rank, at most the hidden size (default: 64, or the hidden size if smaller)",
    )


def add_z_sparsity_flag(p: argparse.ArgumentParser) -> None:
    """`--z-sparsity Q`: DeaMoE's second threshold (experts/thresholds.py)."""
    p.add_argument(
        "--z-sparsity",
        type=sparsity,
        default=0.0,
        metavar="Q",
        help="DeaMoE models: also drop the Q smallest shares of each department's down-projection input (z) on the "
        "sparse path and skip those W_down rows; fewer bytes read, some quality lost (0 = off) (default: 0)",
    )


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    add_experts_flag(p)
    p.add_argument(
        "--sparsity",
        type=sparsity,
        default=None,
        help="decode sparsity target in [0,1); 0 or 'off' = dense (default: the model's, from models.toml; "
        "0.5 for a model it does not list)",
    )
    add_device_flags(p)
    p.add_argument(
        "--calibration-text",
        metavar="FILE",
        default=None,
        help="text to calibrate sparsity thresholds on (default: the calibration text bundled with localmoe)",
    )
    add_vram_flag(
        p,
        "GPU memory budget; experts that do not fit are offloaded to host memory behind "
        "a GPU cache (default: what the card has free minus 1 GiB)",
    )
    p.add_argument(
        "--host-storage",
        choices=["auto", "pinned", "mmap"],
        default="auto",
        help="offloaded experts' master copies: auto = pinned host memory, or memory-mapped files under the "
        "cache dir when the RAM cannot hold them; pinned or mmap forces one (default: auto)",
    )
    add_context_flag(p, "context length in tokens, prompt + reply (default: 8192, or the model's maximum if smaller)")
    add_predictor_flags(p)
    add_z_sparsity_flag(p)


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-new-tokens",
        type=ranged(int, 1, what="--max-new-tokens"),
        default=512,
        help="the most tokens the reply may have (default: 512)",
    )
    p.add_argument(
        "--temperature",
        type=ranged(float, 0.0, 10.0, what="--temperature"),
        default=None,
        help="0 = greedy (default: the model's generation_config.json; greedy when it does not sample)",
    )
    p.add_argument(
        "--top-p",
        type=ranged(float, 0.0, 1.0, lo_open=True, what="--top-p"),
        default=None,
        help="nucleus sampling's probability mass (default: the model's generation_config.json, else 1 = off)",
    )
    p.add_argument(
        "--top-k",
        type=ranged(int, 0, what="--top-k"),
        default=None,
        help="0 = off (default: the model's generation_config.json, else off)",
    )
    p.add_argument(
        "--repeat-penalty",
        dest="repeat_penalty",
        metavar="P",
        type=ranged(float, 0.0, 10.0, lo_open=True, what="--repeat-penalty"),
        default=None,
        help="repetition penalty over the prompt and reply so far, as transformers' (1 = off; default: the "
        "model's generation_config.json, else off)",
    )
    p.add_argument(
        "--stop",
        metavar="STRING",
        action="append",
        default=None,
        help="end the reply at this text (not printed); repeat for several (default: none, the reply ends at the "
        "model's end token or --max-new-tokens)",
    )
    p.add_argument(
        "--seed",
        type=ranged(int, 0, SEED_MAX, what="--seed"),
        default=None,
        help=f"sampling seed in [0, {SEED_MAX}] (default: a fresh random seed for each reply)",
    )
    p.add_argument(
        "--system",
        metavar="TEXT",
        default=None,
        help="system prompt (not with --raw) (default: none; a chat template may add its own)",
    )
    p.add_argument(
        "--think",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a thinking model's reasoning before the answer: --think / --no-think set the chat "
        "template's enable_thinking (default: the template's)",
    )
    p.add_argument(
        "--reasoning-effort",
        choices=("low", "medium", "high"),
        default=None,
        help="how long a gpt-oss model reasons before its answer: its chat template's reasoning_effort "
        "(default: the template's, medium)",
    )
