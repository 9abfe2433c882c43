"""`localmoe run`: one prompt's reply streamed to stdout (exact on a pipe, made safe on a terminal) or one JSON
object with --json; a thinking model's reasoning on stderr with --show-reasoning; the stats line on stderr. A harmony
model (gpt-oss) prints its final message; its analysis (and commentary) is the reasoning.
"""

from __future__ import annotations

import json
import sys

from localmoe.cli.inputs import read_prompt, stops, system_prompt, text_file
from localmoe.cli.loading import load_engine, reply_settings
from localmoe.cli.terminal import isatty, say
from localmoe.errors import UsageError


class _ReasoningOut:
    """--show-reasoning: the reasoning streamed on stderr. On a terminal it is made safe, dimmed, and each line begins
    with a bar, ended by a newline before the answer; elsewhere it is the exact text."""

    BAR = "\u2502 "

    def __init__(self):
        from localmoe.engine.detokenize import TerminalStream

        self.tty = isatty(sys.stderr)
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

    system = system_prompt(args)
    if args.raw and args.think is not None:
        flag = "--think" if args.think else "--no-think"
        raise UsageError(
            f"--raw sends the prompt without the chat template, which is what {flag} sets: drop one of them"
        )
    prompt = read_prompt(args.prompt)
    if not prompt.strip():
        raise UsageError("the prompt is empty: give some text")
    stops(args)  # checked before the load
    text_file(args.calibration_text, "--calibration-text")
    engine = load_engine(args)
    settings = reply_settings(args, engine)
    if args.raw:
        ids = engine.encode_raw(prompt)
    else:
        if args.think is not None and not engine.supports_thinking and not args.quiet:
            say(
                f"localmoe: note: {engine.model_name}'s chat template has no thinking switch: "
                f"--{'' if args.think else 'no-'}think does nothing"
            )
        messages = [{"role": "system", "content": system}] if system is not None else []
        ids = engine.encode_chat(messages + [{"role": "user", "content": prompt}], think=args.think)
    # a terminal gets the text without control sequences; a pipe or a file gets it exactly
    screen = TerminalStream() if not args.json and isatty(sys.stdout) else None
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
                    "stats": {**_stats_json(stats), "z_sparsity": engine.z_sparsity},
                }
            )
            + "\n"
        )
    else:
        sys.stdout.write((screen.flush() if screen else "") + "\n")
        sys.stdout.flush()
        if not args.quiet:
            hidden = len(reasoning_tokens) if reasoning_tokens and thoughts is None else 0
            say(
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
        "department_hit_rate",
        "private_hit_rate",
        "finish_reason",
        "load_s",
        "ttft_s",
        "wall_s",
        "prefill_chunk",  # under a VRAM budget: prompt tokens per prefill piece and experts per staging buffer
        "staging_span",
        "dequant_bytes",  # resident 4-bit experts: dequantized bytes a span of grouped GEMMs (0: none)
    )
    d = stats.as_json()
    return {k: d.get(k) for k in keys}


def _stats_line(stats, engine) -> str:
    return (
        f"[{engine.model_name} on {engine.device}] load {stats.load_s:.1f} s | prompt {stats.prompt_tokens} tok, "
        f"{stats.prefill_tok_s:.1f} tok/s prefill, first token {stats.ttft_s:.2f} s | "
        f"{stats.generated_tokens} tok, {stats.decode_tok_s:.1f} tok/s decode, {stats.wall_s:.2f} s"
        f" | sparsity {stats.sparsity_target:.0%} target, {stats.sparsity_realized:.1%} realised"
        + (f", z {engine.z_sparsity:.0%}" if engine.z_sparsity and stats.sparsity_target else "")
        + (f" | peak GPU {stats.peak_gpu_mem_gb:.2f} GB" if stats.peak_gpu_mem_gb else "")
        + (
            f" | expert cache {stats.cache_hit_rate:.0%} hits, {stats.h2d_bytes_per_token / 1e6:.1f} MB/token copied"
            if stats.cache_hit_rate is not None
            else ""
        )
        + (
            f" (departments {stats.department_hit_rate:.0%}, private parts {stats.private_hit_rate:.0%})"
            if stats.department_hit_rate is not None and stats.private_hit_rate is not None
            else ""
        )
    )
