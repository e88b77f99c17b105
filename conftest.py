"""The one harness: device detection, the benchmark timer fixture, machine info and the CSV hook.

Device detection happens here, at import, before any test module imports a kernel: without a
usable GPU, Triton must run in interpreter mode, and Triton reads TRITON_INTERPRET when a kernel
is decorated.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
