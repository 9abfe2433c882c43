"""The engine: `Engine` (engine.py) owns a model from loading to decoding and is the one thing the CLI, the chat and
the benchmarks drive. It emits events (`localmoe.events`) and stats.

    engine.py      Engine: its run-time API (set_sparsity, set_context, chat, generate, prepare_next_turn, cancel)
    load.py        how an Engine is made: Engine.load (resolve, load, notices, calibrate), Engine.random (bench)
    generate.py    one reply's steps: prefill, capture, one decode step, the pipeline, the loop, the reply's text
    stats.py       a reply's figures (tok/s, realized sparsity, cache hits)
    prompts.py     the tokenizer, the chat template and its thinking switch
    notices.py     the load's one-line notices (offloading, pinning, the int4 hint)
    plan.py        what a model needs, from its config alone (`localmoe show`, the plan line at load)
    model_facts.py a model's counts and the byte floor of a decode step (plan.py's and bench's)
    sampling.py    sampling, the repetition penalty's seen-token mask, generation_config.json's defaults
    reasoning.py   a thinking model's reply split into reasoning and answer as it streams
    detokenize.py  token ids to text as they stream, stop strings

May import models/, decode/, experts/ and the leaf modules; never cli/, tui/ or measure/.
"""
