"""Timing helpers the attention and Gluon probes share (one-off diagnostics, not the harness):
``bench`` (a do_bench mean, ms), ``median_ms`` (its median), ``softmax_matmul_error`` (against
float64), ``graph_ms`` (ms per call replayed from a CUDA graph of ten calls: GPU time alone), ``host_us`` (host time per call, enqueued while the GPU spins) and
``attention_training_step`` (an attention forward + backward to time under launch overrides)."""
import time

import torch
import triton


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150)


def median_ms(fn):
    """do_bench's median, ms (the L2 flushed before each run)."""
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def softmax_matmul_error(out, x, V):
    """||out - softmax(x) @ V in float64|| / ||that|| on batch element 0."""
    ref = torch.softmax(x[:1].double(), -1) @ V[:1].double()
    return ((out[:1].double() - ref).norm() / ref.norm()).item()


def captured(step, calls):
    """A CUDA graph of ``calls`` calls of step, after three warm-up calls off the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            step()
    return graph


def graph_ms(step, iters=10):
    graph = captured(step, iters)
    graph.replay()
    torch.cuda.synchronize()
    return bench(graph.replay) / iters


def replay_median_ms(fn, calls=20, replays=10):
    """GPU ms a call from a CUDA graph of ``calls`` calls: the median of ``replays`` replays, each
    timed by events (no L2 flush between them, unlike ``graph_ms``'s do_bench)."""
    graph = captured(fn, calls)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def host_us(fn, n=100):
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9 * 0.05))  # about 50 ms of spin: no launch below waits for the GPU
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    seconds = time.perf_counter() - t0
    torch.cuda.synchronize()
    return seconds / n * 1e6


def attention_training_step(fsm, b, n, d, causal, dtype=torch.bfloat16):
    """FlashAttentionTriton forward + backward on seeded (b, n, d) inputs: (step, the launches the
    Function chooses, Q), where step(launches=None) returns the gradients of Q, K and V."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, n, d, device="cuda", dtype=dtype, generator=g).requires_grad_() for _ in range(3))
    go = torch.randn_like(q)
    chosen = fsm.resolve_flash_launches(d, dtype, None, fsm.few_query_tiles(b, n, q.device), causal)

    def step(launches=None):
        o = fsm.FlashAttentionTriton.apply(q, k, v, causal, launches)
        return torch.autograd.grad(o, (q, k, v), go)
    return step, chosen, q
