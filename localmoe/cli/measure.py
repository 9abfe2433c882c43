"""The measuring subcommands: `calibrate` (sparsity thresholds computed and cached), `eval` (perplexity and
agreement with dense per sparsity, or lm-eval tasks) and `bench` (load, prefill and decode speed, memory).
"""

from __future__ import annotations

import json

from localmoe.cli.inputs import text_file
from localmoe.cli.loading import refuse_unsupported
from localmoe.cli.terminal import say, stderr_progress
from localmoe.errors import UsageError
from localmoe.safe_text import for_line, for_terminal


def cmd_calibrate(args) -> int:
    from localmoe.engine.engine import Engine
    from localmoe.experts import thresholds

    if args.sparsity == 0.0:
        raise UsageError("--sparsity 0 is the dense path and needs no calibration")
    text_file(args.text, "--text")
    bar = stderr_progress()

    def notice(text: str) -> None:
        bar.end_line()
        say(f"localmoe: note: {text}")

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


def cmd_eval(args) -> int:
    from localmoe.engine.engine import Engine

    if not args.tasks:
        text_file(args.text, "--text")
    engine = Engine.load(
        args.model,
        device=args.device,
        dtype=args.dtype,
        sparsity=0.0,
        progress=stderr_progress(),
        experts=args.experts,
    )
    if args.tasks:
        from localmoe.measure.harness import run_tasks

        results = run_tasks(
            engine,
            args.tasks.split(","),
            args.sparsity,
            limit=args.limit,
            include_path=args.include_path,
            progress=stderr_progress(),
        )
        print(json.dumps(results) if args.json else for_terminal(results["table"]))
        return 0
    from localmoe.measure.evaluate import evaluate

    report = evaluate(
        engine, args.sparsity, text=args.text, tokens=args.tokens, window=args.window, progress=stderr_progress()
    )
    print(json.dumps(report.as_json()) if args.json else for_terminal(report.table()))
    return 0


def cmd_bench(args) -> int:
    from localmoe.measure.benchmark import bench, table

    if not args.model and not args.shape:
        raise UsageError("give MODEL or --shape ALIAS (random weights with that model's config)")
    if args.shape:
        refuse_unsupported(args.shape)
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
        vram_gib=args.vram,
        routing=args.routing,
        experts=args.experts,
        progress=stderr_progress(),
        repetition_penalty=args.repeat_penalty,
    )
    print(json.dumps(result) if args.json else for_terminal(table(result)))
    return 0
