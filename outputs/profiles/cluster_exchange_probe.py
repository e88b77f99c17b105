"""Long rows over a thread-block cluster: each of the cluster's C CTAs holds 1/C of a row in
registers, and the CTAs exchange their chunks' (max, sum) and meet at the hardware cluster
barrier, against the split kernel (the rule) and copy.

The rule for long rows (``softmax_split_row_kernel``) splits a row over a group of programs that
publish (max, sum) to global memory, count themselves in an atomic counter and spin until the
group has arrived; it reads long 16-bit rows at 86-93 % of copy, and the wait on the group is the
suspect. A cluster's CTAs are scheduled together, so a cluster barrier waits only on CTAs that
started together, and costs no polling. Plain Triton cannot compile these reductions with
num_ctas > 1 under triton 3.6, so the kernel is Gluon, with a layout that gives row k of a
[C, CHUNK] tile to CTA k: every reduction stays inside a CTA, and each CTA stores its own values.
Gluon 3.6 has no cluster API: the barrier and the distributed shared memory are inline PTX.

Two exchanges: ``global`` writes each CTA's pair to a float32 workspace and reads the cluster's
pairs from L2 after the barrier; ``dsmem`` writes the pair into every CTA's shared memory
(``mapa`` + ``st.shared::cluster``) and reads its own after the barrier. Persistent clusters (as
many as fit at once, and twice that) loop over rows; a third grid launches a cluster a row.
Slots alternate row by row, so a slot is written again only after the next row's barrier, which
every CTA reaches only once it has read the row before.

Run on an H100 (cluster_exchange_probe.txt). The dsmem exchange here writes into the other
CTAs' shared memory without first waiting for all of the cluster's CTAs to start, which CUDA
asks for (cluster_wide_probe.py waits); its outputs matched torch's all the same. A variant that
spills is skipped (the dsmem exchange at 32 values a thread over 32 warps, the 50257-column rows'
larger chunks). do_bench means, ms (L2 flushed); each output against torch's in float32.
The 50257-column rows are not 16-byte aligned, so their loads and stores go value by value: that
case checks the masks, its speed says little about the barrier. From the repository root on an H100:

    PYTHONPATH=. python3 outputs/profiles/cluster_exchange_probe.py
"""
import ctypes

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

import online_softmax as osm

GiB = 2**30
LOG2_E = gl.constexpr(1.4426950408889634)
EXCHANGES = ("global", "dsmem")


@gluon.constexpr_function
def cluster_layout(vec, warps, ctas):
    """[ctas, CHUNK] with row k in CTA k. Along a row it is an ordinary one-CTA layout, so
    reductions along it stay inside a CTA (triton 3.6 asserts on reductions across CTAs), and a
    [ctas] slice of it holds one value a CTA, which that CTA stores: a layout replicated across
    the CTAs would be stored by CTA 0 only."""
    return gl.BlockedLayout([1, vec], [1, 32], [1, warps], [1, 0], [[1 << k, 0] for k in range(ctas.bit_length() - 1)])


@gluon.jit
def cluster_barrier(like):
    """Zeros shaped like ``like``, returned after the cluster barrier. ``like`` must hold one value
    a thread, so that each thread runs the barrier once (the asm is emitted per value) and every
    thread runs it (``.aligned``). Release and acquire at cluster scope: every CTA's writes before
    it are seen by every CTA after it (ptxas for sm_90 makes them MEMBAR.ALL.GPU in every warp
    before the arrive, and an L1 invalidation after the wait). Loads that take the zeros into
    their addresses cannot be issued before it."""
    return gl.inline_asm_elementwise(
        "barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; mov.u32 $0, 0;",
        "=r,r", [like], dtype=gl.int32, is_pure=False, pack=1)


