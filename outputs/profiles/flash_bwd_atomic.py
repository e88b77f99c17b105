"""Probe: one backward kernel, dK and dV per key tile as now, dQ added by atomics into a float32 buffer."""
import triton
import triton.language as tl
from fused_softmax_matmul import _flash_program, _flash_tile_ptrs, _flash_load_lse, _dot_acc


@triton.jit
def _tiles(dk, dv, k, v, keys, q_ptrs, do_ptrs, dq_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_gm, stride_lm, stride_dm,
           query_start, query_end, n_queries, qk_scale,
           BLOCK_M: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
           HEAD_DIM: tl.constexpr):
    for start in range(query_start, query_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < n_queries
        q = tl.load(q_ptrs + start * stride_qm, mask=row_ok[:, None], other=0.0)
        do = tl.load(do_ptrs + start * stride_gm, mask=row_ok[:, None], other=0.0)
        lse = _flash_load_lse(lse_ptrs, rows * stride_lm, row_ok)
        delta = tl.load(delta_ptrs + rows * stride_dm, mask=row_ok, other=0.0)
        sT = _dot_acc(k, tl.trans(q), tl.zeros((k.shape[0], BLOCK_M), tl.float32), PRECISION, UPCAST)
        pT = tl.math.exp2(sT * qk_scale - lse[None, :])
        if MASKED:
            keep = row_ok[None, :]
            if IS_CAUSAL:
                keep = keep & (keys[:, None] <= rows[None, :])
            pT = tl.where(keep, pT, 0.0)
        dv = _dot_acc(pT.to(do.dtype), do, dv, PRECISION, UPCAST)
        dpT = _dot_acc(v, tl.trans(do), tl.zeros((k.shape[0], BLOCK_M), tl.float32), PRECISION, UPCAST)
        dsT = pT * (dpT - delta[None, :])
        if MASKED:
            dsT = tl.where(keep, dsT, 0.0)
        ds = dsT.to(q.dtype)
        dk = _dot_acc(ds, q, dk, PRECISION, UPCAST)
        dq = _dot_acc(tl.trans(ds), k, tl.zeros((BLOCK_M, HEAD_DIM), tl.float32), PRECISION, UPCAST)
        tl.atomic_add(dq_ptrs + start * HEAD_DIM, dq, mask=row_ok[:, None], sem="relaxed")
    return dk, dv


@triton.jit
def flash_backward_atomic_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dq_ptr,
    n_batch, n_queries, n_keys, sm_scale, qk_scale,
    stride_qb, stride_qm, stride_qd,
    stride_kb, stride_kn, stride_kd,
    stride_vb, stride_vn, stride_vd,
    stride_gb, stride_gm, stride_gd,
    stride_lb, stride_lm,
    stride_db, stride_dm,
    stride_dkb, stride_dkn, stride_dkd,
    stride_dvb, stride_dvn, stride_dvd,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    sm_scale = tl.cast(sm_scale, tl.float32)
    qk_scale = tl.cast(qk_scale, tl.float32)
    batch, tile = _flash_program(n_batch, n_keys, BLOCK_N, False)
    key_start = tile * BLOCK_N
    keys = key_start + tl.arange(0, BLOCK_N)
    key_ok = keys < n_keys
    dims = tl.arange(0, HEAD_DIM)
    k = tl.load(_flash_tile_ptrs(k_ptr, batch, keys, dims, stride_kb, stride_kn, stride_kd), mask=key_ok[:, None], other=0.0)
    v = tl.load(_flash_tile_ptrs(v_ptr, batch, keys, dims, stride_vb, stride_vn, stride_vd), mask=key_ok[:, None], other=0.0)
    tile_rows = tl.arange(0, BLOCK_M)
    q_ptrs = _flash_tile_ptrs(q_ptr, batch, tile_rows, dims, stride_qb, stride_qm, stride_qd)
    do_ptrs = _flash_tile_ptrs(do_ptr, batch, tile_rows, dims, stride_gb, stride_gm, stride_gd)
    dq_ptrs = _flash_tile_ptrs(dq_ptr, batch, tile_rows, dims, n_queries * HEAD_DIM, HEAD_DIM, 1)
    lse_ptrs = lse_ptr + batch * stride_lb
    delta_ptrs = delta_ptr + batch * stride_db
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    if IS_CAUSAL:
        diagonal_start = key_start // BLOCK_M * BLOCK_M
        full_start = tl.cdiv(key_start + BLOCK_N, BLOCK_M) * BLOCK_M
        dk, dv = _tiles(dk, dv, k, v, keys, q_ptrs, do_ptrs, dq_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_gm, stride_lm, stride_dm,
                        diagonal_start, tl.minimum(full_start, n_queries), n_queries, qk_scale,
                        BLOCK_M, True, True, PRECISION, UPCAST, HEAD_DIM)
    ragged_start = n_queries // BLOCK_M * BLOCK_M
    if IS_CAUSAL:
        ragged_from = tl.maximum(full_start, ragged_start)
    else:
        full_start = 0
        ragged_from = ragged_start
    dk, dv = _tiles(dk, dv, k, v, keys, q_ptrs, do_ptrs, dq_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_gm, stride_lm, stride_dm,
                    full_start, ragged_start, n_queries, qk_scale, BLOCK_M, False, False, PRECISION, UPCAST, HEAD_DIM)
    dk, dv = _tiles(dk, dv, k, v, keys, q_ptrs, do_ptrs, dq_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_gm, stride_lm, stride_dm,
                    ragged_from, n_queries, n_queries, qk_scale, BLOCK_M, True, False, PRECISION, UPCAST, HEAD_DIM)
    dk = dk * sm_scale
    tl.store(_flash_tile_ptrs(dk_ptr, batch, keys, dims, stride_dkb, stride_dkn, stride_dkd), dk.to(dk_ptr.dtype.element_ty), mask=key_ok[:, None])
    tl.store(_flash_tile_ptrs(dv_ptr, batch, keys, dims, stride_dvb, stride_dvn, stride_dvd), dv.to(dv_ptr.dtype.element_ty), mask=key_ok[:, None])


def backward_atomic(Q, K, V, O, L, dO, is_causal, block_m, block_n, num_warps, num_stages, prec_args):
    """dQ, dK, dV: D = rowsum(dO * O) by PyTorch (at 0feb774, when this ran, by the row-sum kernel
    since removed), the atomic kernel and a scale-and-cast of the float32 dQ."""
    import torch
    batch, n_queries, d = Q.shape
    n_keys = K.shape[1]
    delta = (O.float() * dO.float()).sum(-1)
    dq32 = torch.zeros((batch, n_queries, d), dtype=torch.float32, device=Q.device)
    dK, dV = torch.empty_like(K), torch.empty_like(V)
    flash_backward_atomic_kernel[(batch * triton.cdiv(n_keys, block_n),)](
        Q, K, V, dO, L, delta, dK, dV, dq32, batch, n_queries, n_keys, d ** -0.5, d ** -0.5 * 1.4426950408889634,
        *Q.stride(), *K.stride(), *V.stride(), *dO.stride(), *L.stride(), *delta.stride(), *dK.stride(), *dV.stride(),
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, IS_CAUSAL=is_causal, num_warps=num_warps, num_stages=num_stages,
        **prec_args)
    return (dq32 * d ** -0.5).to(Q.dtype), dK, dV
