"""localmoe: run Mixture-of-Experts language models on one desktop GPU.

Importing this package must stay cheap (no torch): `localmoe --help` and `localmoe models` rely on it.
"""

__version__ = "0.1.0"
