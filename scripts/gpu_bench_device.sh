#!/bin/bash
# The device side of scripts/gpu_bench.py (docs/engine.md, "On a GPU"): the third of three device
# calls. The first two left GGUF parts 00 and 01 in /tmp/g; this one carries .gpu/gw_p3 (part 02,
# this script as run.sh, prompts_ids.json, wheels in whl/) and .gpu/gw_code (code.tar: this
# branch's files, laid over whatever tree the device received).
set -o pipefail
P=.gpu/gw_p3
mkdir -p /tmp/g && cp $P/gguf.part.02 /tmp/g/ && cat /tmp/g/gguf.part.00 /tmp/g/gguf.part.01 /tmp/g/gguf.part.02 > /tmp/g/SmolLM2-135M-Instruct.Q4_1.gguf || exit 3
md5sum /tmp/g/SmolLM2-135M-Instruct.Q4_1.gguf
tar -xf .gpu/gw_code/code.tar || exit 4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $P/whl/*.whl || exit 5
export PYTHONPATH=$PWD:/tmp/site ONLINE_SPEC_CACHE=/tmp/osc PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 scripts/gpu_bench.py --gguf-dir /tmp/g --prompts $P/prompts_ids.json --out $OUT ${PARTS:+--parts $PARTS} 2>&1 | grep -v "Loading weights" | tee $OUT/log.txt
