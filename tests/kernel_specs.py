"""Record every Triton kernel launch of a test run, then compile each for an H100 with no GPU.

Interpreted tests check arithmetic but not that the compiled kernels still build, nor whether a
change meant to move code left them alone. Record the launches of an interpreted run, then compile
each recorded kernel for sm_90 (Triton's CUDA backend needs no GPU) and print a hash of its PTX:

    KERNEL_SPECS=/tmp/specs TRITON_INTERPRET=1 python -m pytest -p tests.kernel_specs tests/test_X.py
    python tests/kernel_specs.py /tmp/specs [PER_KERNEL] > hashes.txt    # without TRITON_INTERPRET

PER_KERNEL (default 2) caps the launches compiled per kernel (the first ones in sorted order), as
each compile takes seconds. The hash skips PTX comments and debug line information, so two
hash lists from before and after a pure move of code should be identical. Each spec keeps the
constexpr values and argument types of one launch (ints as i32 or i64, floats fp32); the
specializations the JIT adds (ints equal to 1, divisibility) are left out, so a hash is comparable
only with another hash from this script. Exit status 1 when a kernel failed to compile.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import sys

SPEC_DIR = os.environ.get("KERNEL_SPECS")
LAUNCH_OPTIONS = ("num_warps", "num_stages")


def _arg_type(value) -> str | None:
    import torch
    if isinstance(value, torch.Tensor):
        return "*" + {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                      torch.float64: "fp64", torch.int32: "i32", torch.int64: "i64",
                      torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def _json_value(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return {"repr": str(value)}


def _spec(fn, args, kwargs) -> dict | None:
    params = inspect.signature(fn).parameters
    names = list(params)
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in params})
    for name, p in params.items():
        if name not in bound and p.default is not inspect.Parameter.empty:
            bound[name] = p.default
    constexprs = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
    signature, values = {}, {}
    for name in names:
        value = bound.get(name)
        if name in constexprs:
            signature[name] = "constexpr"
            values[name] = _json_value(value)
        else:
            ty = _arg_type(value)
            if ty is None:
                signature[name] = "constexpr"
                values[name] = _json_value(value)
            else:
                signature[name] = ty
    options = {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}
    return dict(module=fn.__module__, name=fn.__name__, signature=signature, constexprs=values,
                options=options)


def pytest_configure(config):
    if not SPEC_DIR:
        return
    from triton.runtime.interpreter import InterpretedFunction
    os.makedirs(SPEC_DIR, exist_ok=True)
    path = os.path.join(SPEC_DIR, f"specs-{os.getpid()}.jsonl")
    seen = set()
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        try:
            line = json.dumps(_spec(self.fn, args, kwargs), sort_keys=True)
            if line not in seen:
                seen.add(line)
                with open(path, "a") as f:
                    f.write(line + "\n")
        except Exception as e:  # noqa: BLE001 - recording must never change a test's outcome
            print(f"kernel_specs: not recorded {getattr(self.fn, '__name__', self.fn)}: {e!r}")
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run


def _load(spec_dir: str) -> list[dict]:
    specs = set()
    for name in sorted(os.listdir(spec_dir)):
        if name.endswith(".jsonl"):
            with open(os.path.join(spec_dir, name)) as f:
                specs.update(line.strip() for line in f if line.strip())
    return [json.loads(s) for s in sorted(specs)]


def _code(ptx: str) -> str:
    """The PTX without comments and line information (which a move of source changes)."""
    kept = []
    for line in ptx.splitlines():
        if line.lstrip().startswith(".section") and ".debug" in line:
            break
        line = line.split("//")[0].rstrip()
        if line and not line.lstrip().startswith((".loc", ".file")):
            kept.append(line)
    return "\n".join(kept)


def main(spec_dir: str, per_kernel: int = 2) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    failed = 0
    counts = {}
    for spec in _load(spec_dir):
        key = (spec["module"], spec["name"])
        counts[key] = counts.get(key, 0) + 1
        if counts[key] > per_kernel:
            continue
        kernel = getattr(importlib.import_module(spec["module"]), spec["name"])
        names = kernel.arg_names
        constexprs = {}
        for k, v in spec["constexprs"].items():
            if isinstance(v, dict):
                v = eval(v["repr"], {"tl": triton.language, "triton": triton})  # noqa: S307 - dtypes
            constexprs[(names.index(k),)] = v
        label = f"{spec['name']} {json.dumps(spec['constexprs'], sort_keys=True)} {spec['options']}"
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=spec["signature"], constexprs=constexprs),
                                      target=GPUTarget("cuda", 90, 32), options=spec["options"])
            print(hashlib.sha256(_code(compiled.asm["ptx"]).encode()).hexdigest()[:16], label)
        except Exception as e:  # noqa: BLE001 - report every kernel, then fail
            failed += 1
            print("FAILED", label, f"{type(e).__name__}: {str(e)[:300]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], *map(int, sys.argv[2:3])))
