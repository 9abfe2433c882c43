"""GPT-OSS's routed experts on the decode path: MXFP4 experts read in place by one `sparse_mxfp4` launch.

Owns `Mxfp4Path`, the mixin `LocalExperts` (experts/local_experts.py) takes GPT-OSS's decode kernel from, and
`tail_kw`, a fused decoder layer's tail (shared expert, residual, workspace) as launch keywords. The launch reads the
gate rows whole and only the kept up/down rows, with the biases and the clamped SwiGLU (experts/clamped_swiglu.py);
resident, from the expert cache's slots, or with direct misses from the host master copies; launch keywords from the
device's tuned table ("H{H}_I{I}_k{k}", or its "_s{P}" sparsity band). Elsewhere the module runs the torch reference.

The mixin reads the module's state: `weights` (ExpertWeights), `biases`, `cache`, `layer_idx`, `intermediate_size`,
`act_fn`, `up_fn`, `tau`, `target_sparsity`, `seen`, `kernel_on_cpu`, `_host_biases`, `_zeros_tau` and `_kept_on`.
Imports: torch, experts/clamped_swiglu, the MXFP4 kernel and the tuned tables.
"""

from __future__ import annotations

import torch

from localmoe.experts.clamped_swiglu import ExpertBiases
from localmoe.kernels.mxfp4_sparse import sparse_mxfp4
from localmoe.kernels.tuning import tuned_at


def tail_kw(tail) -> dict:
    """A fused decoder layer's tail as the routed kernels' keywords (none without a tail)."""
    if tail is None:
        return {}
    kw = {"shared": tail.shared, "residual": tail.residual}
    return kw if tail.workspace is None else {**kw, "workspace": tail.workspace}


class Mxfp4Path:
    """GPT-OSS's MXFP4 decode for `LocalExperts` (module doc)."""

    def _mxfp4_kernel(self, x: torch.Tensor) -> bool:
        """Whether GPT-OSS's decode runs `sparse_mxfp4` (CUDA, or the CPU under the interpreter with
        `kernel_on_cpu`): MXFP4 experts, resident or offloaded with master copies the kernel can read (pinned, or on
        x's device); otherwise the torch reference."""
        w = self.weights
        if self.up_fn is None or w is None or not w.mxfp4 or not (x.is_cuda or self.kernel_on_cpu):
            return False
        blocks = w.w_gate.blocks
        return blocks.device == x.device or blocks.is_pinned()

    @torch.compiler.disable
    def _mxfp4(self, x, top_k_index, top_k_weights, sparse: bool, direct: bool = False, tail=None) -> torch.Tensor:
        """GPT-OSS's routed experts in one `sparse_mxfp4` launch (threshold 0 when not `sparse`: the dense math).
        Offloaded, every part is read from its cache slot (the slot tables) or, absent (`direct` misses only: copy
        mode fetched them first), from the host master copy; the biases by expert id, on the device. Launch keywords
        from the device's tuned table (`sparse_mxfp4`, "H{H}_I{I}_k{k}", or its "_s{P}" band for the calibrated
        sparsity: `target_sparsity`), else the launcher's defaults. `tail` (no
        shared expert): the residual add (and the workspace) in the same launch."""
        tau = self.tau if sparse else self._zeros_tau(x.device)
        w, b, c = self.weights, self.biases, self.cache
        kw = {}
        if tail is not None:
            if tail.shared is not None:
                raise ValueError(f"layer {self.layer_idx}: GPT-OSS's experts take no shared expert in their tail")
            kw = {k: v for k, v in tail_kw(tail).items() if k != "shared"}
        if c is not None:
            kw |= {
                "slot_table": c.tables[self.layer_idx],
                "pool_gate": c.pool.w_gate,
                "pool_up": c.pool.w_up,
                "pool_down_t": c.pool.w_down_t,
                "gate_table": c.gate_tables.get(self.layer_idx),
            }
            if direct:
                kw |= {"host_rows": c.host_rows, "read_rows": c.read_rows}
        y, _ = sparse_mxfp4(
            x,
            w.w_gate,
            w.w_up,
            w.w_down_t,
            b.gate,
            b.up,
            b.down,
            top_k_index,
            top_k_weights,
            tau,
            torch.empty(x.shape, dtype=x.dtype, device=x.device),
            alpha=self.act_fn.alpha,
            limit=self.act_fn.limit,
            kept_total=self._kept_on(x.device) if sparse else None,
            **kw,
            **tuned_at(
                x,
                "sparse_mxfp4",
                f"H{x.shape[-1]}_I{self.intermediate_size}_k{top_k_index.shape[-1]}",
                self.target_sparsity if sparse else 0.0,
            ),
        )
        if sparse:
            self.seen += top_k_index.numel() * self.intermediate_size
        return y

    def _biases_on_host(self) -> ExpertBiases | None:
        """The experts' biases in host memory (the CPU computes offloaded misses there), copied once."""
        if self.biases is None or self.biases.device.type == "cpu":
            return self.biases
        if self._host_biases is None:
            self._host_biases = self.biases.to("cpu")
        return self._host_biases
