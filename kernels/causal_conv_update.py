"""The causal conv1d update of the Gated DeltaNet decode step, as Triton jit helpers over one batch row's channels.

transformers' `causal_conv1d_update` torch fallback for one token, then SiLU: the conv state [B, C, K] (last dim
contiguous) shifts left by one with the new input in its last column, and each channel's output is the dot product of
that window with its K weights plus its bias. Shared by kernels/delta_rule_step.py's `_gdn_step_kernel` and
kernels/delta_rule_step_split.py's `_gdn_split_kernel`, each on a channel range [c0, c0+n) (a q, k or v head):

* `_conv_window`: what the update needs besides the new input (the state's last K-1 columns, the weights, the bias),
  none of it written by the projection before: loadable before the PDL wait.
* `_conv_apply`: the update + SiLU from those pieces and the new input; returns the new state tail with its pointers
  and mask and stores nothing (the caller stores after a barrier, once every program that reads the old window has).
* `_conv_silu`: both in one go.

Every dtype round trip transformers makes (the window cast to the weight dtype, conv output and SiLU in the weight
dtype, the result cast to the input's dtype) is reproduced with `round_to`. Torch reference: the conv lines of
`gated_deltanet_step_ref` (kernels/delta_rule_step.py).
"""

from __future__ import annotations

try:  # Triton is optional at import time; the kernels need it.
    import triton
    import triton.language as tl

    from localmoe.kernels.rounding import round_to
except ImportError:  # pragma: no cover
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def _conv_window(
        st_ptr,
        w_ptr,
        bias_ptr,
        bi,
        c0,
        n,
        stride_sb,
        stride_sc,
        HAS_BIAS: tl.constexpr,
        KS: tl.constexpr,
        KS_P2: tl.constexpr,
        N_P2: tl.constexpr,
    ):
        """What the conv update of channels [c0, c0+n) of batch row bi needs besides the new input: the state's last
        KS-1 columns shifted left by one ([N_P2, KS_P2] fp32, column KS-1 zero), the weights [N_P2, KS_P2] and the
        bias [N_P2] (fp32). Nothing here is written by the projection before: loadable before the PDL wait."""
        c = c0 + tl.arange(0, N_P2)
        cm = tl.arange(0, N_P2) < n
        j = tl.arange(0, KS_P2)
        # new[c, j] = cat(state, x)[c, j + 1], j < KS: the conv window and the next state
        nxt = tl.load(
            st_ptr + bi * stride_sb + c[:, None].to(tl.int64) * stride_sc + (j[None, :] + 1),
            mask=cm[:, None] & (j[None, :] + 1 < KS),
            other=0.0,
        ).to(tl.float32)
        w = tl.load(w_ptr + c[:, None] * KS + j[None, :], mask=cm[:, None] & (j[None, :] < KS), other=0.0).to(
            tl.float32
        )
        if HAS_BIAS:
            bias = tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)
        else:
            bias = tl.zeros([N_P2], dtype=tl.float32)
        return nxt, w, bias

    @triton.jit
    def _conv_apply(
        x_ptr,
        st_ptr,
        w_dtype: tl.constexpr,
        nxt,
        w,
        bias,
        bi,
        c0,
        n,
        stride_xb,
        stride_sb,
        stride_sc,
        KS: tl.constexpr,
        KS_P2: tl.constexpr,
        N_P2: tl.constexpr,
    ):
        """Causal conv1d update + SiLU of channels [c0, c0+n) from `_conv_window`'s pieces and the new input. Returns
        (fp32 values rounded like transformers, i.e. conv in the weight dtype, SiLU in the weight dtype, cast to x's
        dtype; the new state tail [N_P2, KS_P2] to store; its pointers; its mask). Stores nothing (the caller stores
        after a barrier)."""
        c = c0 + tl.arange(0, N_P2)
        cm = tl.arange(0, N_P2) < n
        j = tl.arange(0, KS_P2)
        xv = tl.load(x_ptr + bi * stride_xb + c, mask=cm, other=0.0)
        new = tl.where(j[None, :] == KS - 1, xv.to(tl.float32)[:, None], nxt)
        new = round_to(new, w_dtype)  # torch.cat(...).to(weight.dtype)
        acc = tl.sum(new * w, axis=1) + bias
        acc = round_to(acc, w_dtype)  # conv output in the weight dtype
        y = round_to(acc / (1.0 + tl.exp(-acc)), w_dtype)  # SiLU in the weight dtype
        y = round_to(y, xv.dtype)  # .to(hidden_states.dtype)
        sptr = st_ptr + bi * stride_sb + c[:, None].to(tl.int64) * stride_sc + j[None, :]
        smask = cm[:, None] & (j[None, :] < KS)
        return y, new, sptr, smask

    @triton.jit
    def _conv_silu(
        x_ptr,
        st_ptr,
        w_ptr,
        bias_ptr,
        bi,
        c0,
        n,
        stride_xb,
        stride_sb,
        stride_sc,
        HAS_BIAS: tl.constexpr,
        KS: tl.constexpr,
        KS_P2: tl.constexpr,
        N_P2: tl.constexpr,
    ):
        """`_conv_window` then `_conv_apply`: the conv update of channels [c0, c0+n) in one go."""
        nxt, w, bias = _conv_window(st_ptr, w_ptr, bias_ptr, bi, c0, n, stride_sb, stride_sc, HAS_BIAS, KS, KS_P2, N_P2)
        return _conv_apply(
            x_ptr,
            st_ptr,
            w_ptr.dtype.element_ty,
            nxt,
            w,
            bias,
            bi,
            c0,
            n,
            stride_xb,
            stride_sb,
            stride_sc,
            KS,
            KS_P2,
            N_P2,
        )
