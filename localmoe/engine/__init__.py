"""The engine: `Engine` owns a model from loading to decoding and is the one thing the CLI, the chat and the
benchmarks drive. It emits events (`localmoe.events`) and stats; sampling, the reasoning split, detokenizing and
`show`'s load plan live beside it.

May import models/, decode/, experts/ and the leaf modules; never cli/, tui/ or measure/.
"""
