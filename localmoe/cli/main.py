"""The `localmoe` command line: argument parsing, error reporting, and the `run`/`show`/`models`/`pull`/`calibrate`/
`chat` subcommands. Heavy imports (torch, transformers) happen inside the subcommands, so `--help` and `models` stay
fast.

Errors a user can meet print one line, `localmoe: error: ...`, on stderr: exit 2 for bad input, 1 for runtime
failures; `--debug` shows the traceback instead. ctrl+c exits 130 (`localmoe: interrupted`) and SIGTERM 143
(`localmoe: terminated`), one line and no traceback; a reader that closes the pipe early (`| head`) ends the
command quietly with 141 (128 + SIGPIPE, as `cat` or `yes` would be killed).

What reaches a terminal is made safe first (`localmoe.safe_text`): run's reply when stdout is a terminal (streamed
through `detokenize.TerminalStream`), the stats line, notes, progress and every error line. Piped or redirected
stdout keeps the model's exact text (a file or another program gets what the model wrote), and `--json` keeps it
exactly too, escaped by JSON.

Sampling: the model's generation_config.json gives the defaults (`Engine.default_settings`); a sampling flag
overrides only itself (its argparse default is None), `--temperature 0` is greedy. A thinking model's reasoning is
left out of run's stdout: `--show-reasoning` streams it on stderr (dimmed, each line marked with a bar, when stderr is
a terminal; exact otherwise); `--json` carries `text` (the answer) and `reasoning`. The plan line (`localmoe show`'s)
is a load notice shown when stderr is a terminal (as the load progress is); `--json` and `--quiet` leave it out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from localmoe import __version__
from localmoe.errors import LocalmoeError, Terminated, UsageError
from localmoe.safe_text import for_line, for_terminal

EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE
EXIT_TERMINATED = 143  # 128 + SIGTERM
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
        "--offload-miss",
        choices=["auto", "copy", "direct", "cpu"],
        default="auto",
        help="offloaded expert misses: auto (default) = direct on CUDA with pinned memory, else copy; "
        "direct reads the gate rows and kept rows straight from pinned host memory inside the CUDA "
        "graph (3.5x copy on the H200); copy copies the expert into the cache then computes; cpu "
        "computes misses on the CPU",
    )
    p.add_argument(
        "--host-storage",
        choices=["auto", "pinned", "mmap"],
        default="auto",
        help="offloaded experts' master copies: auto (default) = pinned host memory, or memory-mapped "
        "files under the cache dir when the RAM cannot hold them; mmap forces the files",
    )
    p.add_argument(
        "--fused",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="localmoe's fused decode kernels on CUDA (RMSNorm, Gated DeltaNet step, router, shared expert); "
        "--no-fused keeps transformers' modules",
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
    p.add_argument(
        "--threshold-mode",
        choices=["layer", "expert"],
        default="layer",
        help="one threshold per layer (default) or per expert",
    )
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
    p.add_argument("--compile", action="store_true", help="torch.compile the step before capturing it (experimental)")
    p.add_argument(
        "--vram",
        type=_ranged(float, 0.0, VRAM_MAX_GIB, lo_open=True, what="--vram"),
        default=None,
        metavar="GiB",
        help="GPU memory budget (experts beyond it are offloaded)",
    )
    p.add_argument(
        "--fused",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fused decode kernels on CUDA (default on; --no-fused: transformers' modules)",
    )
    p.add_argument("--offload-miss", choices=["auto", "copy", "direct", "cpu"], default="auto")
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
    p.add_argument("--threshold-mode", choices=["layer", "expert"], default="layer")
    _add_experts_flag(p)
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    restore_sigterm = None
    try:
        args = build_parser().parse_args(argv)
        if args.command is None:
            build_parser().print_help()
            return 2
        if not debug:
            _quiet_libraries()
        if args.command != "chat":  # the chat app restores the terminal on SIGTERM itself
            restore_sigterm = _raise_on_sigterm()
        handler = {
            "run": cmd_run,
            "show": cmd_show,
            "chat": cmd_chat,
            "models": cmd_models,
            "pull": cmd_pull,
            "calibrate": cmd_calibrate,
            "eval": cmd_eval,
            "bench": cmd_bench,
        }[args.command]
        code = handler(args)
        sys.stdout.flush()  # a reader gone away shows here, not in the interpreter's flush at exit
        return code
    except BrokenPipeError:  # stdout's reader closed the pipe (`| head`): stop quietly, as SIGPIPE would
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE
    except LocalmoeError as e:
        if debug:
            raise
        _say(f"localmoe: error: {e}")
        return e.exit_code
    except Terminated:
        _abandon_piped_stdout()
        _say("localmoe: terminated")
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        _abandon_piped_stdout()
        _say("localmoe: interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - last resort: one line unless --debug
        if debug:
            raise
        if type(e).__name__ == "OutOfMemoryError":
            _say("localmoe: error: out of GPU memory: use --device cpu or a smaller model")
            return 1
        first = str(e).splitlines()[0] if str(e) else ""
        _say(f"localmoe: error: {type(e).__name__}: {first} (rerun with --debug for the traceback)")
        return 1
    finally:
        if restore_sigterm is not None:
            restore_sigterm()


def _say(line: str) -> None:
    """One line on stderr, made safe for a terminal (it may carry paths, model names or the user's input)."""
    try:
        print(for_line(line), file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr closed or gone: nowhere left to say it
        pass


def _stdout_to_devnull() -> None:
    """After EPIPE: point stdout's descriptor at /dev/null so the interpreter's final flush does not fail again."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(fd, sys.stdout.fileno())
        finally:
            os.close(fd)
    except (OSError, ValueError, AttributeError):  # not a real file (tests capture stdout)
        pass


def _abandon_piped_stdout() -> None:
    """Interrupted: text still buffered for a pipe whose reader has stopped reading would block the interpreter's
    final flush forever, so a pipe's leftovers are dropped (every token was flushed as it came: at most the one
    being written is lost). A terminal or a file is left alone."""
    import stat

    try:
        mode = os.fstat(sys.stdout.fileno()).st_mode
    except (OSError, ValueError, AttributeError):
        return
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        _stdout_to_devnull()


def _raise_on_sigterm():
    """SIGTERM raises `Terminated` in the main thread, so the command unwinds like ctrl+c and exits 143 with one
    line; a second SIGTERM while unwinding ends the process at once. -> a function restoring the old handler."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):
        return None
    return lambda: signal.signal(signal.SIGTERM, previous)


def _isatty(stream) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def _quiet_libraries() -> None:
    """Library chatter (fallback notices, deprecations) is for --debug; users see localmoe's own lines."""
    import logging
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # retry chatter: the failure is one line of ours


# -- subcommands -------------------------------------------------------------------------------------------
class _Progress:
    """A ProgressFn drawing one updating line per stage on stderr (only on a terminal). Each stage ends as one line:
    a final update repeated without updates between (the loader reports its last layer and then the end of the
    load, both done == total) draws nothing."""

    def __init__(self):
        self.tty = _isatty(sys.stderr)
        self.open: str | None = None  # the stage whose line is drawn and not yet ended
        self.ended: tuple | None = None  # (stage, total) of the line ended last

    def __call__(self, stage: str, done: int, total: int | None) -> None:
        if stage.startswith("note: "):  # bench's notices come this way
            self.end_line()
            _say(f"localmoe: {stage}")
            return
        if stage == "download" or not self.tty:
            return  # huggingface_hub draws its own bars
        final = bool(total) and done >= total
        if final and self.open is None and self.ended == (stage, total):
            return
        if self.open not in (None, stage):
            self.end_line()
        self.open, self.ended = stage, None
        frac = f"{done}/{total}" if total else str(done)
        try:
            sys.stderr.write(f"\r{for_line(stage):>10}: {frac}")
            if final:
                self.end_line()
                self.ended = (stage, total)
            sys.stderr.flush()
        except (OSError, ValueError):
            self.tty = False

    def end_line(self) -> None:
        """End the line being drawn (before a notice or the next stage)."""
        if self.open is not None:
            self.open = None
            try:
                sys.stderr.write("\n")
            except (OSError, ValueError):
                pass


def _stderr_progress() -> _Progress:
    return _Progress()


# sampling flags -> GenerationSettings fields; a flag left out (None) keeps the model's default
_SAMPLING_FLAGS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repeat_penalty": "repetition_penalty",
}


