#!/bin/bash
# Nsight Compute on row_softmax's long-row kernel: 2670 x 50257 bf16 (the grid's worst long
# row) beside 4185 x 128256 float32 (near copy), the third call of each.
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD
for c in "2670 50257 bfloat16" "4185 128256 float32" "1073741 1000 bfloat16"; do
  set -- $c
  echo "=== $1 x $2 $3"
  timeout 150 ncu --clock-control none -k regex:softmax_ -s 2 -c 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    python3 -c "
import torch, online_softmax as osm
x = torch.randn($1, $2, device='cuda', dtype=torch.$3)
for _ in range(4): osm.row_softmax(x)
torch.cuda.synchronize()" > ${OUT:-outputs/profiles}/ncu_row_$2_$3.txt 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Block Limit Reg|Grid Size|Block Size|Warp Cycles Per Issued|Issue Slots Busy|Issued Ipc|No Eligible|Eligible Warps|Active Warps Per|Stall|Executed Ipc" ${OUT:-outputs/profiles}/ncu_row_$2_$3.txt | head -40
done
