"""What ``compiled_gluon_route`` reads, eager and inside torch.compile traces (Dynamo with the
eager, aot_eager and inductor backends), on the GPU machine's torch: each condition in order,
then the route itself. A one-off diagnostic, not part of the benchmark suite. From the
repository root on a Hopper GPU:

    PYTHONPATH=. python3 outputs/profiles/compiled_route_probe.py
"""
import torch

import fused_softmax_matmul as fsm

NAMES = ("is_compiling", "is_exporting", "Gluon", "cuda", "16-bit", "head dim", "Hopper", "route")


def conditions(Q):
    return (Q * 1, torch.compiler.is_compiling(), torch.compiler.is_exporting(), fsm.GLUON_UNAVAILABLE is None,
            Q.device.type == "cuda", Q.dtype in fsm._GLUON_DTYPES, Q.shape[-1] in fsm.GLUON_FLASH_HEAD_DIMS,
            fsm._device_is_hopper(fsm._device_index(Q.device)), fsm.compiled_gluon_route(Q))


def main():
    print(f"# torch {torch.__version__}; " + ", ".join(NAMES))
    Q = torch.randn(2, 300, 128, device="cuda", dtype=torch.bfloat16)
    print("uncompiled", conditions(Q)[1:], flush=True)
    for backend in ("eager", "aot_eager", "inductor"):
        torch._dynamo.reset()
        print(backend, torch.compile(conditions, fullgraph=True, backend=backend)(Q)[1:], flush=True)


if __name__ == "__main__":
    main()
