"""softmax(x @ W) with K split over several class tiles, finished in the split-K launch
(``split_k_kernel``'s RESCALE: the last program of a row block scales its rows) against the
rescale launch after it (``rescale_tiles_kernel``), on few rows. GPU us a call, each call after
an L2 flush as the harness times it: a CUDA graph of 20 (flush, call) pairs less one of 20
flushes, least of 5 replays each (``small_rows_probe``'s timing). From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/split_k_rescale_probe.py   # at 49b7730, the tree that has RESCALE
"""
import torch
import triton

import fused_softmax_matmul as fsm

FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")


def graph_us(fn, calls=20):
    if fn is not None:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            FLUSH.zero_()
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


def inputs(B, K, C, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    return (torch.randn(B, K, device="cuda", generator=g, dtype=dtype),
            (torch.randn(K, C, device="cuda", generator=g) / K**0.5).to(dtype))


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
flush_alone = graph_us(None)
print(f"flush alone {flush_alone:.2f} us; rule: rows of a block x C <= {fsm.SPLIT_K_RESCALE_VALUES}")
rule = fsm.SPLIT_K_RESCALE_VALUES
for dtype in (torch.float32, torch.bfloat16):
    for B, K, C in ((1, 768, 1000), (1, 2048, 1000), (1, 4096, 1000), (4, 2048, 1000), (8, 4096, 1000),
                    (16, 4096, 1000), (32, 2048, 1000), (32, 4096, 1000), (1, 4096, 4000), (1, 2048, 8000)):
        x, W = inputs(B, K, C, dtype)
        launch = fsm.tiled_launch(B, C, dtype, x.device, K=K)
        torch_us = graph_us(lambda: fsm.matmul_softmax_ref(x, W)) - flush_alone
        line = f"{B}x{K}x{C} {str(dtype)[6:]}: {launch}; torch {torch_us:.2f} us"
        if launch.split_k > 1 and triton.cdiv(C, launch.block_c) > 1:
            ref = torch.softmax(x.double() @ W.double(), -1)
            for name, values in (("in the launch", 1 << 30), ("rescale launch", 0)):
                fsm.SPLIT_K_RESCALE_VALUES = values
                fsm._MATMUL_REPLAYS.clear()  # a kept launch of the other way would serve the call
                out = fsm.matmul_softmax_fused_tiled(x, W, launch)
                err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                us = graph_us(lambda: fsm.matmul_softmax_fused_tiled(x, W, launch)) - flush_alone
                line += f" | {name} {us:.2f} us ({torch_us / us:.2f}x, error {err:.1e})"
            fsm.SPLIT_K_RESCALE_VALUES = rule
        else:
            us = graph_us(lambda: fsm.matmul_softmax_fused_tiled(x, W)) - flush_alone
            line += f" | no split-K rescale: {us:.2f} us ({torch_us / us:.2f}x)"
        print(line, flush=True)
