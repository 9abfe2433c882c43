"""`build_parser()`: the `localmoe` command's subcommands and the flags each takes (the shared groups and the
validators are localmoe.cli.flags'; every help states its default).
"""

from __future__ import annotations

import argparse

from localmoe import __version__
from localmoe.cli.flags import (
    Parser,
    add_context_flag,
    add_debug_flag,
    add_device_flags,
    add_engine_flags,
    add_experts_flag,
    add_json_flag,
    add_predictor_flags,
    add_sampling_flags,
    add_vram_flag,
    add_z_sparsity_flag,
    ranged,
    sparsity,
    sparsity_list,
    token_counts,
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="localmoe", description="Run Mixture-of-Experts LLMs on one desktop GPU, sparse.")
    parser.add_argument("--version", action="version", version=f"localmoe {__version__}")
    add_debug_flag(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    p = sub.add_parser("run", help="generate a reply to one prompt, streamed to stdout")
    p.add_argument("model", metavar="MODEL", help="alias (localmoe models), hub repo id, or local directory")
    p.add_argument("prompt", metavar="PROMPT", nargs="?", default="-", help="the prompt; '-' or absent reads stdin")
    add_engine_flags(p)
    add_sampling_flags(p)
    p.add_argument(
        "--raw",
        action="store_true",
        help="encode the prompt as is, without the chat template (so no --system) (default: off, the chat template)",
    )
    p.add_argument(
        "--show-reasoning",
        action="store_true",
        help="stream a thinking model's reasoning on stderr (default: off, stdout gets the answer only)",
    )
    add_json_flag(p, "print one JSON object (exact text and reasoning, token ids, stats) instead of streaming")
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no plan line or stats line on stderr (default: off; the plan line shows on a terminal only)",
    )
    add_debug_flag(p)

    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, ...) with the model loaded once"
    )
    p.add_argument("model", metavar="MODEL", nargs="?", default=None, help="default: the bundled localmoe-tiny")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; anything but loopback needs --api-key (default: 127.0.0.1)",
    )
    p.add_argument(
        "--port", type=ranged(int, 0, 65535, what="--port"), default=8080, help="0 = a free port (default: 8080)"
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        default=None,
        help="clients must send 'Authorization: Bearer KEY' (default: $LOCALMOE_API_KEY, else none on loopback)",
    )
    p.add_argument(
        "--max-queue",
        type=ranged(int, 0, 1 << 20, what="--max-queue"),
        default=16,
        help="requests that may wait for the engine; more get 503 with Retry-After (default: 16)",
    )
    p.add_argument(
        "--max-body",
        metavar="MiB",
        type=ranged(float, 0.0, 1024.0, lo_open=True, what="--max-body"),
        default=8.0,
        help="largest request body accepted; larger gets 413 (default: 8)",
    )
    p.add_argument(
        "--cors-origin",
        metavar="ORIGIN",
        action="append",
        default=None,
        help="a web page origin (https://host:port, or '*' for any) whose scripts may call the API from a browser; "
        "repeat for several (default: none)",
    )
    add_engine_flags(p)
    p.add_argument("--quiet", action="store_true", help="no load notices or per-request lines on stderr (default: off)")
    add_debug_flag(p)

    p = sub.add_parser("show", help="what a model needs, from its config alone (no weights downloaded)")
    p.add_argument("model", metavar="MODEL", help="alias (localmoe models), hub repo id, or local directory")
    add_vram_flag(
        p, "the GPU budget to plan for (default: what this machine's card has free minus 1 GiB; none without a GPU)"
    )
    add_experts_flag(p)
    add_context_flag(p, "context to size the KV/state for (default: 8192, or the model's maximum if smaller)")
    add_json_flag(p, "one JSON object, numbers as numbers (bytes, parameters)")
    add_debug_flag(p)

    p = sub.add_parser("chat", help="open the terminal chat")
    p.add_argument("model", metavar="MODEL", nargs="?", default=None, help="default: the bundled localmoe-tiny")
    add_engine_flags(p)
    add_sampling_flags(p)
    p.add_argument(
        "--continue",
        dest="continue_last",
        action="store_true",
        help="resume the last session (default: off, a new session)",
    )
    add_debug_flag(p)

    p = sub.add_parser("eval", help="perplexity and agreement with dense, per sparsity")
    p.add_argument("model", metavar="MODEL")
    p.add_argument(
        "--sparsity",
        type=sparsity_list,
        default=[0.0, 0.5, 0.7, 0.85, 0.9],
        help="comma-separated list (default: 0,0.5,0.7,0.85,0.9)",
    )
    p.add_argument(
        "--text", metavar="FILE", default=None, help="text to score (default: the held-out split shipped with localmoe)"
    )
    p.add_argument(
        "--tokens",
        type=ranged(int, 16, what="--tokens"),
        default=16384,
        help="tokens of the text to score (default: 16384)",
    )
    p.add_argument(
        "--window",
        type=ranged(int, 16, what="--window"),
        default=512,
        help="tokens per scored window (default: 512, or the model's maximum if smaller)",
    )
    p.add_argument(
        "--tasks",
        default=None,
        help="comma-separated lm-eval tasks, scored instead of the text (needs the optional lm-eval extra) "
        "(default: none)",
    )
    p.add_argument(
        "--limit",
        type=ranged(int, 1, what="--limit"),
        default=None,
        help="lm-eval: examples per task (default: all)",
    )
    p.add_argument("--include-path", default=None, help="lm-eval: folder with extra task YAMLs (default: none)")
    add_predictor_flags(p, many=True)
    add_z_sparsity_flag(p)
    add_experts_flag(p, many=True)
    add_json_flag(p, "one JSON object instead of the table")
    add_device_flags(p)
    add_debug_flag(p)

    p = sub.add_parser("bench", help="load time, prefill and decode tok/s, memory, byte floor")
    p.add_argument("model", metavar="MODEL", nargs="?", default=None)
    add_predictor_flags(p, many=True)
    add_z_sparsity_flag(p)
    p.add_argument(
        "--shape",
        metavar="ALIAS",
        default=None,
        help="random weights with this registry model's config (default: none, MODEL's weights)",
    )
    add_experts_flag(p, many=True)
    p.add_argument(
        "--sparsity",
        type=sparsity_list,
        default=None,
        help="comma-separated list (default: 0 and the model's default sparsity)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=token_counts,
        default=[512],
        help="random prompt length in tokens; a comma-separated list also times each length's first token (median "
        "of 3; decode runs after the shortest) (default: 512)",
    )
    p.add_argument(
        "--decode-tokens",
        type=ranged(int, 2, what="--decode-tokens"),
        default=256,
        help="tokens decoded per row (default: 256)",
    )
    add_context_flag(p, "KV cache length (default: prompt + decode + 64; chat and run default to 8192)")
    p.add_argument(
        "--baseline",
        choices=["transformers", "accelerate"],
        default=None,
        help="stock generate in the same run; 'accelerate' offloads with device_map/max_memory (needs --vram) "
        "(default: none)",
    )
    p.add_argument(
        "--no-graph",
        action="store_true",
        help="decode eagerly, without the CUDA graph (default: off, the graph on CUDA)",
    )
    add_vram_flag(
        p, "GPU memory budget (experts beyond it are offloaded) (default: what the card has free minus 1 GiB)"
    )
    p.add_argument(
        "--routing",
        choices=["uniform", "skewed"],
        default="uniform",
        help="random weights: how the router spreads tokens (uniform = pessimistic for the expert cache) "
        "(default: uniform)",
    )
    p.add_argument(
        "--repeat-penalty",
        dest="repeat_penalty",
        metavar="P",
        type=ranged(float, 0.0, 10.0, lo_open=True, what="--repeat-penalty"),
        default=None,
        help="also decode with this repetition penalty: a row with it after each row without (same run) "
        "(default: none, no penalty rows)",
    )
    add_json_flag(p, "one JSON object instead of the table")
    add_device_flags(p)
    add_debug_flag(p)

    p = sub.add_parser("models", help="list the registry's models")
    add_json_flag(p, "one JSON array, one object per model, numbers as numbers")

    p = sub.add_parser("pull", help="download a model into the Hugging Face cache")
    p.add_argument("model", metavar="MODEL")
    add_debug_flag(p)

    p = sub.add_parser("calibrate", help="compute (and cache) sparsity thresholds for a model")
    p.add_argument("model", metavar="MODEL")
    p.add_argument(
        "--sparsity",
        type=sparsity,
        required=True,
        help="the sparsity target to calibrate for, in (0, 1) (required: no default)",
    )
    p.add_argument(
        "--text", metavar="FILE", default=None, help="calibration text (default: the text bundled with localmoe)"
    )
    p.add_argument(
        "--tokens",
        type=ranged(int, 16, what="--tokens"),
        default=None,
        help="tokens of the text to calibrate on (default: 4096)",
    )
    add_predictor_flags(p)
    add_z_sparsity_flag(p)
    add_experts_flag(p)
    add_device_flags(p)
    add_debug_flag(p)
    return parser
