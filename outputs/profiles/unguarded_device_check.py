"""row_softmax on cuda:1 with cuda:0 current and the device guard switched off: what such a call did
before on_input_device. On a machine of two GPUs, from the repository root:

    PYTHONPATH=. python3 outputs/profiles/unguarded_device_check.py
"""
import torch, online_softmax as osm, fused_softmax_matmul as fsm
osm.other_device = fsm.other_device = lambda t: None
x = torch.randn(64, 1000, device="cuda:1")
torch.cuda.set_device(0)
try:
    y = osm.row_softmax(x)
    torch.cuda.synchronize(1); torch.cuda.synchronize(0)
    print("unguarded row_softmax on cuda:1, cuda:0 current: max error", (y - torch.softmax(x, -1)).abs().max().item())
except Exception as e:
    print("unguarded row_softmax on cuda:1, cuda:0 current:", type(e).__name__, str(e)[:300])
