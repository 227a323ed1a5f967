#!/bin/bash
# Engine-alone capture runs on a lent GPU that `gpu_ranks_device.sh run .gpu/c` set up (run there, after
# it, in the same call or the next one while the machine is warm): one `scripts/gpu_round_costs.py
# --capture-overhead` run per entry of RUNS, each "sink:reader:sender:reserve" (bench collector's
# --serving-sink / reader / --capture-sender / --serving-reserve choices), JSON to $OUT/cap_I_....json.
#   RUNS="publisher:subscriber:thread:off publisher:subscriber:thread:apart" bash scripts/gpu_capture_runs.sh
# BATCHES (1,4,16), REPEATS (4), CAP_TIMEOUT (170 s a run; a process sender over three batch sizes
# needs more than 140 s), TOPO=1 prints the host's CPU topology first.
W=/tmp/w CODE=/tmp/code
export PYTHONPATH=$CODE:/tmp/site ONLINE_SPEC_CACHE=/tmp/osc PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
    DS_ACCELERATOR=cuda
cd $CODE || { echo "no $CODE: run 'gpu_ranks_device.sh run .gpu/c' first" >&2; exit 4; }
[ -n "$TOPO" ] && { nproc; lscpu | grep -E "Model name|Thread|Core|Socket|NUMA"; }
i=0
for r in $RUNS; do
    i=$((i + 1)); IFS=: read -r sink reader sender reserve <<< "$r"
    name=cap_${i}_${sink}_${reader}_${sender}_${reserve}
    t0=$(date +%s)
    timeout "${CAP_TIMEOUT:-170}" python3 scripts/gpu_round_costs.py --trace $W/trace_l.jsonl --device cuda \
        --no-policies --capture-overhead --capture-head shipped --capture-batches "${BATCHES:-1,4,16}" \
        --repeats "${REPEATS:-4}" --capture-sink "$sink" --capture-reader "$reader" --capture-sender "$sender" \
        --capture-reserve "$reserve" --json "$OUT/$name.json" 2>&1 | grep -v "Loading weights" | tail -n 6
    echo "== $name rc=${PIPESTATUS[0]} $(( $(date +%s) - t0 )) s $(date -u +%H:%M:%S)"
done
