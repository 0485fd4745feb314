"""The Triton kernels of the ``triton`` backend (see ``fp8ref.kernels.triton_kernels``).

Kept in their own module because ``triton.jit`` decides at definition time whether to compile or
interpret (``TRITON_INTERPRET``), and jit functions must be module globals to call each other:
``triton_kernels`` imports this module on first use, never at ``import fp8ref``.
"""

import triton
import triton.language as tl


@triton.jit
def _rne_e4m3_bits(v):
    # RNE of fp32 v (|v| <= 448) to an E4M3FN code with integer ops only: the interpreter's
    # float8e4nv cast rounds wrongly (triton#8322). Mirrored in torch by rne_e4m3_reference,
    # whose docstring derives it; a carry out of r moves into the exponent field by itself.
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    e = (a >> 23) - 127
    m = (a & 0x7FFFFF) | 0x800000
    sh = tl.minimum(tl.maximum(14 - e, 20), 25)
    r = m >> sh
    rem = m & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    up = (rem > half) | ((rem == half) & ((r & 1) == 1))
    r = r + up.to(tl.int32)
    code = ((tl.maximum(e, -6) + 6) << 3) + r
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, bad_ptr, M, K, G, n_groups, stride_x, stride_q,
                  qmax, floor, tiny, STATIC: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # One program quantizes ROWS rows of one group (per-row: the whole row; per-tensor: a chunk of
    # columns of at most G): a [ROWS, BLOCK] tile per step, one scale per row of the tile.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    grp = tl.program_id(1)
    k_start = grp * G
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_q
    amax = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    nbad = tl.zeros([ROWS, BLOCK], dtype=tl.int32)
    for off in range(0, G, BLOCK):
        local = off + tl.arange(0, BLOCK)
        cols = k_start + local
        mask = row_ok[:, None] & ((local < G) & (cols < K))[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        ax = tl.abs(x)
        # tl.maximum may drop NaN, so non-finite inputs are counted, and the host raises.
        nbad += ((ax != ax) | (ax == float("inf"))).to(tl.int32)
        amax = tl.maximum(amax, ax)
    tl.store(bad_ptr + rows * n_groups + grp, tl.sum(nbad, axis=1), mask=row_ok)
    if STATIC:
        s = tl.zeros([ROWS], dtype=tl.float32) + tl.load(s_ptr)
    else:
        # div_rn: "/" on fp32 compiles to an approximate division on CUDA; the spec divides exactly.
        s = tl.math.div_rn(tl.maximum(tl.max(amax, axis=1), floor), tl.zeros([ROWS], dtype=tl.float32) + qmax)
        s = tl.where(s == 0.0, 1.0, s)
        s = tl.maximum(s, tiny)
        tl.store(s_ptr + rows * n_groups + grp, s, mask=row_ok)
    for off in range(0, G, BLOCK):
        local = off + tl.arange(0, BLOCK)
        cols = k_start + local
        mask = row_ok[:, None] & ((local < G) & (cols < K))[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        v = tl.math.div_rn(x, tl.zeros([ROWS, BLOCK], dtype=tl.float32) + s[:, None])
        v = tl.minimum(tl.maximum(v, -qmax), qmax)
        tl.store(q_rows + cols[None, :], _rne_e4m3_bits(v), mask=mask)


@triton.jit
def _mm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, c_ptr, M, N, K,
               stride_am, stride_bn, stride_cm, sa_sm, sa_sk, sb_sn, sb_sk, B_ROWS,
               HAS_BIAS: tl.constexpr, SEGMENTED: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + rn.to(tl.int64)[None, :] * stride_bn
    sa_rows = sa_ptr + rm * sa_sm
    sb_cols = sb_ptr + (rn // B_ROWS) * sb_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    out = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & (k[None, :] < K), other=0.0)
        b = tl.load(b_cols + k[:, None], mask=(k[:, None] < K) & n_ok[None, :], other=0.0)
        if SEGMENTED:
            # BLOCK_K is the scale block width: each K-block is one segment with its own scales.
            # max_num_imprecise_acc=0: Hopper's default lets fp8 dots accumulate 2**30 products
            # in the tensor core's reduced-precision accumulator.
            part = tl.dot(a, b, out_dtype=tl.float32, max_num_imprecise_acc=0)
            seg = k0 // BLOCK_K
            sa = tl.load(sa_rows + seg * sa_sk, mask=m_ok, other=0.0)
            sb = tl.load(sb_cols + seg * sb_sk, mask=n_ok, other=0.0)
            out += part * sa[:, None] * sb[None, :]
        else:
            acc = tl.dot(a, b, acc, out_dtype=tl.float32, max_num_imprecise_acc=0)
    if not SEGMENTED:
        sa = tl.load(sa_rows, mask=m_ok, other=0.0)
        sb = tl.load(sb_cols, mask=n_ok, other=0.0)
        out = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn, mask=n_ok, other=0.0)[None, :]
    # fp32 store: the interpreter truncates bf16 stores, so torch rounds to out_dtype once, on the host.
    c = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(c, out, mask=m_ok[:, None] & n_ok[None, :])
