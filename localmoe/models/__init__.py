"""Models: the families table (each supported transformers MoE family described once), the registry of aliases
(`models.toml`), real shapes without weights, the hub (resolve and download), the loader (checkpoint to a
transformers model with localmoe's experts swapped in, offload planned, decode modules installed) and random
weights at real shapes for benchmarks.

May import experts/, decode/ and the leaf modules; never engine/ or anything above it.
"""