@gluon.constexpr_function
def dsmem_exchange_asm(ctas):
    """PTX taking ($2, $3) = this CTA's (max, sum) and $4 = the slot's parity, returning
    ($0, $1) = the row's max and the sum of every CTA's sum scaled to it. Thread t < ctas writes the
    pair into CTA t's exchange buffer; after the cluster barrier every thread reads its own CTA's.
    One asm statement owns the buffer, as each statement's ``.shared`` declaration is its own
    variable: the kernel must emit it once (one value a thread, no unrolled copy)."""
    def scaled(k, first):
        step = "mul.f32 S, s, e;" if first else "fma.rn.f32 S, s, e, S;"
        # exp2((m - M) * log2 e), as the kernel's exponentials (ex2.approx.ftz): 0 for an empty
        # chunk (m = -inf), NaN where M is -inf or NaN, so such rows stay NaN as torch's.
        return (f"ld.shared.v2.f32 {{m, s}}, [slot+{8 * k}]; sub.f32 e, m, M; mul.f32 e, e, 0f3FB8AA3B; "
                f"ex2.approx.ftz.f32 e, e; {step}")
    lines = [
        "{", f".shared .align 16 .b32 xchg[{4 * ctas}];",  # [parity][cta][max, sum]
        ".reg .b32 slot, mine, far, t; .reg .pred p; .reg .f32 m, s, M, S, e;",
        "mov.u32 slot, xchg;", f"mad.lo.u32 slot, $4, {8 * ctas}, slot;",
        "mov.u32 t, %cluster_ctarank;", "mad.lo.u32 mine, t, 8, slot;",
        "mov.u32 t, %tid.x;", f"setp.lt.u32 p, t, {ctas};",
        "@p mapa.shared::cluster.u32 far, mine, t;", "@p st.shared::cluster.v2.f32 [far], {$2, $3};",
        "barrier.cluster.arrive.release.aligned;", "barrier.cluster.wait.acquire.aligned;",
        "ld.shared.f32 M, [slot];"]
    lines += [f"ld.shared.f32 m, [slot+{8 * k}]; max.f32 M, M, m;" for k in range(1, ctas)]
    lines += [scaled(k, k == 0) for k in range(ctas)]
    lines += ["mov.f32 $0, M;", "mov.f32 $1, S;", "}"]
    return " ".join(lines)


