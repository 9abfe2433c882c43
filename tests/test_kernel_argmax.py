"""kernels/argmax.py against its torch reference and torch.argmax: odd and real vocabularies, bf16 / fp32, ties,
-inf and NaN, the in-place outputs (next input, position, device and host rings) over several launches."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEV

from localmoe.kernels.argmax import argmax_next, argmax_next_ref

pytestmark = pytest.mark.filterwarnings("ignore")


def _outputs(R=4):
    dev = torch.device(DEV)
    return dict(
        ids=torch.zeros(1, dtype=torch.long, device=dev),
        pos=torch.full((1,), 7, dtype=torch.long, device=dev),
        ring=torch.full((R,), -1, dtype=torch.long, device=dev),
        host=torch.full((R,), -1, dtype=torch.long, pin_memory=dev.type == "cuda"),
        count=torch.zeros(1, dtype=torch.int32, device=dev),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("V,block", [(1, 16), (37, 16), (5000, 1024), (248320, 4096)])
def test_matches_torch_argmax(dtype, V, block):
    gen = torch.Generator().manual_seed(V)
    x = torch.randn(V, generator=gen).to(dtype).to(DEV)
    out = _outputs()
    argmax_next(x, ids=out["ids"], block=block)
    assert int(out["ids"]) == int(torch.argmax(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ties_go_to_the_first_index(dtype):
    V = 3001
    x = torch.zeros(V, dtype=dtype, device=DEV)
    for i in (2999, 1500, 17, 1025):  # in several programs' blocks, and two in one
        x[i] = 3.0
    out = _outputs()
    argmax_next(x, ids=out["ids"], block=256)
    assert int(out["ids"]) == 17 == int(torch.argmax(x))
    x.fill_(-1.0)  # all equal: index 0
    argmax_next(x, ids=out["ids"], block=256)
    assert int(out["ids"]) == 0


def test_minus_inf_and_nan():
    x = torch.full((999,), float("-inf"), device=DEV)
    out = _outputs()
    argmax_next(x, ids=out["ids"], block=64)
    assert int(out["ids"]) == 0  # every logit masked: the first, as torch
    x[500] = 1.0
    x[700] = float("nan")
    argmax_next(x, ids=out["ids"], block=64)
    assert int(out["ids"]) == 700 == int(argmax_next_ref(x))


def test_outputs_over_launches_match_the_reference():
    """Six launches into a 4-slot ring: ids, pos, ring, host and count as the reference leaves them; the ticket
    workspace is reused across vocabularies of different sizes."""
    got, ref = _outputs(), _outputs()
    ref["host"] = ref["host"].clone()
    gen = torch.Generator().manual_seed(0)
    for step, V in enumerate((4099, 4099, 100, 70000, 4099, 1)):
        x = torch.randn(V, generator=gen).to(torch.bfloat16).to(DEV)
        argmax_next(x, block=512, **got)
        token = argmax_next_ref(x, **ref)
        assert int(got["ids"]) == int(token), step
        for name in ("pos", "ring", "host", "count"):
            assert torch.equal(got[name].cpu(), ref[name].cpu()), (step, name)
    assert int(got["pos"]) == 13 and int(got["count"]) == 6


def test_checks():
    x = torch.randn(100, device=DEV)
    out = _outputs()
    with pytest.raises(ValueError, match="contiguous \\[V\\]"):
        argmax_next(x.view(10, 10), ids=out["ids"])
    with pytest.raises(ValueError, match="contiguous \\[V\\]"):
        argmax_next(x[::2], ids=out["ids"])
    with pytest.raises(ValueError, match="bf16/fp16/fp32"):
        argmax_next(x.to(torch.int32), ids=out["ids"])
    with pytest.raises(ValueError, match="ids must be a contiguous int64"):
        argmax_next(x, ids=out["ids"].int())
    with pytest.raises(ValueError, match="go together"):
        argmax_next(x, ring=out["ring"])
    with pytest.raises(ValueError, match="same slots"):
        argmax_next(x, ring=out["ring"], host=_outputs(R=2)["host"], count=out["count"])
    if DEV == "cuda":
        with pytest.raises(ValueError, match="pinned"):
            argmax_next(x, host=torch.zeros(4, dtype=torch.long), count=out["count"])
    with pytest.raises(ValueError, match="count must be int32"):
        argmax_next(x, ring=out["ring"], count=out["count"].long())
    with pytest.raises(ValueError, match="power of two"):
        argmax_next(x, ids=out["ids"], block=100)
