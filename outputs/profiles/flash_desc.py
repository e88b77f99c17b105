"""Probe kernel: the flash forward with K and V read through device-side tensor descriptors (TMA;
the launch needs ``triton.set_allocator`` for the descriptors' scratch), and ``tl.range(...,
warp_specialize=WS)``. Compiled for sm_90 by triton 3.6 (offline, no GPU): WS=True with 8 warps
compiles to the same kernel as WS=False (no partitions in the TTGIR), and with 4 warps the
NVGPUWarpSpecialization pass fails (an MLIR dominance assertion), so only WS=False was timed
(``attention_variants_probe.py``)."""
import triton
import triton.language as tl
from fused_softmax_matmul import _flash_program, _flash_tile_ptrs, _flash_key_range, _flash_visible, LN_2


@triton.jit
def _desc_tiles(acc, m, l, q, rows, k_desc, v_desc, key_start, key_end, n_keys, qk_scale,
                BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, WS: tl.constexpr):
    for start in tl.range(key_start, key_end, BLOCK_N, warp_specialize=WS):
        keys = start + tl.arange(0, BLOCK_N)
        k = k_desc.load([start, 0])
        v = v_desc.load([start, 0])
        s = tl.dot(q, tl.trans(k))
        if MASKED:
            s = tl.where(_flash_visible(rows, keys, n_keys, IS_CAUSAL), s * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
        else:
            m_new = tl.maximum(m, tl.max(s, axis=1) * qk_scale)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        if MASKED:
            p = tl.math.exp2(s - m_sub[:, None])
        else:
            p = tl.math.exp2(s * qk_scale - m_sub[:, None])
        alpha = tl.math.exp2(m - m_sub)
        l = l * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m = m_new
    return acc, m, l


@triton.jit
def flash_forward_desc_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    n_batch, n_queries, n_keys, qk_scale,
    stride_qb, stride_qm, stride_kb, stride_kn, stride_vb, stride_vn, stride_ob, stride_om, stride_lb,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, WS: tl.constexpr,
):
    qk_scale = tl.cast(qk_scale, tl.float32)
    batch, tile = _flash_program(n_batch, n_queries, BLOCK_M, IS_CAUSAL)
    query_start = tile * BLOCK_M
    rows = query_start + tl.arange(0, BLOCK_M)
    row_ok = rows < n_queries
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(_flash_tile_ptrs(q_ptr, batch, rows, dims, stride_qb, stride_qm, 1), mask=row_ok[:, None], other=0.0)
    k_desc = tl.make_tensor_descriptor(k_ptr + batch * stride_kb, shape=[n_keys, HEAD_DIM], strides=[stride_kn, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(v_ptr + batch * stride_vb, shape=[n_keys, HEAD_DIM], strides=[stride_vn, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    full_end, key_end = _flash_key_range(query_start, n_keys, BLOCK_M, BLOCK_N, IS_CAUSAL)
    acc, m, l = _desc_tiles(acc, m, l, q, rows, k_desc, v_desc, 0, full_end, n_keys, qk_scale,
                            BLOCK_N, False, IS_CAUSAL, WS)
    acc, m, l = _desc_tiles(acc, m, l, q, rows, k_desc, v_desc, full_end, key_end, n_keys, qk_scale,
                            BLOCK_N, True, IS_CAUSAL, False)
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(_flash_tile_ptrs(o_ptr, batch, rows, dims, stride_ob, stride_om, 1),
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + batch * stride_lb + rows, (m + tl.math.log2(l)) * LN_2, mask=row_ok)
