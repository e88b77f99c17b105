"""Compiles ``fused_softmax_gluon_kernel`` for sm_90 on a machine without a GPU (triton 3.6 with
Gluon and its bundled ptxas) and prints, per launch, its shared memory and what ptxas reports:
registers a thread, spills, and whether it serialised the warpgroup MMAs (its C7512, which every
launch had until 6eb4090, where a step's products stayed in flight across the loop's back edge). A one-off diagnostic, not part of the suite. From the repository
root, with a triton 3.6 on the path:

    PYTHONPATH=. python3 outputs/profiles/gluon_sm90_compile.py
"""

import os
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

import fused_softmax_matmul as fsm


def compile_softmax(launch: fsm.GluonSoftmaxLaunch, dtype: torch.dtype, parts: int):
    """The compiled kernel for ``launch`` over inputs of ``dtype`` with V in ``parts`` parts."""
    kernel = fsm.fused_softmax_gluon_kernel
    x = torch.empty((2, 256, 1024), dtype=dtype)
    out = torch.empty((2, 256, 512), dtype=dtype)
    lse = torch.empty((2, 256), dtype=torch.float32)
    if dtype == torch.float32:
        operand = torch.empty((2, parts, 512, 1024), dtype=dtype)
        descs = fsm._gluon_descriptors(fsm.gl.float32, (x, [1, fsm.GLUON_SOFTMAX_ROWS, launch.block_n]),
                                       (operand, [1, 1, launch.block_d3, launch.block_n]))
    else:
        V = torch.empty((2, 1024, 512), dtype=dtype)
        gl_dtype = fsm.gl.bfloat16 if dtype == torch.bfloat16 else fsm.gl.float16
        descs = fsm._gluon_descriptors(gl_dtype, (x, [1, fsm.GLUON_SOFTMAX_ROWS, launch.block_n]),
                                       (V, [1, launch.block_n, launch.block_d3]))
    constants = dict(STAGES=launch.stages, CONSUMERS=fsm.GLUON_SOFTMAX_CONSUMERS, LAZY=launch.lazy_rescale,
                     LOADER_REGISTERS=fsm.GLUON_SOFTMAX_LOADER_REGISTERS,
                     CONSUMER_REGISTERS=fsm.GLUON_SOFTMAX_CONSUMER_REGISTERS, PINGPONG=launch.pingpong,
                     STORE_LSE=False, PARTS=parts, P_SMEM=launch.p_smem, num_warps=fsm.GLUON_BLOCK_M // 16)
    values = dict(x_desc=descs[0], v_desc=descs[1], o_ptr=out, stride_ob=1, stride_o1=1, stride_o3=1, lse_ptr=lse,
                  stride_lb=1, stride_l1=1, d1=3, d2=3, d3=3, n_tiles_d3=3)
    signature = {n: "constexpr" if n in constants else mangle_type(values[n]) for n in kernel.arg_names}
    source = GluonASTSource(kernel, signature,
                            constexprs={(kernel.arg_names.index(c),): v for c, v in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=constants["num_warps"]))


def ptxas_report(compiled) -> list[str]:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    result = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    return [line.split("info    : ")[-1].strip() for line in result.stderr.splitlines()
            if "Used" in line or "spill" in line or "C75" in line]  # C7512: warpgroup MMAs serialised


if __name__ == "__main__":
    print(f"# triton {triton.__version__}, sm_90a; consumers get {fsm.GLUON_SOFTMAX_CONSUMER_REGISTERS} registers "
          "by setmaxnreg (ptxas reports the launch's)")
    cases = [(fsm.GluonSoftmaxLaunch(128, 256, 2), torch.bfloat16, 1), (fsm.GluonSoftmaxLaunch(128, 256, 2, p_smem=True), torch.bfloat16, 1),
             (fsm.GluonSoftmaxLaunch(64, 256, 2), torch.bfloat16, 1),
             (fsm.GluonSoftmaxLaunch(64, 256, 2), torch.float32, 1),
             (fsm.GluonSoftmaxLaunch(64, 128, 2), torch.float32, 2),
             (fsm.GluonSoftmaxLaunch(32, 128, 2), torch.float32, 2),
             (fsm.GluonSoftmaxLaunch(32, 256, 2), torch.float32, 2)]
    for launch, dtype, parts in cases:
        compiled = compile_softmax(launch, dtype, parts)
        print(f"{launch} {str(dtype)[6:]} V parts {parts}: shared {compiled.metadata.shared} bytes; "
              + "; ".join(ptxas_report(compiled)), flush=True)