def _given_sampling(args) -> dict:
    """The sampling settings the command line gives: only the flags the user passed, plus the ones always set."""
    given = {field: getattr(args, flag) for flag, field in _SAMPLING_FLAGS.items() if getattr(args, flag) is not None}
    given.update(max_new_tokens=args.max_new_tokens, seed=args.seed, stop=_stops(args))
    return given


def _stops(args) -> tuple[str, ...]:
    stops = []
    for s in args.stop or []:
        text = _utf8(s, "--stop")
        if not text:
            raise UsageError("--stop is empty: give the text that ends the reply")
        stops.append(text)
    return tuple(stops)


def _settings(args, engine=None):
    """The reply's settings: the flags given, over the engine's defaults (the model's generation config) or, with no
    engine, GenerationSettings' defaults."""
    from dataclasses import replace

    from localmoe.events import GenerationSettings

    base = engine.default_settings() if engine is not None else GenerationSettings()
    return replace(base, **_given_sampling(args))


def _load_engine(args, progress=None, model: str | None = None):
    from localmoe.engine.engine import Engine

    quiet = progress is not None or getattr(args, "quiet", False)
    bar = progress or _stderr_progress()

    def notice(text: str) -> None:
        if isinstance(bar, _Progress):
            bar.end_line()
        _say(f"localmoe: note: {text}")

    return Engine.load(
        model or args.model,
        device=args.device,
        dtype=args.dtype,
        sparsity=args.sparsity,
        progress=bar,
        calibration_text=args.calibration_text,
        vram_gib=args.vram,
        context=args.context,
        on_notice=None if quiet else notice,
        fused=args.fused,
        offload_miss=args.offload_miss,
        host_storage=args.host_storage,
        experts=args.experts,
        show_plan=not getattr(args, "json", False) and _isatty(sys.stderr),
    )


