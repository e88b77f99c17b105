"""Three ways past the attention kernels' limits, each beside the kernels as they were (code at
0feb774) and SDPA's cuDNN backend, bf16/fp16, triton.testing.do_bench means in ms:
1. one backward kernel adding dQ by atomics (``flash_bwd_atomic.py``) instead of a dQ kernel
   that recomputes S and dP; 2. the forward reading K and V through tensor descriptors (TMA,
   ``flash_desc.py``); 3. (part "rows") narrow-row softmax launches, do_bench and a CUDA graph.
The "pointers, same launch" column goes through FlashAttentionTriton with a launch override, so
at small shapes it holds that path's host time. From the repository root on an H100:

    PYTHONPATH=.:outputs/profiles python3 outputs/profiles/attention_variants_probe.py [all|attention|rows]
"""
import sys, os
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
import fused_softmax_matmul as fsm
import online_softmax as osm
from fused_softmax_matmul import FlashLaunch as FL
import flash_bwd_atomic as fba
import flash_desc as fd
from probe_timing import bench

triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
part = sys.argv[1] if len(sys.argv) > 1 else "all"
SHAPES = [(16, 4096, 128, False, torch.bfloat16), (16, 4096, 128, True, torch.bfloat16), (32, 1000, 128, False, torch.bfloat16),
          (4, 16384, 128, True, torch.bfloat16), (16, 8192, 64, False, torch.bfloat16), (16, 8192, 64, True, torch.bfloat16),
          (32, 1024, 64, False, torch.bfloat16), (16, 3000, 64, True, torch.float16), (16, 4097, 64, False, torch.bfloat16)]
ATOMIC = {128: [FL(32, 128, 8, 2), FL(64, 64, 8, 2), FL(64, 128, 8, 2), FL(32, 64, 4, 2), FL(32, 128, 8, 3)],
          64: [FL(64, 128, 8, 2), FL(64, 64, 4, 3), FL(32, 128, 4, 2), FL(32, 64, 4, 3), FL(64, 64, 8, 2), FL(32, 128, 8, 3)]}
DKDV = {128: [FL(32, 128, 8, 2), FL(64, 64, 8, 2)], 64: [FL(64, 128, 8, 2), FL(64, 64, 4, 3)]}
FWD = {128: [FL(128, 64, 8, 3), FL(128, 128, 8, 2), FL(64, 64, 4, 3)], 64: [FL(128, 64, 8, 3), FL(128, 128, 8, 3), FL(64, 128, 4, 3)]}

