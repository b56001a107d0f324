# One-off probe (issue 21): benchmarks/prefix_reuse.py's fetch phase under node patches (probe_site).
set -u
for v in "spin=0::4" "gil=0.0005,spin=0::4" "window=2304::12" "gil=0.0005,window=2304,spin=0::12"; do
  probe=${v%%::*}; lpf=${v##*::}
  echo "=== variant PDSERVE_PROBE=$probe --layers-per-frame $lpf ($(date -u +%T))"
  PDSERVE_PROBE=$probe PYTHONPATH=$PWD/benchmarks/probe_site:$PYTHONPATH timeout 170 python3 benchmarks/prefix_reuse.py \
    --device cuda:0 --connector cuda_ipc --dtype bfloat16 --short-lengths --skip-host-tier --runs 6 \
    --layers-per-frame "$lpf" 2>&1 | grep -v "INFO\|WARNING\|^\s*$" | tail -7
done
