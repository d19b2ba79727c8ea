#!/usr/bin/env bash
# ncu of the direct decode kernel for one cache format, one query token against four (the
# NVFP4 two-n-block gap of bench/NOTES.md v81): Speed of Light, pipe use, scheduler and
# warp-state statistics, occupancy. Needs qattn._C for the device's Python in
# python/qattn/ (python/build_on_device.sh, or a prebuilt one copied there).
#   run: bench/device_decode_ncu.sh [format nvfp4|fp8|int8] [batch] [context]
set -uo pipefail
cd "$(dirname "$0")/.."
fmt=${1:-nvfp4} batch=${2:-64} context=${3:-32768}
source bench/device_bins.sh
device_setup
device_deps
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
cat >/tmp/qattn_decode_once.py <<'PY'
import sys
sys.path.insert(0, "python")
import torch, qattn
fmt, b, n, nq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
hq, hkv, d, ps = 32, 8, 128, 16
cache = qattn.KVCache(num_pages=b * n // ps, page_size=ps, heads_kv=hkv, head_dim=d, max_seqs=b,
                      max_pages_per_seq=n // ps, format=fmt)
for s in range(b):
    cache.allocate(s, n)
k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
cache.append(k, torch.randn_like(k))
del k
q = torch.randn(b, hq, nq, d, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    qattn.decode(q, cache, seqs=range(b))
torch.cuda.synchronize()
PY
sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats
          --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis)
for nq in 1 4; do
  step "ncu_${fmt}_nq$nq" 150 ncu -k regex:decode_direct --launch-skip 2 --launch-count 1 "${sections[@]}" \
      python3 /tmp/qattn_decode_once.py "$fmt" "$batch" "$context" "$nq"
  cp "$logs/ncu_${fmt}_nq$nq.log" "$out/"
  echo "==== $fmt B $batch x $context, nq $nq ($gpu) ===="
  grep -E "Duration|Executed Ipc A|Issue Slots Busy|Eligible Warps|No Eligible|Achieved Occupancy|Block Limit Registers|DRAM Throughput|Warp Cycles Per Issued|Stall" \
      "$logs/ncu_${fmt}_nq$nq.log" | cut -c1-110 | head -24
done
printf '%s\n' "${status[@]}"
