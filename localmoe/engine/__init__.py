"""The engine: `Engine` (engine.py) owns a model from loading to decoding and is the one thing the CLI, the chat and
the benchmarks drive. It emits events (`localmoe.events`) and stats. Beside it: one reply's steps (generate.py:
prefill, capture, one decode step, the loop), its figures (stats.py), the tokenizer and chat template (prompts.py),
the load's notices (notices.py), sampling, the reasoning split, detokenizing and `show`'s load plan.

May import models/, decode/, experts/ and the leaf modules; never cli/, tui/ or measure/.
"""
