"""The split-row GPU tests with POLL forced on (``split_polls``). From the repository root:

    PYTHONPATH=. python3 outputs/profiles/split_poll_tests.py   # at 0ce52ef
"""
import sys
import pytest
import online_softmax as osm
osm.split_polls = lambda dtype, props: True
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--benchmark-skip", "-k", "split", "tests/test_online_softmax_edges.py", "tests/test_online_softmax_autograd.py", "tests/test_online_softmax.py"]))
