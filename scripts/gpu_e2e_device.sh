#!/bin/bash
# The device side of `online-spec bench e2e --device cuda` (docs/engine.md, "GPU figures"): server
# and trainer daemon colocated on one GPU. The GGUF travels in parts (`split -b 10000000 -d`: a
# call carries at most 64 MiB, the ~49 MB tree with its two packaged heads included, so a call
# has room for one part and the wheels, or one part and a job's inputs; until 2026-11-24, with one
# head, 25 MB parts). Calls, back to back (the machine stays warm 30 s):
#   1. carry a folder with one part: copy it to /tmp/g       (bash ... part .gpu/gw_p1/gguf.part.00)
#      (as many such calls as parts remain for the calls below)
#   2. carry a folder with the next part(s) + wheels in whl/: parts to /tmp/g, wheels into
#      /tmp/site, import check                                       (bash ... wheels .gpu/gw_p3)
#   3. carry a folder with the last part(s), code.tar, trace.jsonl: join every part in /tmp/g, lay
#      the branch's code over a copy of the tree in /tmp/code, convert the model once, start the
#      bench in its own session (setsid: it outlives the call), follow it
#                                                            (bash ... start .gpu/gw_p4 [bench flags])
#   4. ... as many as needed: follow it, then copy the JSON and log to $OUT       (bash ... follow)
# `job P 'CMD'` instead of `start P FLAGS` runs any command the same way (P may also carry
# *.json inputs and a whl/ folder); the command writes its JSON files under $W.
# The bench runs from /tmp/code so that a later call's fresh tree cannot change the code its
# trainer children import. `start --tiny-cpu FLAGS` starts the bench from an existing $CODE (the
# CPU check here: CODE, E2E_DIR elsewhere, a small trace).
set -o pipefail
W=${E2E_DIR:-/tmp/e2e} CODE=${CODE:-/tmp/code}
export PYTHONPATH=$CODE:/tmp/site ONLINE_SPEC_CACHE=${ONLINE_SPEC_CACHE:-/tmp/osc} PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false
unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK
stage=$1; shift
follow() {  # wait for the bench (at most $1 s), then copy what it wrote to $OUT
    local until=$(( $(date +%s) + ${1:-540} ))
    while [ ! -e $W/done ] && [ $(date +%s) -lt $until ]; do sleep 5; done
    tail -n 25 $W/log.txt
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null
    [ -n "$OUT" ] && cp $W/log.txt $OUT/ && { cp $W/*.json $W/cmd.txt $W/*.part.* $OUT/ 2>/dev/null; cp $W/done $OUT/ 2>/dev/null
        cp $W/run/online_spec/trainer.log $OUT/trainer_online_spec.log 2>/dev/null; true; }
    [ -e $W/done ] && echo "bench finished: rc $(cat $W/done)" || echo "bench still running"
}
code() {  # a copy of the received tree in $CODE with the branch's files (code.tar) laid over it
    rm -rf $CODE && mkdir -p $CODE && tar -cf - --exclude=./.gpu --exclude=./.git --exclude=./runs . \
        | tar -xf - -C $CODE && tar -xf $1/code.tar -C $CODE || exit 4
}
smoke() {  # the trainer's device path on a tiny target: DeepSpeed step, gate simulation, save
    (cd $CODE && python3 -c "
import torch, torch.distributed as dist
from tests.distill_helpers import greedy_records, tiny8
from online_spec.head import new_head
from trainer.batch import collate
from trainer.distill import DistillConfig, Distiller
from trainer.evaluate import simulate_acceptance
from trainer.loss import LossConfig
dev = '${SMOKE_DEVICE:-cuda}'
t = tiny8(); recs, _ = greedy_records(t, num=2, new_tokens=16); t.hf.to(dev); t._rope_len = 0  # rope table rebuilt there
d = Distiller(t, new_head(t, 128, seed=0).float(), DistillConfig(warmup_steps=1, total_steps=10), LossConfig(ttt_steps=2))
m = [d.train_step(collate(recs)) for _ in range(3)]
print('smoke: loss', round(m[0]['loss'], 3), '->', round(m[-1]['loss'], 3), 'head on', d.head.fc.weight.device,
      'backend', dist.get_backend(), 'accept', simulate_acceptance(d.head, t, recs, 3, ks=[3])['accept_length'],
      'saved', d.save('/tmp/smoke_head', 1)[:12])
" 2>&1 | grep -v "Loading weights" | tail -n 15)
}
case $stage in
part)
    mkdir -p /tmp/g && cp "$1" /tmp/g/ && ls -la /tmp/g
    python3 -V; nvidia-smi -L
    python3 -m pip show pyarrow fsspec huggingface_hub pydantic deepspeed datasets pyzmq 2>/dev/null | grep -E '^(Name|Version)'
    ;;
wheels)
    mkdir -p /tmp/g && cp "$1"/gguf.part.* /tmp/g/ || exit 3
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$1"/whl/*.whl || exit 5
    code $1 && smoke
    DS_ACCELERATOR=cuda python3 -c "
import deepspeed, datasets, zmq, fastapi, uvicorn, pyarrow, torch
from deepspeed.accelerator import get_accelerator
print('deepspeed', deepspeed.__version__, get_accelerator()._name, 'datasets', datasets.__version__,
      'pyarrow', pyarrow.__version__, 'zmq', zmq.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
    ;;
start|job)
    P=$1; shift
    if [ "$P" != --tiny-cpu ]; then
        cp $P/gguf.part.* /tmp/g/ && cat /tmp/g/gguf.part.* > /tmp/g/SmolLM2-135M-Instruct.Q4_1.gguf || exit 3
        md5sum /tmp/g/SmolLM2-135M-Instruct.Q4_1.gguf
        code $P && cp $P/trace.jsonl $CODE/trace.jsonl || exit 4
        cp $P/*.json $CODE/ 2>/dev/null  # inputs a job reads (prompts)
        [ -d $P/whl ] && { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site $P/whl/*.whl || exit 5; }
        python3 -c "from pathlib import Path; from online_spec.target import prepare_smollm2; \
print(prepare_smollm2(src=Path('/tmp/g')))" 2>&1 | grep -v "Loading weights" || exit 6
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    fi
    rm -rf $W && mkdir -p $W
    cd $CODE || exit 4
    if [ $stage = job ]; then  # any command, run in $CODE; it writes its JSON under \$W
        cmd="export W=$W; { $*; }"  # braces: the log gets every command's output, not the last one's
    else
        cmd="python3 -m online_spec.cli bench e2e $(printf '%q ' "$@")--json $W/gpu_e2e.json --out $W/run"
    fi
    echo "$cmd" > $W/cmd.txt
    setsid bash -c "$cmd > $W/log.txt 2>&1; echo \$? > $W/done" < /dev/null > /dev/null 2>&1 &
    sleep 2; cat $W/cmd.txt
    follow ${FOLLOW_S:-480}
    ;;
follow)
    follow ${1:-540}
    ;;
smoke)
    smoke
    ;;
esac
