"""Measurements a user runs: `localmoe eval` (perplexity and sparsity sweeps), `localmoe bench` (decode and prefill
speed, at real shapes with random weights, against transformers) and the lm-eval harness adapter.

May import engine/, models/ and the leaf modules; never cli/ or tui/.
"""
