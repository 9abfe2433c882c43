"""Models: what a model is and how it is loaded.

    families/          the supported MoE families, one module per family (FamilySpec), and FAMILIES, their table
    registry.py        `models.toml` parsed into ModelSpecs, looked up by alias
    shapes.py          registry models' real configs without weights (data/shapes.json): `bench --shape`, `show`
    hub.py             what the user typed (alias, org/name, folder) → a local checkpoint folder; downloads
    loader.py          load_model as named steps over the modules below (LoadOptions: what the engine asks for)
    checkpoint.py      config.json, the tokenizer's presence, the safetensors index and shards, the key map
    skeleton.py        the transformers model on the meta device with localmoe's experts swapped in
    offload.py         the VRAM plan, spilled non-expert units, buffers, where expert master copies live
    weights.py         tensors streamed from safetensors into the skeleton and the expert stores
    loaded.py          LoadedModel (what a load hands the engine), the expert cache attached, the int4 hint
    random_weights.py  random weights at real shapes for benchmarks, built as the loader builds a checkpoint
    deamoe/            DeaMoE (departments of experts sharing projections) as a transformers model

May import experts/, decode/ and the leaf modules; never engine/ or anything above it.
"""