@gluon.jit(do_not_specialize=["n_clusters"])  # one compiled kernel for every grid
def cluster_softmax_kernel(x_ptr, y_ptr, stats_ptr, n_rows, n_cols, stride_x, stride_y, span, n_clusters,
                           CHUNK: gl.constexpr, VEC: gl.constexpr, WARPS: gl.constexpr, CTAS: gl.constexpr,
                           DSMEM: gl.constexpr, EVEN: gl.constexpr):
    """Softmax of rows ``program_id``, + n_clusters, ...; CTA k of the cluster holds columns
    [k * span, (k + 1) * span) of the row (span <= CHUNK; ``span * CTAS >= n_cols``; EVEN where
    span == CHUNK and span * CTAS == n_cols).

    Under num_ctas > 1 program_id and num_programs count clusters (%clusterid.x, %nclusterid.x).
    A chunk of only -inf (past the row's end, or in the data) has max -inf and is shifted by 0, so
    it adds sum 0 and no NaN; a NaN or +inf logit makes its row NaN, as torch's. ``stats`` (global
    exchange): [n_clusters, 2 parities, CTAS, (max, sum)] float32.
    """
    X: gl.constexpr = cluster_layout(VEC, WARPS, CTAS)
    PEERS: gl.constexpr = cluster_layout(1, WARPS, CTAS)
    EXCHANGE: gl.constexpr = dsmem_exchange_asm(CTAS)
    ranks = gl.arange(0, CTAS, layout=gl.SliceLayout(1, X))
    cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, X))
    offs = (ranks * span)[:, None] + cols[None, :]
    if EVEN:
        # Chunks of CHUNK columns that tile the row: no masks, whose predicates would take
        # registers that rows of 32 float32 values a thread over 1024 threads do not have.
        mask = None
        other = None
    else:
        mask = (cols < span)[None, :] & (offs < n_cols)
        other = float("-inf")
    # [CTAS] with one value a CTA, held by every thread of it: one barrier (or exchange) a thread.
    me = gl.arange(0, CTAS, layout=gl.SliceLayout(1, PEERS))
    peers = gl.arange(0, CTAS, layout=gl.SliceLayout(0, PEERS))
    cluster = gl.program_id(0)
    parity = 0
    for row in range(cluster, n_rows, n_clusters):
        x = gl.load(x_ptr + row.to(gl.int64) * stride_x + offs, mask=mask, other=other).to(gl.float32)
        m = gl.max(x, 1)
        x = gl.exp2((x - gl.where(m == float("-inf"), 0.0, m)[:, None]) * LOG2_E)
        s = gl.sum(x, 1)
        if DSMEM:
            row_max, row_sum = gl.inline_asm_elementwise(EXCHANGE, "=f,=f,f,f,r", [m, s, ranks * 0 + parity],
                                                         dtype=(gl.float32, gl.float32), is_pure=False, pack=1)
        else:
            slots = stats_ptr + (cluster * 2 + parity) * (2 * CTAS)
            gl.store(slots + ranks * 2, m)
            gl.store(slots + ranks * 2 + 1, s)
            # .cg: the pairs come from L2, where the other CTAs' stores are; not from this SM's L1.
            table = slots + (cluster_barrier(me)[:, None] + peers[None, :]) * 2
            ms = gl.load(table, cache_modifier=".cg")
            ss = gl.load(table + 1, cache_modifier=".cg")
            row_max = gl.max(ms, 1)
            row_sum = gl.sum(ss * gl.exp2((ms - row_max[:, None]) * LOG2_E), 1)
            row_max = gl.convert_layout(row_max, gl.SliceLayout(1, X))
            row_sum = gl.convert_layout(row_sum, gl.SliceLayout(1, X))
        # exp(x - row_max) / row_sum = exp(x - m) * scale; an empty chunk scales its zeros by 0.
        scale = gl.exp2((m - row_max) * LOG2_E) / row_sum
        gl.store(y_ptr + row.to(gl.int64) * stride_y + offs, (x * scale[:, None]).to(y_ptr.dtype.element_ty), mask=mask)
        parity = 1 - parity


def cluster_span(n_cols: int, ctas: int, itemsize: int) -> int:
    """Columns a CTA takes: an even share of the row, rounded up to 128 bytes so that each CTA's
    chunk starts on a cache line (in a row that does) and Triton sees a multiple of 16."""
    line = 128 // itemsize
    return triton.cdiv(triton.cdiv(n_cols, ctas), line) * line


def cluster_softmax(x, ctas: int, warps: int, clusters: int, exchange: str, stats, span: int = 0):
    """Softmax of each row of a contiguous 2-D x over ``clusters`` persistent clusters of ``ctas``
    CTAs; returns (y, the compiled kernel). ``stats``: float32, at least clusters * 4 * ctas."""
    n_rows, n_cols = x.shape
    span = span or cluster_span(n_cols, ctas, x.element_size())
    chunk = triton.next_power_of_2(span)
    y = torch.empty_like(x)
    kernel = cluster_softmax_kernel[(clusters,)](
        x, y, stats, n_rows, n_cols, x.stride(0), y.stride(0), span, clusters,
        CHUNK=chunk, VEC=16 // x.element_size(), WARPS=warps, CTAS=ctas, DSMEM=exchange == "dsmem",
        EVEN=span == chunk and span * ctas == n_cols, num_warps=warps, num_ctas=ctas)
    return y, kernel


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("n_attrs", ctypes.c_uint)]


