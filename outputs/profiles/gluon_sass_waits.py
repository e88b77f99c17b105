"""Where ptxas puts each step's wait for its warpgroup MMAs, read from the SASS of the Gluon
kernels compiled for sm_90a on a machine without a GPU (triton 3.6 with Gluon and its bundled
ptxas and cuobjdump). A one-off diagnostic. For each loop body (from one ``WARPGROUP.ARRIVE``
ahead of a step's MMAs to the next) it prints the order of the MMAs (``HGMMA``), the waits
(``DEPBAR``: ``WARPGROUP.DEPBAR.LE``, the count it waits down to), the exponentials (``EX2``) and
the weights' conversions (``F2FP``), runs of one kind counted; and the byte permutes (``PRMT``)
of a softmax(x) @ V kernel in bfloat16 against float16. From the repository root:

    PYTHONPATH=.:outputs/profiles python3 outputs/profiles/gluon_sass_waits.py
"""
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

import fused_softmax_matmul as fsm
from gluon_sm90_compile import compile_softmax

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PATTERN = re.compile(r"\b(HGMMA|WARPGROUP\.ARRIVE|WARPGROUP\.DEPBAR\.LE gsb0, 0x\d|MUFU\.EX2|F2FP|PRMT)\b")


def compiled(kernel, values: dict, constants: dict):
    signature = {n: "constexpr" if n in constants else mangle_type(values[n]) for n in kernel.arg_names}
    source = GluonASTSource(kernel, signature, constexprs={(kernel.arg_names.index(c),): v for c, v in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def sass(c) -> list[str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(c.asm["cubin"])
    out = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    return [m.group(1) for line in out.splitlines() for m in [PATTERN.search(line)] if m]


def bodies(ops: list[str]) -> list[str]:
    """Runs of each kind between consecutive WARPGROUP.ARRIVEs, as '4 HGMMA, DEPBAR 1, 66 EX2, ...'."""
    names = {"MUFU.EX2": "EX2", "PRMT": None}
    out, runs = [], []
    for op in ops + ["WARPGROUP.ARRIVE"]:
        if op == "WARPGROUP.ARRIVE":
            if runs:
                out.append(", ".join(f"{n} {k}" if n > 1 else k for k, n in runs))
            runs = []
            continue
        op = names.get(op, op)
        if op is None:
            continue
        op = "DEPBAR " + op[-1] if op.startswith("WARPGROUP.DEPBAR") else op
        if runs and runs[-1][0] == op:
            runs[-1][1] += 1
        else:
            runs.append([op, 1])
    return out


def attention_kernel(is_causal: bool):
    T = torch.empty((2, 1024, 64), dtype=torch.bfloat16)
    L = torch.empty((2, 1024), dtype=torch.float32)
    descs = fsm._gluon_descriptors(fsm.gl.bfloat16, (T, [1, fsm.GLUON_BLOCK_M, 64]), (T, [1, fsm.GLUON_FLASH_BLOCK_N, 64]),
                                   (T, [1, fsm.GLUON_FLASH_BLOCK_N, 64]), (T, [1, fsm.GLUON_BLOCK_M, 64]))
    constants = dict(IS_CAUSAL=is_causal, STAGES=fsm.GLUON_FLASH_STAGES, CONSUMERS=fsm.GLUON_FLASH_CONSUMERS,
                     LOADER_REGISTERS=fsm.GLUON_LOADER_REGISTERS, CONSUMER_REGISTERS=fsm.GLUON_FLASH_CONSUMER_REGISTERS,
                     PINGPONG=fsm.GLUON_FLASH_PINGPONG, num_warps=4)
    values = dict(q_desc=descs[0], k_desc=descs[1], v_desc=descs[2], o_desc=descs[3], lse_ptr=L, stride_lb=1,
                  stride_lm=1, n_batch=3, n_queries=3, n_keys=3, qk_scale=1.0)
    return compiled(fsm.flash_attention_gluon_kernel, values, constants)


if __name__ == "__main__":
    print(f"# triton {triton.__version__}, sm_90a; one line a loop body of the consumers' code (both consumers, "
          "every loop: unmasked and masked steps, the epilogue)")
    L = fsm.GluonSoftmaxLaunch
    for name, c in [("attention forward, d 64, causal", attention_kernel(True)),
                    ("softmax(x) @ V bf16, 128 x 256, weights in registers", compile_softmax(L(128, 256, 2), torch.bfloat16, 1)),
                    ("softmax(x) @ V bf16, 128 x 256, weights in shared memory", compile_softmax(L(128, 256, 2, p_smem=True), torch.bfloat16, 1)),
                    ("softmax(x) @ V bf16, 64 x 256, weights in registers", compile_softmax(L(64, 256, 2), torch.bfloat16, 1))]:
        print(f"## {name}", flush=True)
        for body in bodies(sass(c)):
            print("  " + body)
    for dtype in (torch.bfloat16, torch.float16):
        ops = sass(compile_softmax(L(128, 128, 2), dtype, 1))
        print(f"## softmax(x) @ V {str(dtype)[6:]}, 128 x 128, weights in registers: {ops.count('PRMT')} PRMT, "
              f"{ops.count('F2FP')} F2FP, {ops.count('HGMMA')} HGMMA", flush=True)
