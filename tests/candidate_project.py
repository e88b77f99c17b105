"""This project's own public API as a candidate module: the battery of tests/candidates.py run on
the project's kernels, and their ``candidate:project.*`` rows timed beside the project's own rows
(the same code: the two should agree within the timer's noise).

    pytest --candidate project=tests/candidate_project.py tests/test_candidates.py
"""

from fused_softmax_matmul import (  # noqa: F401 - re-exported: the names --candidate looks for
    FlashAttentionPytorch, FlashAttentionTriton, fused_softmax, linear_cross_entropy, matmul_softmax_fused_simple,
    matmul_softmax_fused_tiled, matmul_softmax_unfused,
)
from online_softmax import OnlineSoftmax, online_softmax, row_softmax  # noqa: F401
