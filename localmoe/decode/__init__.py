"""Decode: the one table of decode-time replacements of transformers modules (`replacements`), the fused modules
it installs (text model, decoder/MoE layer, attention, Gated DeltaNet, linear and norm ops), the one-token
attention implementation (`sdpa`), prefill with prompt reuse (`prefix`) and the CUDA-graph decode step (`graph`).

May import kernels/ and the leaf modules; never experts/ internals, models/ or anything above.
"""
