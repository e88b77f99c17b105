#!/bin/bash
# ncu profiles of softmax(x) @ V at the cases whose targets were missed.
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
ncu --query-metrics --chip gh100 > /tmp/metrics.txt 2>&1
want=""
for m in sm__pipe_tensor_op_gmma_cycles_active sm__pipe_tensor_op_hmma_cycles_active lts__t_bytes dram__bytes_read l1tex__m_xbar2l1tex_read_bytes sm__inst_executed_pipe_tensor_op_gmma; do
  grep -q "^$m " /tmp/metrics.txt && want="$want,$m.sum,$m.avg.pct_of_peak_sustained_elapsed"
done
want=${want#,}
echo "metrics: $want"
grep -i "gmma" /tmp/metrics.txt | head -20
for c in bf16_256_64_highest bf16_8192_64_highest bf16_8192_32_highest f32_8192_32_high f32_8192_64_high f32_8192_64_highest bf16_8192_0_highest; do
  if [[ $c == *_0_* ]]; then k="regex:.*"; cnt=2; else k="regex:fused_softmax_kernel"; cnt=1; fi
  echo "=== $c"
  timeout 120 ncu --clock-control none -k "$k" -s $((cnt*2)) -c $cnt \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section Occupancy --section LaunchStats --section WarpStateStats \
    ${want:+--metrics $want} python3 outputs/profiles/prof.py $c > ${OUT:-outputs/profiles}/ncu_$c.txt 2>&1
  grep -E "Duration|Throughput|Registers Per|Shared Memory Config|Dynamic Shared|Achieved Occupancy|Theoretical Occ|Block Limit|Grid Size|Block Size|Warp Cycles Per Issued|Stall|gmma|hmma|lts__t_bytes|dram__bytes|xbar2l1tex|Executed Ipc|Issue Slots Busy|Pipe|launch" ${OUT:-outputs/profiles}/ncu_$c.txt | head -60
done
