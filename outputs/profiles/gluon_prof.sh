#!/bin/bash
# ncu profiles of the Gluon kernels at issue 19's target cases (gluon_prof.py): softmax(x) @ V
# bf16 (16, 2048, 8192, 512) and attention bf16 (16, 8192, 64) causal, forward and backward; or
# the "case kernel" pairs given as arguments (float32 softmax(x) @ V: tf32_high, tf32_highest).
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD
want=""
for m in sm__pipe_tensor_op_gmma_cycles_active sm__pipe_tensor_op_hmma_cycles_active sm__inst_executed_pipe_tensor_op_gmma lts__t_bytes dram__bytes_read; do
  want="$want,$m.sum,$m.avg.pct_of_peak_sustained_elapsed"
done
want=${want#,}
# Where this ncu has them: the exponential unit's (XU) and the FMA pipe's issue rates, and the
# cycles a warp waits between two instructions, by reason.
for m in $(ncu --query-metrics --chip gh100 2>/dev/null | awk '{print $1}' | grep -E \
    '^(smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active|sm__inst_executed_pipe_(xu|fma|alu))$'); do
  case $m in smsp__*) want="$want,$m.ratio";; *) want="$want,$m.avg.pct_of_peak_sustained_active";; esac
done
cases=("fused_default fused_softmax_gluon_kernel" "fused_256 fused_softmax_gluon_kernel"
       "attention flash_attention_gluon_kernel" "attention flash_attention_backward_dq_gluon_kernel"
       "attention flash_attention_backward_dkdv")
[ $# -gt 0 ] && cases=("$@")  # e.g. "tf32_high fused_softmax_gluon_kernel"
for c in "${cases[@]}"; do
  set -- $c
  echo "=== $1 $2"
  timeout 150 ncu --clock-control none -k "regex:$2" -s 2 -c 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis --metrics "$want" \
    python3 outputs/profiles/gluon_prof.py $1 > ${OUT:-outputs/profiles}/ncu_gluon_$1_$2.txt 2>&1
  grep -E "^  [a-z_]+ \(|Duration|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc|gmma|hmma|pipe_xu|lts__t_bytes.avg|dram__bytes_read.avg|forward|launch|Error" ${OUT:-outputs/profiles}/ncu_gluon_$1_$2.txt | head -20
  grep -E "issue_stalled" ${OUT:-outputs/profiles}/ncu_gluon_$1_$2.txt | awk '{print $NF, $1}' | sort -g -r | head -8
done
