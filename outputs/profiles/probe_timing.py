"""Timing helpers the probes share (one-off diagnostics, not the harness):
``bench`` (a do_bench mean, ms), ``graph_ms`` (ms per call replayed from a CUDA graph of ten
calls: GPU time alone), ``flushed_graph_us`` (GPU us a call, the L2 flushed before each, from a
CUDA graph), ``host_us`` (host time per call, enqueued while the GPU spins) and
``attention_training_step`` (an attention forward + backward to time under launch overrides);
for the split-row probes ``long_row_cases`` (inputs with copy's and torch's times),
``split_timed`` (row_softmax under patched split rules) and ``softmax_error``."""
import time

import torch
import triton


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150)


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


GiB = 2**30


def softmax_error(y, x, rows=64):
    """The largest absolute error of y against the softmax of x's first ``rows`` rows in float64."""
    ref = torch.softmax(x[:rows].double(), -1)
    return (y[:rows].double() - ref).abs().max().item()


def long_row_cases(cases):
    """For each (width, dtype name, bytes) of ``cases``: print a line with copy's and torch's
    do_bench times and torch's error, then yield (x, copy ms, torch ms), x random logits (scale
    4) of that many bytes of rows."""
    for n, name, nbytes in cases:
        dtype = getattr(torch, name)
        rows = nbytes // (n * dtype.itemsize)
        x = torch.randn(rows, n, device="cuda", dtype=dtype) * 4
        copy_ms = bench(lambda: x.clone())
        torch_ms = bench(lambda: torch.softmax(x, -1))
        torch_err = softmax_error(torch.softmax(x[:64], -1), x)
        print(f"== {rows} x {n} {name}: copy {copy_ms:.4f} torch {torch_ms:.4f} ({copy_ms / torch_ms:.1%} of copy), "
              f"error {torch_err:.2e}", flush=True)
        yield x, copy_ms, torch_ms
        del x
        torch.cuda.empty_cache()


def split_timed(x, chunk: int | None, force_split: bool, **rules):
    """row_softmax(x) under the split kernel's rules patched: ``chunk`` columns a program (None:
    the rule's), the split kernel forced where the rule takes one pass (``force_split``), and
    each of ``rules`` (an online_softmax function's name: its stand-in). (launch, do_bench ms,
    output, registers a thread of the kernel the launch choice compiled first, or None); the
    rules stay patched."""
    import online_softmax as osm
    if not hasattr(split_timed, "rules"):
        split_timed.rules = (osm._split_chunk_bytes, osm._fills_poorly)
        split_timed.seen = seen = []
        registers = osm.kernel_registers
        osm.kernel_registers = lambda compiled: seen.append(registers(compiled)) or seen[-1]
    chunk_rule, fills_poorly = split_timed.rules
    for name, rule in rules.items():
        if not hasattr(osm, name):  # a rule of a variant since reverted: its probe names the tree that has it
            raise AttributeError(f"online_softmax has no {name}: run this probe in the tree its docstring names")
        setattr(osm, name, rule)
    osm._split_chunk_bytes = chunk_rule if chunk is None else (lambda n_cols, dtype: chunk * dtype.itemsize)
    osm._fills_poorly = (lambda n_cols, dtype: True) if force_split else fills_poorly
    osm.forget_row_launches()
    split_timed.seen.clear()
    launch = osm._row_launch(x.shape[0], x.shape[1], x.stride(0), x.dtype, 0, 0)
    y = osm.row_softmax(x)
    return launch, bench(lambda: osm.row_softmax(x)), y, split_timed.seen[0] if split_timed.seen else None


_FLUSH = []


def flushed_graph_us(fn, calls=20):
    """GPU us a call of fn (None: nothing) with the L2 flushed before each, as the harness times
    it: a CUDA graph of ``calls`` (flush, call) pairs, least of 5 replays. Take ``fn=None``'s
    figure from the others to leave the call alone."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.int8, device="cuda"))
    flush = _FLUSH[0]
    if fn is not None:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            flush.zero_()
            if fn is not None:
                fn()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    return best
