"""Reading MXFP4 rows in a Triton kernel: the @triton.jit helpers kernels/mxfp4_sparse.py's `_sparse_mxfp4_kernel`
decodes its gate / up rows and sums its down rows with, straight from the codes (no dequantized copy).

Owns `fp4_pair` (two codes of a word -> their values, no conversion instruction), `e8m0` (a scale byte -> 2**(s - 127)),
`part_words` (one load of a row block's code words for a part of the 32-blocks), `part_x` (x for those blocks, one
contiguous load split in registers), `part_dot` (x . W[n] over a part: the gate and up projections) and `part_down`
(sum_n h_n W[n, :] over a part, added into y atomically: the down projection); their flat forms `flat_words`,
`flat_x`, `flat_dot`, `flat_down` (a part's words as one 2-D [R, 4 NBP] tile, x loaded per nibble position, the down
columns added by eight strided atomics: no 3-D reshape or join); and `row_words`, `row_x`, `row_dot`, `row_down`,
which call one form or the other by a constexpr (the kernel's `FLAT` launch parameter).

Layout (kernels/mxfp4.py's `Mxfp4Tensor`): codes two per byte (element 2j in byte j's low nibble), read here as int32
words of 8 codes (word c of a row: elements 8c .. 8c + 7, 4 words a 32-block); along-H rows (gate, up) have one scale
a 32-block (scales [.., NB]), the transposed down rows share one scale row [H] per 32 neurons. H goes as parts of
NBP blocks (a power of two, blocks >= NB masked), each part one [R, NBP, 4] word tile.

* no conversion instructions: codes j and j + 4 of a word (16 bits apart) are decoded together (`fp4_pair`): their
  3 exponent / mantissa bits go to bits 8..6 and their signs to bit 15 of the word's two halves, each half then read
  as fp32 (bits 24..22 and 31), which is FP4 * 2**-126 (e = 0: fp32 subnormals, exact without flush-to-zero,
  Triton's default for mul / fma; checked on an H200); 3.5 integer ops a weight, against 5 decoding one code at a
  time (1.5-2 % faster at gpt-oss-20b shapes); x (gate, up) or h (down) comes in times 2**63 and each 32-block's sum
  goes out times 2**63 and its scale, so no product is subnormal.

Shape legend: R rows of a program, H hidden, NB = H / 32 blocks a row, NBP blocks of a part.
"""

from __future__ import annotations

