"""`localmoe`'s entry point, `main()`: the arguments parsed, the subcommand dispatched, and the contract every
subcommand shares. Heavy imports (torch, transformers) happen inside the subcommands, so `--help` and `models` stay
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

import sys

from localmoe.cli.catalog import cmd_models, cmd_pull, cmd_show
from localmoe.cli.chat import cmd_chat
from localmoe.cli.measure import cmd_bench, cmd_calibrate, cmd_eval
from localmoe.cli.parser import build_parser
from localmoe.cli.run import cmd_run
from localmoe.cli.serve import cmd_serve
from localmoe.cli.terminal import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    abandon_piped_stdout,
    quiet_libraries,
    raise_on_sigterm,
    say,
    stdout_to_devnull,
)
from localmoe.errors import LocalmoeError, Terminated


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
            quiet_libraries()
        if args.command != "chat":  # the chat app restores the terminal on SIGTERM itself
            restore_sigterm = raise_on_sigterm()
        handler = {
            "run": cmd_run,
            "show": cmd_show,
            "chat": cmd_chat,
            "models": cmd_models,
            "pull": cmd_pull,
            "calibrate": cmd_calibrate,
            "eval": cmd_eval,
            "bench": cmd_bench,
            "serve": cmd_serve,
        }[args.command]
        code = handler(args)
        sys.stdout.flush()  # a reader gone away shows here, not in the interpreter's flush at exit
        return code
    except BrokenPipeError:  # stdout's reader closed the pipe (`| head`): stop quietly, as SIGPIPE would
        stdout_to_devnull()
        return EXIT_BROKEN_PIPE
    except LocalmoeError as e:
        if debug:
            raise
        say(f"localmoe: error: {e}")
        return e.exit_code
    except Terminated:
        abandon_piped_stdout()
        say("localmoe: terminated")
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        abandon_piped_stdout()
        say("localmoe: interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - last resort: one line unless --debug
        if debug:
            raise
        if type(e).__name__ == "OutOfMemoryError":
            say("localmoe: error: out of GPU memory: use --device cpu or a smaller model")
            return 1
        first = str(e).splitlines()[0] if str(e) else ""
        say(f"localmoe: error: {type(e).__name__}: {first} (rerun with --debug for the traceback)")
        return 1
    finally:
        if restore_sigterm is not None:
            restore_sigterm()