def resident_clusters(kernel, ctas: int, warps: int) -> tuple[int, str]:
    """Clusters of ``kernel`` that fit on the device at once, and where the number comes from:
    the driver's cuOccupancyMaxActiveClusters (which knows how clusters pack into GPCs), else
    SMs // ctas times the CTAs a SM holds by registers and threads."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        attr = _LaunchAttribute(id=4)  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value[0], attr.value[1], attr.value[2] = ctas, 1, 1
        config = _LaunchConfig(grid=(ctypes.c_uint * 3)(ctas, 1, 1), block=(ctypes.c_uint * 3)(32 * warps, 1, 1),
                               shared=kernel.metadata.shared, stream=None, attrs=ctypes.pointer(attr), n_attrs=1)
        count = ctypes.c_int(0)
        err = cuda.cuOccupancyMaxActiveClusters(ctypes.byref(count), ctypes.c_void_p(kernel.function),
                                                ctypes.byref(config))
        if err == 0 and count.value > 0:
            return count.value, "driver"
    except Exception:  # noqa: BLE001 - no answer from the driver: estimate below
        pass
    # Registers are given out a warp at a time, in units of 256 (8 a thread).
    per_sm = min(65536 // (triton.cdiv(kernel.n_regs, 8) * 8 * 32 * warps), 2048 // (32 * warps), 32)
    return max(1, SMS // ctas * per_sm), "estimate"


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150)


def variants(n_cols: int, itemsize: int):
    """(ctas, warps, values a thread) with 8 to 64 values a thread, and at most 32 at 32 warps:
    1024 threads leave a thread 64 registers, which 64 float32 values would fill. Whatever still
    spills is skipped at run time (``n_spills``)."""
    for ctas in (2, 4, 8):
        chunk = triton.next_power_of_2(cluster_span(n_cols, ctas, itemsize))
        for warps in (4, 8, 16, 32):
            per_thread = chunk // (32 * warps)
            if 8 <= per_thread <= (32 if warps == 32 else 64):
                yield ctas, warps, per_thread


def error(y, want):
    """Largest |y - want|, and whether the NaNs of the two sit in the same places."""
    nan = torch.isnan(y.float())
    same_nan = bool(torch.equal(nan, torch.isnan(want.float())))
    diff = (y.float() - want.float()).abs().masked_fill(nan | torch.isnan(want.float()), 0.0)
    return diff.max().item() if diff.numel() else 0.0, same_nan


def check_edges():
    """Small bf16 rows against torch: a row of only -inf (NaN as torch's), one holding a NaN, one
    holding +inf, one finite value among -inf, and widths whose last chunk holds 1 to 3 columns or
    which leave whole CTAs past the row's end (span given, as a chunk boundary falls there)."""
    span, warps = 2048, 4  # one small compiled kernel a (ctas, exchange), 16 values a thread
    stats = torch.zeros(64 * 4 * 8, device="cuda", dtype=torch.float32)
    for ctas in (2, 4, 8):
        for exchange in EXCHANGES:
            worst, wrong = 0.0, []
            for n_cols in [(ctas - 1) * span + r for r in (1, 2, 3)] + [span + 1, 5]:
                x = torch.randn(11, n_cols, device="cuda", dtype=torch.bfloat16) * 4
                x[1] = float("-inf")
                x[2, n_cols // 2] = float("nan")
                x[3, -1] = float("inf")
                x[4] = float("-inf")
                x[4, -1] = 3.0
                x[5, :n_cols - 1] = -1e4  # a row's tail chunk far above its other chunks
                want = torch.softmax(x.float(), -1).to(x.dtype)
                try:
                    y, _ = cluster_softmax(x, ctas, warps, 3, exchange, stats, span=span)
                except Exception as e:  # noqa: BLE001 - a variant that cannot compile or launch: say so, go on
                    wrong.append(f"{n_cols}: {type(e).__name__}: {str(e)[:160]}")
                    break
                err, same_nan = error(y, want)
                worst = max(worst, err)
                if not same_nan or err > 1e-2:
                    wrong.append(f"{n_cols}: max |y - torch| {err:.1e}, NaNs {'match' if same_nan else 'DIFFER'}")
            print(f"edges, {ctas} CTAs {exchange}: {'; '.join(wrong) if wrong else 'ok'} "
                  f"(max |y - torch| {worst:.1e})", flush=True)


CASES = ((65536, "bfloat16", GiB // 4), (65536, "bfloat16", 2 * GiB), (128256, "bfloat16", GiB // 4),
         (151936, "bfloat16", GiB // 4), (262144, "bfloat16", GiB // 4), (262144, "bfloat16", 2 * GiB),
         (50257, "bfloat16", GiB // 4), (65536, "float32", GiB // 4), (262144, "float32", GiB // 4))
GRIDS = ("1x", "2x", "rows")
SMS = torch.cuda.get_device_properties(0).multi_processor_count


def main():
    print(f"# {torch.cuda.get_device_name()}, {SMS} SMs, torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    count = sum(len(list(variants(n, getattr(torch, name).itemsize))) for n, name, _ in CASES)
    print(f"# up to {count * len(EXCHANGES) * len(GRIDS)} cluster variants over {len(CASES)} cases (those that "
          f"spill are skipped); grids: 1x and 2x the resident clusters, a cluster a row", flush=True)
    check_edges()
    for n, name, nbytes in CASES:
        dtype = getattr(torch, name)
        rows = nbytes // (n * dtype.itemsize)
        x = torch.randn(rows, n, device="cuda", dtype=dtype) * 4
        want = torch.softmax(x.float(), -1).to(dtype)
        copy_ms = bench(lambda: x.clone())
        rule_ms = bench(lambda: osm.row_softmax(x))
        print(f"== {rows} x {n} {name}: copy {copy_ms:.4f}, rule ({osm._row_launch(rows, n, n, dtype, 0, 0).kernel}) "
              f"{rule_ms:.4f} ms ({copy_ms / rule_ms:.1%} of copy)", flush=True)
        stats = torch.zeros((rows + 2 * SMS) * 4 * 8, device="cuda", dtype=torch.float32)
        for ctas, warps, per_thread in variants(n, dtype.itemsize):
            for exchange in EXCHANGES:
                what = f"  {ctas} CTAs x {warps} warps ({per_thread} values a thread), {exchange}"
                try:
                    _, kernel = cluster_softmax(x, ctas, warps, rows, exchange, stats)  # compiles
                    resident, source = resident_clusters(kernel, ctas, warps)
                except Exception as e:  # noqa: BLE001 - a variant that cannot compile or launch: say so, go on
                    print(f"{what}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                if kernel.n_spills:
                    # Spilled values go through local memory every row: not the idea under test.
                    print(f"{what}: {kernel.n_regs} registers, n_spills {kernel.n_spills}: skipped", flush=True)
                    continue
                print(f"{what}: {kernel.n_regs} registers, {resident} clusters resident ({source})", flush=True)
                for grid in GRIDS:
                    clusters = {"1x": resident, "2x": 2 * resident, "rows": rows}[grid]
                    try:
                        y, _ = cluster_softmax(x, ctas, warps, clusters, exchange, stats)
                        ms = bench(lambda: cluster_softmax(x, ctas, warps, clusters, exchange, stats))
                    except Exception as e:  # noqa: BLE001
                        print(f"    grid {grid}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                        continue
                    err, same_nan = error(y, want)
                    print(f"    grid {grid} ({clusters} clusters): {ms:.4f} ms ({copy_ms / ms:.1%} of copy, "
                          f"{rule_ms / ms:.2f}x the rule), max |y - torch| {err:.1e}"
                          f"{'' if same_nan else ', NaNs DIFFER'}", flush=True)
        del x, want, stats
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
