"""localmoe: run Mixture-of-Experts language models on one desktop GPU.

The folders are the engine's parts; imports run one way, top to bottom, never back up:

    cli/      the `localmoe` command: flags, subcommands, one-line errors (may import everything below, and tui)
    tui/      the `localmoe chat` terminal app (installed as localmoe.tui; consumes the engine's events only)
    measure/  `eval`, `bench` and the lm-eval harness: measurements driven through an Engine
    engine/   `Engine`, loading to decoding: the generation loop, sampling, reasoning, detokenizing, `show`'s plan
    models/   what a model is and how it is loaded: the families table, the registry, the hub, the loader,
              random weights at real shapes
    decode/   decode-time replacements of transformers modules (one table), the fused modules, prefill and prompt
              reuse, the CUDA-graph step
    experts/  localmoe's experts module and everything about expert weights: sparsity thresholds and their
              calibration, placement in VRAM, the expert cache, host storage, the int4 format at the app level
    kernels/  Triton kernels beside their torch references (installed as localmoe.kernels; imports nothing above)

Leaf modules here (`errors`, `events`, `paths`, `safe_text`, `devices`) may be imported from any part.
Importing this package must stay cheap (no torch): `localmoe --help` and `localmoe models` rely on it.
"""

import os
import sys

__version__ = "0.1.0"

# A clone's root holds kernels/ and tui/, installed as localmoe.kernels and localmoe.tui. Run from that root
# (`python -m localmoe`, `python -c`, PYTHONPATH=.), the root sits on sys.path and its kernels/ would shadow Hugging
# Face's `kernels` package, which transformers imports: the root leaves sys.path once localmoe itself is imported.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_ROOT, "pyproject.toml")) and os.path.isdir(os.path.join(_ROOT, "kernels")):
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != os.path.realpath(_ROOT)]