try:  # Triton is optional at import time; the kernels need it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def fp4_pair(w, J: tl.constexpr):
        """Nibbles J and J + 4 (J 0..3: elements 8c + J and 8c + J + 4 of word c) of uint32 words w -> their FP4 values
        times 2**-126, two fp32. The two nibbles sit 16 bits apart, so one set of shifts and masks places both as bf16
        bit patterns in the two halves of a word (exponent / mantissa bits at 8..6, sign at 15), each half then read
        as fp32: 3.5 integer ops a weight, no conversion instruction (e = 0 gives fp32 subnormals, exact without
        flush-to-zero, Triton's default for mul / fma)."""
        if J <= 1:
            em = (w << (6 - 4 * J)) & 0x01C001C0
        else:
            em = (w >> (4 * J - 6)) & 0x01C001C0
        p = em | ((w << (12 - 4 * J)) & 0x80008000)
        return (p << 16).to(tl.float32, bitcast=True), (p & 0xFFFF0000).to(tl.float32, bitcast=True)

    @triton.jit
    def e8m0(s):
        """uint8 biased exponents (int32) -> 2**(s - 127) in fp32, exactly (0 is the subnormal 2**-127)."""
        return tl.where(s > 0, s << 23, 1 << 22).to(tl.float32, bitcast=True)

    @triton.jit
    def part_words(base, rows, rmask, J0: tl.constexpr, NBP: tl.constexpr, NB: tl.constexpr):
        """One load of rows' code words [R, NBP, 4] (uint32, 8 codes each) for the 32-blocks
        J0 .. J0 + NBP - 1 of an along-H MXFP4 row (NB blocks, 4 words a block); masked rows and blocks >= NB read
        nothing (0)."""
        jb = J0 + tl.arange(0, NBP)
        w4 = jb[:, None] * 4 + tl.arange(0, 4)[None, :]  # [NBP, 4]
        r64 = rows.to(tl.int64) * (NB * 4)
        off = r64[:, None, None] + w4[None]
        m = rmask[:, None, None] & (jb < NB)[None, :, None]
        return tl.load(base + off, mask=m, other=0).to(tl.uint32, bitcast=True)

    @triton.jit
    def part_x(x_row, J0: tl.constexpr, NBP: tl.constexpr, NB: tl.constexpr):
        """x (times 2**63) for the blocks J0 .. J0 + NBP - 1 as 8 tensors [NBP, 4]: element 8c + J of word c for J =
        0..7. One contiguous load (a word's 8 elements in one thread), split in registers; gate and up share it
        (instead of 8 strided loads a part and projection, each touching every cache line of x)."""
        jb = J0 + tl.arange(0, NBP)
        col = jb[:, None, None] * 32 + tl.arange(0, 4)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
        xv = tl.load(x_row + col, mask=(jb < NB)[:, None, None], other=0.0).to(tl.float32) * 9.223372036854775808e18
        c0, c1 = tl.split(tl.reshape(xv, [NBP, 4, 2, 2, 2]))  # [.., a, b, c]: J = 4a + 2b + c; c = 0 / 1
        b00, b01 = tl.split(c0)  # (c 0, b 0) / (c 0, b 1)
        b10, b11 = tl.split(c1)
        x0, x4 = tl.split(b00)
        x2, x6 = tl.split(b01)
        x1, x5 = tl.split(b10)
        x3, x7 = tl.split(b11)
        return x0, x1, x2, x3, x4, x5, x6, x7

    @triton.jit
    def part_dot(w, xs, s_base, rows, rmask, J0: tl.constexpr, NBP: tl.constexpr, NB: tl.constexpr):
        """x . W[n] over the blocks of `part_words` w with `part_x`'s xs: per 32-block the codes' dot with x (the sum
        out times 2**63), times the block's scale; [R] fp32."""
        jb = J0 + tl.arange(0, NBP)
        bm = jb < NB
        acc = tl.zeros(w.shape, dtype=tl.float32)
        r64 = rows.to(tl.int64) * NB
        for J in tl.static_range(4):
            lo, hi = fp4_pair(w, J)
            acc += lo * xs[J][None, :, :] + hi * xs[J + 4][None, :, :]
        part = tl.sum(acc, axis=2) * 9.223372036854775808e18  # [R, NBP]
        s = tl.load(s_base + r64[:, None] + jb[None, :], mask=rmask[:, None] & bm[None, :], other=0)
        return tl.sum(part * e8m0(s.to(tl.int32)), axis=1)

    @triton.jit
    def part_down(w, h3, ydst, srow, J0: tl.constexpr, NBP: tl.constexpr, NB: tl.constexpr):
        """Adds sum_n h_n W[n, c] into ydst for the columns of the blocks J0 .. J0 + NBP - 1: w the kept rows' down
        code words [R, NBP, 4] (`part_words`), h3 [R, 1, 1] (times 2**63), srow the rows' shared scale row [H]."""
        jb = J0 + tl.arange(0, NBP)
        bm = jb < NB
        lo, hi = fp4_pair(w, 0)
        c0 = tl.sum(lo * h3, axis=0)  # [NBP, 4]: column 32 jb + 8 q + J
        c4 = tl.sum(hi * h3, axis=0)
        lo, hi = fp4_pair(w, 1)
        c1 = tl.sum(lo * h3, axis=0)
        c5 = tl.sum(hi * h3, axis=0)
        lo, hi = fp4_pair(w, 2)
        c2 = tl.sum(lo * h3, axis=0)
        c6 = tl.sum(hi * h3, axis=0)
        lo, hi = fp4_pair(w, 3)
        c3 = tl.sum(lo * h3, axis=0)
        c7 = tl.sum(hi * h3, axis=0)
        # nested joins put J last: [NBP, 4, 2, 2, 2][.., a, b, c] = c_{4a + 2b + c}, i.e. columns in order
        j = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
        col = jb[:, None] * 32 + tl.arange(0, 32)[None, :]  # [NBP, 32]
        cm = bm[:, None] & (col >= 0)  # full shape (the interpreter applies a broadcast atomic mask to one element)
        sv = e8m0(tl.load(srow + col, mask=cm, other=0).to(tl.int32))
        contrib = tl.reshape(j, [NBP, 32]) * 9.223372036854775808e18 * sv
        tl.atomic_add(ydst + col, contrib, mask=cm, sem="relaxed")

    # ---- flat tiles: a part's words as one [R, 4 NBP] tile (word c of the row at column c), no 3-D reshapes ----

    @triton.jit
    def flat_words(base, rows, rmask, J0: tl.constexpr, NBP: tl.constexpr, NB: tl.constexpr):
        """`part_words` as one 2-D load: rows' code words [R, 4 NBP] (uint32) of the blocks J0 .. J0 + NBP - 1, word
        c of the row at column c - 4 J0; masked rows and words past the row read nothing (0)."""
        c = J0 * 4 + tl.arange(0, NBP * 4)
        off = rows.to(tl.int64)[:, None] * (NB * 4) + c[None, :]
        m = rmask[:, None] & (c < NB * 4)[None, :]
        return tl.load(base + off, mask=m, other=0).to(tl.uint32, bitcast=True)

    @triton.jit
    def flat_x(x_row, J0: tl.constexpr, NBP: tl.constexpr, NB: tl.constexpr):
        """x (times 2**63) for a `flat_words` part as 8 tensors [4 NBP]: element 8c + J for word c, J = 0..7, each one
        strided load (from L1); gate and up share them."""
        c = J0 * 4 + tl.arange(0, NBP * 4)
        cm = c < NB * 4
        S: tl.constexpr = 9.223372036854775808e18
        x0 = tl.load(x_row + c * 8, mask=cm, other=0.0).to(tl.float32) * S
        x1 = tl.load(x_row + c * 8 + 1, mask=cm, other=0.0).to(tl.float32) * S
        x2 = tl.load(x_row + c * 8 + 2, mask=cm, other=0.0).to(tl.float32) * S
        x3 = tl.load(x_row + c * 8 + 3, mask=cm, other=0.0).to(tl.float32) * S
        x4 = tl.load(x_row + c * 8 + 4, mask=cm, other=0.0).to(tl.float32) * S
        x5 = tl.load(x_row + c * 8 + 5, mask=cm, other=0.0).to(tl.float32) * S
        x6 = tl.load(x_row + c * 8 + 6, mask=cm, other=0.0).to(tl.float32) * S
        x7 = tl.load(x_row + c * 8 + 7, mask=cm, other=0.0).to(tl.float32) * S
        return x0, x1, x2, x3, x4, x5, x6, x7

    @triton.jit
    def flat_dot(w, xs, s_base, rows, rmask, J0: tl.constexpr, NBP: tl.constexpr, NB: tl.constexpr):
        """`part_dot` over a `flat_words` tile with `flat_x`'s xs: x . W[n] over the part, [R] fp32. Each word's
        partial sum is scaled by its block's scale (gathered per word) before the one row sum, so every tensor of the
        dot but x shares the words' layout."""
        c = J0 * 4 + tl.arange(0, NBP * 4)
        cm = c < NB * 4
        acc = tl.zeros(w.shape, dtype=tl.float32)
        for J in tl.static_range(4):
            lo, hi = fp4_pair(w, J)
            acc += lo * xs[J][None, :] + hi * xs[J + 4][None, :]
        s_off = rows.to(tl.int64)[:, None] * NB + (c // 4)[None, :]
        s = tl.load(s_base + s_off, mask=rmask[:, None] & cm[None, :], other=0)
        return tl.sum(acc * 9.223372036854775808e18 * e8m0(s.to(tl.int32)), axis=1)

    @triton.jit
    def flat_down_col(v, h2, ydst, srow, col, cm):
        """One nibble position's columns of the down projection: sum_n h_n v[n, :] (h2 [R, 1] times 2**63) times the
        columns' scales, added into ydst[col]."""
        sv = e8m0(tl.load(srow + col, mask=cm, other=0).to(tl.int32))
        tl.atomic_add(ydst + col, tl.sum(v * h2, axis=0) * 9.223372036854775808e18 * sv, mask=cm, sem="relaxed")

    @triton.jit
    def flat_down(w, h2, ydst, srow, J0: tl.constexpr, NBP: tl.constexpr, NB: tl.constexpr):
        """`part_down` over a `flat_words` tile of the kept rows' down words: the eight nibble positions' column sums
        go into ydst as eight strided atomic adds (columns 8c + J), with no join of the columns into order."""
        c = J0 * 4 + tl.arange(0, NBP * 4)
        cm = c < NB * 4
        for J in tl.static_range(4):
            lo, hi = fp4_pair(w, J)
            flat_down_col(lo, h2, ydst, srow, c * 8 + J, cm)
            flat_down_col(hi, h2, ydst, srow, c * 8 + (J + 4), cm)

    # ---- one call for either tile form (FLAT: the flat helpers above, else the 3-D ones) ----

    @triton.jit
    def row_words(base, rows, rmask, J0: tl.constexpr, NBP: tl.constexpr, NB: tl.constexpr, FLAT: tl.constexpr):
        if FLAT:
            return flat_words(base, rows, rmask, J0, NBP, NB)
        else:
            return part_words(base, rows, rmask, J0, NBP, NB)

    @triton.jit
    def row_x(x_row, J0: tl.constexpr, NBP: tl.constexpr, NB: tl.constexpr, FLAT: tl.constexpr):
        if FLAT:
            return flat_x(x_row, J0, NBP, NB)
        else:
            return part_x(x_row, J0, NBP, NB)

    @triton.jit
    def row_dot(w, xs, s_base, rows, rmask, J0: tl.constexpr, NBP: tl.constexpr, NB: tl.constexpr, FLAT: tl.constexpr):
        if FLAT:
            return flat_dot(w, xs, s_base, rows, rmask, J0, NBP, NB)
        else:
            return part_dot(w, xs, s_base, rows, rmask, J0, NBP, NB)

    @triton.jit
    def row_down(w, h, ydst, srow, J0: tl.constexpr, NBP: tl.constexpr, NB: tl.constexpr, FLAT: tl.constexpr):
        """Adds sum_n h_n W[n, :] over a part (h [R] times 2**63) into ydst."""
        if FLAT:
            flat_down(w, h[:, None], ydst, srow, J0, NBP, NB)
        else:
            part_down(w, h[:, None, None], ydst, srow, J0, NBP, NB)
