"""The measuring subcommands: `calibrate` (sparsity thresholds computed and cached), `eval` (perplexity and
agreement with dense per sparsity, or lm-eval tasks) and `bench` (load, prefill and decode speed, memory).
"""

from __future__ import annotations

import gc
import json

from localmoe.cli.inputs import text_file
from localmoe.cli.loading import check_rank, refuse_unsupported
from localmoe.cli.terminal import say, stderr_progress
from localmoe.errors import UsageError
from localmoe.safe_text import for_line, for_terminal


def cmd_calibrate(args) -> int:
    from localmoe.engine.engine import Engine
    from localmoe.experts import predictor, thresholds

    if args.sparsity == 0.0:
        raise UsageError("--sparsity 0 is the dense path and needs no calibration")
    text_file(args.text, "--text")
    check_rank(args)
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
        embeddings=args.embeddings,
        on_notice=notice,
        show_plan=False,
    )
    engine.set_z_sparsity(args.z_sparsity)  # refused in one line for a model without departments
    table = thresholds.thresholds_for(
        engine,
        args.sparsity,
        progress=bar,
        text=args.text,
        tokens=args.tokens or thresholds.DEFAULT_TOKENS,
        force=True,
        z_sparsity=args.z_sparsity,
    )
    fitted = None
    if args.departments:
        engine.set_departments(args.departments, args.rank)
        _, fitted = predictor.predictors_for(
            engine,
            table,
            args.departments,
            args.rank,
            text=args.text,
            tokens=args.tokens or thresholds.DEFAULT_TOKENS,
            progress=bar,
            force=True,
        )
    z = f" and z sparsity {args.z_sparsity:.1%}" if args.z_sparsity else ""
    done = (
        f"calibrated {engine.model_name} at sparsity {args.sparsity:.1%}{z} on {table.meta.get('tokens')} "
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
    if args.departments:
        where = f"saved to {fitted}" if fitted is not None else "not saved (see the note above)"
        print(for_line(f"gate predictor with {args.departments} departments {where}"))
    return 0


def _each_format(args, measure) -> int:
    """`measure(experts) -> (json object, table)` for each `--experts` format in turn (one model in memory at a
    time); one format prints as before, several print one table each under a heading, or a JSON list."""
    results = []
    for fmt in args.experts:
        obj, text = measure(fmt)
        obj = {**obj, "experts": fmt}
        results.append(obj)
        if not args.json:
            print(for_terminal(text if len(args.experts) == 1 else f"== --experts {fmt}\n{text}\n"), flush=True)
        gc.collect()
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results))
    return 0


def cmd_eval(args) -> int:
    from localmoe.engine.engine import Engine

    if not args.tasks:
        text_file(args.text, "--text")
    check_rank(args)
    departments = args.departments if max(args.departments) > 0 else None

    def measure(fmt: str):
        engine = Engine.load(
            args.model,
            device=args.device,
            dtype=args.dtype,
            sparsity=0.0,
            progress=stderr_progress(),
            experts=fmt,
            embeddings=args.embeddings,
        )
        engine.set_z_sparsity(args.z_sparsity)  # DeaMoE: τ_z on every sparse row (refused for other models)
        if args.tasks:
            from localmoe.measure.harness import run_tasks

            results = run_tasks(
                engine,
                args.tasks.split(","),
                args.sparsity,
                limit=args.limit,
                include_path=args.include_path,
                progress=stderr_progress(),
                departments=departments,
                rank=args.rank,
            )
            return results, results["table"]
        from localmoe.measure.evaluate import evaluate

        report = evaluate(
            engine,
            args.sparsity,
            text=args.text,
            tokens=args.tokens,
            window=args.window,
            progress=stderr_progress(),
            departments=departments,
            rank=args.rank,
        )
        return report.as_json(), report.table()

    return _each_format(args, measure)


def cmd_bench(args) -> int:
    from localmoe.measure.benchmark import bench, table

    if not args.model and not args.shape:
        raise UsageError("give MODEL or --shape ALIAS (random weights with that model's config)")
    if args.shape:
        refuse_unsupported(args.shape)

    def measure(fmt: str):
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
            experts=fmt,
            progress=stderr_progress(),
            repetition_penalty=args.repeat_penalty,
            departments=args.departments,
            rank=args.rank,
            embeddings=args.embeddings,
            z_sparsity=args.z_sparsity,
        )
        return result, table(result)

    return _each_format(args, measure)
