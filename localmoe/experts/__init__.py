"""Experts: localmoe's experts module (`LocalExperts`, the dense and sparse paths; the layer's weight stacks,
`expert_weights`; `sparse_reference`, the sparse path's torch reference; `clamped_swiglu`, GPT-OSS's activation and
biases), sparsity thresholds and their calibration (`thresholds`, fed by `gate_recorder`; their files:
`threshold_files`), where experts live (`placement`: VRAM budget, slots), the GPU expert cache for offloaded experts
(`cache`), host copies (`store`: pinned, pageable or memory-mapped files) and the int4 format at the app level
(`int4`; the format itself is in kernels/int4.py); offloaded prefill's staging and its VRAM share (`staging`,
`prefill_budget`), the dense path's grouped GEMMs (`dense_path`), GPT-OSS's MXFP4 decode launch (`mxfp4_path`), the
department-shared gate predictor for pretrained MoEs (`predictor`, `predicted`, `predictor_cache`), and DeaMoE's
departments (`departments`; their dense path `department_dense`, cache `department_cache` and VRAM plan
`department_placement`).

May import kernels/ and the leaf modules; never models/, decode/ or anything above.
"""