def _utf8(data: bytes | str, what: str) -> str:
    """`data` as text, or a UsageError naming the first byte that is not UTF-8. A str may carry the bytes the
    locale could not decode (argv, a surrogateescape'd stream) as lone surrogates: they are checked the same way."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
            return data
        except UnicodeEncodeError:
            try:
                data = data.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                data = data.encode("utf-8", "surrogatepass")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"{what} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}): "
            "convert it to UTF-8 first (e.g. `iconv -f LATIN1 -t UTF-8`)"
        ) from None


def _read_prompt(prompt: str) -> str:
    """PROMPT, or stdin when it is '-' (read as bytes and decoded as UTF-8; a leading BOM dropped)."""
    if prompt != "-":
        return _utf8(prompt, "PROMPT")
    if sys.stdin is None or _isatty(sys.stdin):
        raise UsageError("no prompt: pass PROMPT or pipe it on stdin")
    raw = getattr(sys.stdin, "buffer", None)
    text = _utf8(raw.read() if raw is not None else sys.stdin.read(), "stdin")
    return text.removeprefix("\ufeff").replace("\r\n", "\n")


def _text_file(path: str | None, flag: str) -> None:
    """A text file flag (--calibration-text, --text): readable UTF-8 with some text, checked before the load."""
    if path is None:
        return
    p = Path(path).expanduser()
    try:
        data = p.read_bytes()
    except IsADirectoryError:
        raise UsageError(f"{flag} {path} is a directory: give a text file") from None
    except OSError as e:
        raise UsageError(f"cannot read {flag} {path}: {e.strerror or e}") from None
    if not _utf8(data, f"{flag} {path}").strip():
        raise UsageError(f"{flag} {path} is empty: give a file with some text")


def _system_prompt(args) -> str | None:
    if args.system is None:
        return None
    if getattr(args, "raw", False):
        raise UsageError(
            "--raw sends the prompt without the chat template, which is what places --system: "
            "put the system text in PROMPT, or drop --raw"
        )
    system = _utf8(args.system, "--system")
    if not system.strip():
        raise UsageError("--system is empty: give the system prompt's text, or leave --system out")
    return system


class _ReasoningOut:
    """--show-reasoning: the reasoning streamed on stderr. On a terminal it is made safe, dimmed, and each line begins
    with a bar, ended by a newline before the answer; elsewhere it is the exact text."""

    BAR = "\u2502 "

    def __init__(self):
        from localmoe.engine.detokenize import TerminalStream

        self.tty = _isatty(sys.stderr)
        self.screen = TerminalStream() if self.tty else None
        self.line_start = True
        self.open = False  # reasoning written and its line not ended

    def write(self, text: str) -> None:
        if not text:
            return
        if self.screen is not None:
            out = []
            for ch in self.screen.push(text):
                if self.line_start:
                    out.append(self.BAR)
                out.append(ch)
                self.line_start = ch == "\n"
            text = ("" if self.open else "\x1b[2m") + "".join(out) if out else ""
        else:
            self.line_start = text.endswith("\n")
        if not text:
            return
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except (OSError, ValueError):
            return
        self.open = True

    def end(self) -> None:
        """The reasoning is over (the answer begins, or the reply ended): dimming off, its line ended."""
        if self.open:
            tail = self.screen.flush() + "\x1b[22m" if self.screen is not None else ""
            try:
                sys.stderr.write(tail + ("" if self.line_start else "\n"))
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
        self.open, self.line_start = False, True


def cmd_run(args) -> int:
    from localmoe.engine.detokenize import TerminalStream

    system = _system_prompt(args)
    if args.raw and args.think is not None:
        flag = "--think" if args.think else "--no-think"
        raise UsageError(
            f"--raw sends the prompt without the chat template, which is what {flag} sets: drop one of them"
        )
    prompt = _read_prompt(args.prompt)
    if not prompt.strip():
        raise UsageError("the prompt is empty: give some text")
    _stops(args)  # checked before the load
    _text_file(args.calibration_text, "--calibration-text")
    engine = _load_engine(args)
    settings = _settings(args, engine)
    if args.raw:
        ids = engine.encode_raw(prompt)
    else:
        if args.think is not None and not engine.supports_thinking and not args.quiet:
            _say(
                f"localmoe: note: {engine.model_name}'s chat template has no thinking switch: "
                f"--{'' if args.think else 'no-'}think does nothing"
            )
        messages = [{"role": "system", "content": system}] if system is not None else []
        ids = engine.encode_chat(messages + [{"role": "user", "content": prompt}], think=args.think)
    # a terminal gets the text without control sequences; a pipe or a file gets it exactly
    screen = TerminalStream() if not args.json and _isatty(sys.stdout) else None
    thoughts = _ReasoningOut() if args.show_reasoning and not args.json else None
    text, reasoning, token_ids, reasoning_tokens = [], [], [], set()
    try:
        for ev in engine.generate(ids, settings):
            if ev.index == len(token_ids):
                token_ids.append(ev.token_id)
            if ev.channel == "reasoning":
                reasoning.append(ev.text)
                reasoning_tokens.add(ev.index)
                if thoughts is not None:
                    thoughts.write(ev.text)
                continue
            text.append(ev.text)
            if not args.json and ev.text:
                if thoughts is not None:
                    thoughts.end()
                sys.stdout.write(screen.push(ev.text) if screen else ev.text)
                sys.stdout.flush()
    except KeyboardInterrupt:  # ctrl+c or SIGTERM: end the partial reply's line before the one-line notice
        if thoughts is not None:
            thoughts.end()
        if text and screen is not None:
            try:
                sys.stdout.write("\n")
                sys.stdout.flush()
            except (OSError, ValueError):
                pass
        raise
    if thoughts is not None:
        thoughts.end()
    stats = engine.stats
    if args.json:
        sys.stdout.write(
            json.dumps(
                {
                    "model": engine.model_name,
                    "text": "".join(text),
                    "reasoning": "".join(reasoning),
                    "token_ids": token_ids,
                    "stats": _stats_json(stats),
                }
            )
            + "\n"
        )
    else:
        sys.stdout.write((screen.flush() if screen else "") + "\n")
        sys.stdout.flush()
        if not args.quiet:
            hidden = len(reasoning_tokens) if reasoning_tokens and thoughts is None else 0
            _say(
                _stats_line(stats, engine)
                + (f" | reasoning {hidden} tok not shown (--show-reasoning)" if hidden else "")
            )
    sys.stdout.flush()
    return 0


def _stats_json(stats) -> dict:
    keys = (
        "prompt_tokens",
        "generated_tokens",
        "prefill_tok_s",
        "decode_tok_s",
        "sparsity_target",
        "sparsity_realized",
        "peak_gpu_mem_gb",
        "cache_hit_rate",
        "h2d_bytes_per_token",
        "finish_reason",
        "load_s",
        "ttft_s",
        "wall_s",
    )
    d = stats.as_json()
    return {k: d.get(k) for k in keys}


def _stats_line(stats, engine) -> str:
    return (
        f"[{engine.model_name} on {engine.device}] load {stats.load_s:.1f} s | prompt {stats.prompt_tokens} tok, "
        f"{stats.prefill_tok_s:.1f} tok/s prefill, first token {stats.ttft_s:.2f} s | "
        f"{stats.generated_tokens} tok, {stats.decode_tok_s:.1f} tok/s decode, {stats.wall_s:.2f} s"
        f" | sparsity {stats.sparsity_target:.0%} target, {stats.sparsity_realized:.1%} realised"
        + (f" | peak GPU {stats.peak_gpu_mem_gb:.2f} GB" if stats.peak_gpu_mem_gb else "")
        + (
            f" | expert cache {stats.cache_hit_rate:.0%} hits, {stats.h2d_bytes_per_token / 1e6:.1f} MB/token copied"
            if stats.cache_hit_rate is not None
            else ""
        )
    )


def cmd_show(args) -> int:
    from localmoe.engine import plan

    result = plan.show(args.model, vram_gib=args.vram, experts_format=args.experts, context=args.context)
    if args.json:
        print(json.dumps(result.as_json()))
    else:
        print(for_terminal(result.text()))
    return 0


def cmd_models(args) -> int:
    from localmoe.models.hub import is_downloaded
    from localmoe.models.registry import load_registry

    reg = load_registry()
    specs = list(reg.models.values())
    if args.json:  # numbers as numbers, sparsity as a fraction, sizes in GB
        print(
            json.dumps(
                [
                    {
                        "alias": s.alias,
                        "repo": s.repo,
                        "family": s.family,
                        "params_b": s.params_b,
                        "bf16_gb": s.bf16_gb,
                        "default_sparsity": s.sparsity,
                        "vram": s.vram,
                        "default": s.alias == reg.default,
                        "downloaded": is_downloaded(s),
                        "supported": not s.unsupported,
                        "unsupported_reason": s.unsupported or None,
                    }
                    for s in specs
                ]
            )
        )
        return 0
    rows = [
        (
            s.alias + (" (default)" if s.alias == reg.default else ""),
            s.repo,
            f"{s.bf16_gb:g} GB",
            f"{s.sparsity:.1%}",
            "yes" if is_downloaded(s) else "no",
            "no" if s.unsupported else "yes",
        )
        for s in specs
    ]
    head = ("ALIAS", "REPO", "BF16 SIZE", "SPARSITY", "DOWNLOADED", "SUPPORTED")
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for r in (head, *rows):
        print(for_line("  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()))
    for s in specs:
        if s.unsupported:
            print(for_line(f"{s.alias}: not supported: {s.unsupported}"))
    return 0


def cmd_pull(args) -> int:
    from localmoe.models import hub

    resolved = hub.resolve(args.model, download_missing=True, pulling=True)
    print(for_line(f"{resolved.name}: {resolved.path}"))
    return 0


def cmd_calibrate(args) -> int:
    from localmoe.engine.engine import Engine
    from localmoe.experts import thresholds

    if args.sparsity == 0.0:
        raise UsageError("--sparsity 0 is the dense path and needs no calibration")
    _text_file(args.text, "--text")
    bar = _stderr_progress()

    def notice(text: str) -> None:
        bar.end_line()
        _say(f"localmoe: note: {text}")

    engine = Engine.load(
        args.model,
        device=args.device,
        dtype=args.dtype,
        sparsity=0.0,
        progress=bar,
        experts=args.experts,
        on_notice=notice,
        show_plan=False,
    )
    table = thresholds.thresholds_for(
        engine,
        args.sparsity,
        progress=bar,
        text=args.text,
        tokens=args.tokens or thresholds.DEFAULT_TOKENS,
        force=True,
        mode=args.threshold_mode,
    )
    done = (
        f"calibrated {engine.model_name} at sparsity {args.sparsity:.1%} on {table.meta.get('tokens')} "
        f"tokens of {table.meta['calibration_set']}"
    )
    if table.path is None:
        print(
            for_line(
                f"{done}; the thresholds were not saved (see the note above): every run calibrates again "
                "until the cache folder is writable"
            )
        )
    else:
        print(for_line(f"{done}: thresholds saved to {table.path}"))
    return 0


def _refuse_unsupported(model: str) -> None:
    """A registry model (alias or repo id) localmoe cannot run: refused before anything loads or downloads."""
    from localmoe.models.registry import load_registry, unsupported_model_error

    reg = load_registry()
    spec = reg.get(model.strip()) or reg.by_repo(model.strip())
    if spec is not None and spec.unsupported:
        raise unsupported_model_error(spec, reg)


def cmd_chat(args) -> int:
    from localmoe.models.registry import load_registry

    model = args.model or load_registry().default
    if not model:
        raise UsageError("no default model: pass MODEL (see `localmoe models`)")
    args.model = model
    system = _system_prompt(args)
    _refuse_unsupported(model)  # here, not once the chat app is up and loading
    _text_file(args.calibration_text, "--calibration-text")
    given = _given_sampling(args)  # checked (--stop) before the app starts
    from localmoe.tui.app import run_chat

    def load(progress, model: str | None = None):
        """The chat's loader: the model given on the command line, or `model` (`/model ALIAS`). The engine's
        default_settings() are the model's generation config under the sampling flags given."""
        if model is not None:
            _refuse_unsupported(model)
        engine = _load_engine(args, progress, model=model)
        engine.override_defaults(**given)
        return engine

    kwargs = {"think": args.think} if args.think is not None else {}
    return run_chat(
        load,
        model_label=model,
        settings=_settings(args),
        sparsity=args.sparsity,
        system=system,
        continue_last=args.continue_last,
        **kwargs,
    )


