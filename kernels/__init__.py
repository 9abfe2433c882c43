"""localmoe.kernels: the Triton kernels of the decode step, prefill and expert staging, each file one kernel (or one
launch's few kernels) beside its torch reference and a launcher that checks shapes, strides and dtypes; a kernel's
@triton.jit parts or argument checks that would crowd its file sit beside it, named for what they hold (int4_rows,
mxfp4_rows, department_up / department_down, causal_conv_update, decode_attention_softmax, qk_layout,
sparse_fused_args, moe_front_args, decode_attention_args); the tuned launch parameters per device as data (tuned/,
read by tuning.py).
Imports torch, triton and its own modules only: nothing of localmoe above it.

Triton 3.9 warns at the first compile when TRITON_DEFAULT_FP_FUSION is unset (on the user's terminal, during `run`
and `chat`), and Triton 3.10 makes unfused multiply-adds the default. These kernels are tuned and tested with fused
multiply-adds, so they keep them unless the environment already says otherwise.
"""

import os

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