if part in ("all", "attention"):
    for (b, n, d, causal, dt) in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, n, d, device="cuda", dtype=dt, generator=g).requires_grad_() for _ in range(3))
        go = torch.randn_like(q)
        q4, k4, v4 = (t.detach().unsqueeze(1).requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o4 = F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal)
            s_fwd = bench(lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal))
            s_bwd = bench(lambda: torch.autograd.grad(o4, (q4, k4, v4), go.unsqueeze(1), retain_graph=True))
        o = fsm.FlashAttentionTriton.apply(q, k, v, causal)
        Q, K, V, O, L = o.grad_fn.saved_tensors
        launches = fsm.resolve_flash_launches(d, dt, None, fsm.few_query_tiles(b, n, q.device), causal)
        c_bwd = bench(lambda: torch.autograd.grad(o, (q, k, v), go, retain_graph=True))
        with torch.no_grad():
            c_fwd = bench(lambda: fsm.FlashAttentionTriton.apply(q, k, v, causal))
        ref = torch.autograd.grad(o, (q, k, v), go, retain_graph=True)
        print(f"== ({b},{n},{d}) causal={causal} {str(dt)[6:]}: cuDNN fwd {s_fwd:.4f} bwd {s_bwd:.4f} | now fwd {c_fwd:.4f} "
              f"{launches['forward']} bwd {c_bwd:.4f} dkdv {launches['dkdv']} dq {launches['dq']}", flush=True)
        for c in DKDV[d]:
            o2 = fsm.FlashAttentionTriton.apply(q, k, v, causal, {"dkdv": c})
            try:
                t = bench(lambda: torch.autograd.grad(o2, (q, k, v), go, retain_graph=True))
                print(f"  dkdv {c}: bwd {t:.4f} ({c_bwd / t:.2f}x now)", flush=True)
            except Exception as e:
                print(f"  dkdv {c}: failed {type(e).__name__} {str(e)[:100]}", flush=True)
        for c in ATOMIC[d]:
            run = lambda: fba.backward_atomic(Q, K, V, O, L, go, causal, c.block_m, c.block_n, c.num_warps, c.num_stages,
                                             fsm._flash_kernel_args(dt))
            try:
                got = run()
                err = max(((a.float() - r.float()).norm() / r.float().norm()).item() for a, r in zip(got, ref))
                t = bench(run)
                print(f"  atomic {c}: bwd {t:.4f} ({c_bwd / t:.2f}x now, {s_bwd / t:.2f}x cuDNN) max rel diff to now {err:.1e}", flush=True)
            except Exception as e:
                print(f"  atomic {c}: failed {type(e).__name__} {str(e)[:100]}", flush=True)
        for c in FWD[d]:
            Od = torch.empty_like(O); Ld = torch.empty_like(L)
            def fwd():
                fd.flash_forward_desc_kernel[(b * triton.cdiv(n, c.block_m),)](
                    Q, K, V, Od, Ld, b, n, n, d ** -0.5 * 1.4426950408889634, Q.stride(0), Q.stride(1), K.stride(0), K.stride(1),
                    V.stride(0), V.stride(1), Od.stride(0), Od.stride(1), Ld.stride(0),
                    HEAD_DIM=d, BLOCK_M=c.block_m, BLOCK_N=c.block_n, IS_CAUSAL=causal, WS=False,
                    num_warps=c.num_warps, num_stages=c.num_stages)
            try:
                fwd()
                err = ((Od.float() - O.float()).norm() / O.float().norm()).item()
                t = bench(fwd)
                with torch.no_grad():
                    tn = bench(lambda: fsm.FlashAttentionTriton.apply(q, k, v, causal, {"forward": c}))
                print(f"  fwd desc {c}: {t:.4f} (pointers, same launch: {tn:.4f}; {s_fwd / t:.2f}x cuDNN) diff {err:.1e}", flush=True)
            except Exception as e:
                print(f"  fwd desc {c}: failed {type(e).__name__} {str(e)[:150]}", flush=True)
        del q, k, v, o, Q, K, V, O, L, q4, k4, v4, o4, ref
        torch.cuda.empty_cache()

if part in ("all", "rows"):
    print("## narrow rows (c6f981d): row_softmax vs torch.softmax, do_bench and a CUDA graph of 20 calls", flush=True)
    for (m, n, dt) in [(256, 50, torch.float32), (1024, 100, torch.float32), (4096, 50, torch.bfloat16), (128, 1000, torch.float32),
                       (8192, 64, torch.float32), (32768, 32, torch.bfloat16), (2048, 200, torch.bfloat16)]:
        x = torch.randn(m, n, device="cuda", dtype=dt)
        launch = osm._row_launch(m, n, x.stride(0), dt, 0, 0)
        res = []
        for fn in (lambda: osm.row_softmax(x), lambda: torch.softmax(x, -1)):
            fn()
            torch.cuda.synchronize()
            gph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gph):
                for _ in range(20):
                    fn()
            gph.replay(); torch.cuda.synchronize()
            res.append((bench(fn), bench(gph.replay) / 20))
        print(f"  {m} x {n} {str(dt)[6:]}: {launch} | triton {res[0][0]*1e3:.1f} us (graph {res[0][1]*1e3:.2f}) "
              f"torch {res[1][0]*1e3:.1f} us (graph {res[1][1]*1e3:.2f}) -> graph ratio {res[1][1]/res[0][1]:.2f}x", flush=True)