def cmd_eval(args) -> int:
    from localmoe.engine.engine import Engine

    if not args.tasks:
        _text_file(args.text, "--text")
    engine = Engine.load(
        args.model,
        device=args.device,
        dtype=args.dtype,
        sparsity=0.0,
        progress=_stderr_progress(),
        experts=args.experts,
    )
    engine.threshold_mode = args.threshold_mode
    if args.tasks:
        from localmoe.measure.harness import run_tasks

        results = run_tasks(
            engine,
            args.tasks.split(","),
            args.sparsity,
            limit=args.limit,
            include_path=args.include_path,
            progress=_stderr_progress(),
        )
        print(json.dumps(results) if args.json else for_terminal(results["table"]))
        return 0
    from localmoe.measure.evaluate import evaluate

    report = evaluate(
        engine, args.sparsity, text=args.text, tokens=args.tokens, window=args.window, progress=_stderr_progress()
    )
    print(json.dumps(report.as_json()) if args.json else for_terminal(report.table()))
    return 0


def cmd_bench(args) -> int:
    from localmoe.measure.benchmark import bench, table

    if not args.model and not args.shape:
        raise UsageError("give MODEL or --shape ALIAS (random weights with that model's config)")
    if args.shape:
        _refuse_unsupported(args.shape)
    result = bench(
        args.model,
        shape=args.shape,
        sparsities=args.sparsity,
        device=args.device,
        dtype=args.dtype,
        prompt_tokens=args.prompt_tokens,
        decode_tokens=args.decode_tokens,
        context=args.context,
        baseline=args.baseline,
        graphs=not args.no_graph,
        compile=args.compile,
        vram_gib=args.vram,
        fused=args.fused,
        offload_miss=args.offload_miss,
        routing=args.routing,
        experts=args.experts,
        progress=_stderr_progress(),
        repetition_penalty=args.repeat_penalty,
    )
    print(json.dumps(result) if args.json else for_terminal(table(result)))
    return 0
