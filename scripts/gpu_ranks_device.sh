#!/bin/bash
# The device side of issue 33's figures on a 2-GPU machine (nvidia-h100-x2): `bench ranks` (the
# trainer's throughput on 1 and 2 ranks, NCCL) and `bench e2e --device cuda --trainer-device cuda:1`
# (the server on GPU 0, the trainer on GPU 1, swaps through the control endpoint).
# A call carries at most 64 MiB with the tree: with the packaged heads moved out of the checkout
# for the calls (~12.5 MB tree), the GGUF travels in two 49.2 MB parts (`split -n 2 -d`), then the
# chat head, the wheels (Python 3.12: gguf, pyzmq, fastapi, starlette, uvicorn, pydantic(-core),
# annotated-types, typing-inspection, typing-extensions, opentelemetry-api, hjson, datasets, dill,
# multiprocess, prometheus-client, h11, click, and `pip wheel --no-deps deepspeed==0.19.8`), the
# token lists (tokens.json) and the trace (trace.jsonl). Calls, back to back (warm for 30 s):
#   1. bash scripts/gpu_ranks_device.sh part .gpu/a          (carry .gpu/a: gguf.part.00)
#   2. bash scripts/gpu_ranks_device.sh part .gpu/b          (carry .gpu/b: gguf.part.01)
#   3. bash scripts/gpu_ranks_device.sh run .gpu/c           (carry .gpu/c: whl/, head/, inputs)
#      installs, converts the model, runs bench ranks (REPEATS=N: medians of N; PROFILE=1: then
#      scripts/profile_train_step.py on its buffer, profile.txt), then, given
#      bench e2e flags after .gpu/c, starts bench e2e in its own session and follows it
#   4. bash scripts/gpu_ranks_device.sh follow               (until the e2e ends; JSON + logs to $OUT)
#   5. bash scripts/gpu_ranks_device.sh e2e NAME FLAGS       (another e2e on the same machine, then follow)
#   6. bash scripts/gpu_ranks_device.sh engine FLAGS         (bench engine there, e.g. --only timeline)
#   7. bash scripts/gpu_ranks_device.sh script PATH ARGS     (a script of the checkout there, e.g.
#      scripts/gpu_round_costs.py; the JSON it writes under /tmp/w comes back)
#   8. bash scripts/gpu_ranks_device.sh code                 (this call's checkout becomes the code there)
#   9. bash scripts/gpu_ranks_device.sh ranks                (bench ranks again; env DSCONFIGS="zero1 zero0",
#      BATCH_TOKENS="4096 16384" (rows a step: strong's whole step, weak's per rank),
#      MODES, STEPS, WARMUP, ROWS (the buffer; at most the 70,518 of tokens.json), REPEATS)
# On one GPU: SKIP_RANKS=1 TRAINER_DEVICE=cuda (the trainer colocated with the server).
# This machine's side (building .gpu/a-c, moving the results and heads out and back): scripts/gpu_prep.sh.
set -o pipefail
W=/tmp/w CODE=/tmp/code
export PYTHONPATH=$CODE:/tmp/site ONLINE_SPEC_CACHE=/tmp/osc PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
    DS_ACCELERATOR=cuda NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK
stage=$1; shift
follow() {  # wait for the running e2e (at most $1 s), then copy what it wrote to $OUT: its own files only
    # (at most 8 files come back from a call; the files of earlier runs on the machine would crowd them out)
    local until=$(( $(date +%s) + ${1:-480} )) name=$(cat $W/e2e_name 2>/dev/null || echo e2e)
    while [ ! -e $W/${name}_done ] && [ $(date +%s) -lt $until ]; do sleep 5; done
    grep -v "Loading weights" $W/$name.log | tail -n 30
    nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
    cp $W/gpu_$name.json $W/$name.log $W/${name}_cmd.txt $OUT/ 2>/dev/null
    [ -e $W/run_$name/online_spec/trainer.log ] && cp $W/run_$name/online_spec/trainer.log $OUT/trainer_run_$name.log
    [ -e $W/${name}_done ] && echo "$name finished: rc $(cat $W/${name}_done)" || echo "$name still running"
}
start_e2e() {  # NAME FLAGS...: bench e2e in its own session (it outlives the call), JSON $W/gpu_NAME.json;
    # TRACE=trace_d.jsonl: another trace the run stage copied to $W (default trace.jsonl)
    local name=$1; shift
    cmd="python3 -m online_spec.cli bench e2e --device cuda --trainer-device ${TRAINER_DEVICE:-cuda:1} --trace $W/${TRACE:-trace.jsonl} $(printf '%q ' "$@")"
    cmd="$cmd --json $W/gpu_$name.json --out $W/run_$name"
    echo "$cmd" > $W/${name}_cmd.txt; echo "$cmd"; echo $name > $W/e2e_name; rm -f $W/${name}_done
    (cd $CODE && setsid bash -c "$cmd > $W/$name.log 2>&1; echo \$? > $W/${name}_done" < /dev/null > /dev/null 2>&1 &)
    follow ${FOLLOW_S:-200}
}
ranks() {  # bench ranks, one per DeepSpeed config (DSCONFIGS) and rows a step (BATCH_TOKENS); JSON to $OUT
    for ds in ${DSCONFIGS:-zero1}; do for bt in ${BATCH_TOKENS:-4096}; do
        local name=gpu_ranks_${ds}_b$bt
        python3 -m online_spec.cli bench ranks --device cuda --ranks 1,2 --modes ${MODES:-strong,weak} \
            --steps ${STEPS:-40} --repeats ${REPEATS:-1} --deepspeed-config configs/deepspeed/$ds.json \
            --warmup-steps ${WARMUP:-8} --batch-tokens $bt --rows ${ROWS:-60000} \
            --tokens-file $W/tokens.json --out $W/ranks_$bt --json $W/$name.json 2>&1 | grep -v "Loading weights" >> $W/ranks.log
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], {m: {n: (r['steps_per_s'], r['steps_per_s_scaling'], r['rows_per_s_scaling']) for n, r in v.items()} for m, v in d['scaling'].items()}); [print(r['mode'], r['ranks'], 'train', r['train_ms_median'], 'wait', r['ms_mean']['wait'], 'pipe', r.get('pipe_ms_median'), 'named', r.get('named_share')) for r in d['runs']]" $W/$name.json
    done; done
    tail -n 20 $W/ranks.log
    local first=${BATCH_TOKENS:-4096}
    [ -n "$PROFILE" ] && python3 scripts/profile_train_step.py --buffer $W/ranks_${first%% *}/buffer --device cuda:0 \
        2>&1 | grep -v "Loading weights" > $W/profile.txt; cp $W/profile.txt $OUT/ 2>/dev/null
    for f in $W/ranks_*/*/train.log; do echo "== $f"; grep -v "Loading weights" $f | tail -n 2; done
    cp $W/gpu_ranks*.json $W/ranks.log $OUT/ 2>/dev/null
}
case $stage in
part)
    mkdir -p /tmp/g && cp "$1"/gguf.part.* /tmp/g/ && ls -la /tmp/g
    nvidia-smi -L; python3 -V
    ;;
run)
    P=$1; shift
    cat /tmp/g/gguf.part.* > /tmp/g/SmolLM2-135M-Instruct.Q4_1.gguf && md5sum /tmp/g/SmolLM2-135M-Instruct.Q4_1.gguf
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        $P/whl/*.whl || exit 5
    rm -rf $CODE && mkdir -p $CODE && tar -cf - --exclude=./.gpu --exclude=./.git . | tar -xf - -C $CODE || exit 4
    rm -rf $W && mkdir -p $W && cp $P/tokens.json $P/*.jsonl $W/; cp $P/engine_prompts.json $W/ 2>/dev/null
    [ -d $P/head ] && cp -r $P/head $W/head  # kept for the `code` stage
    [ -d $W/head ] && mkdir -p $CODE/online_spec/pretrained && cp -r $W/head/sharegpt-chat-h100 $CODE/online_spec/pretrained/
    cd $CODE || exit 4
    python3 -c "from pathlib import Path; from online_spec.target import prepare_smollm2; \
print(prepare_smollm2(src=Path('/tmp/g')))" 2>&1 | grep -v "Loading weights" || exit 6
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    [ -n "$SKIP_RANKS" ] || python3 -c "  # a trainer on GPU 1 trains there (DeepSpeed places the head by LOCAL_RANK unless told)
from tests.distill_helpers import greedy_records, tiny8
from online_spec.head import new_head
from trainer.batch import collate
from trainer.distill import DistillConfig, Distiller
from trainer.loss import LossConfig
t = tiny8(); recs, _ = greedy_records(t, num=2, new_tokens=16); t.hf.to('cuda:1'); t._rope_len = 0
d = Distiller(t, new_head(t, 128, seed=0).float(), DistillConfig(warmup_steps=1, total_steps=10), LossConfig(ttt_steps=2))
m = [d.train_step(collate(recs)) for _ in range(3)]
print('smoke cuda:1: head on', d.head.fc.weight.device, 'loss', round(m[0]['loss'], 3), '->', round(m[-1]['loss'], 3))
" 2>&1 | grep -v "Loading weights" | tail -n 5
    [ -n "$SKIP_RANKS" ] || ranks
    [ $# -eq 0 ] && exit 0  # no e2e flags: bench ranks only
    start_e2e e2e "$@"
    ;;
e2e)  # NAME FLAGS...: another bench e2e on the machine a `run` call set up
    cd $CODE || exit 4
    start_e2e "$@"
    ;;
engine)  # FLAGS...: bench engine on the machine a `run` call set up (the prompts built here: engine_prompts.json)
    cd $CODE || exit 4
    python3 -m online_spec.cli bench engine --device cuda --draft shipped --prompts-file $W/engine_prompts.json \
        --json $W/gpu_engine.json "$@" 2>&1 | grep -v "Loading weights" | tail -n 30
    cp $W/gpu_engine.json $OUT/ 2>/dev/null
    ;;
script)  # SCRIPT ARGS...: a script of the checkout on the set-up machine (its JSON under $W comes back)
    cd $CODE || exit 4
    touch $W/.script_t0
    python3 "$@" 2>&1 | grep -v "Loading weights" | tail -n 30
    find $W -maxdepth 1 -name '*.json' -newer $W/.script_t0 -exec cp {} $OUT/ \;  # what this call wrote
    ;;
code)  # the call's checkout replaces the set-up machine's code (a fix between calls; nothing reinstalled)
    rm -rf $CODE && mkdir -p $CODE && tar -cf - --exclude=./.gpu --exclude=./.git . | tar -xf - -C $CODE || exit 4
    [ -d $W/head ] && mkdir -p $CODE/online_spec/pretrained && cp -r $W/head/sharegpt-chat-h100 $CODE/online_spec/pretrained/
    ls $CODE/online_spec/pretrained
    ;;
ranks)  # bench ranks again on the machine a `run` call set up (DSCONFIGS, BATCH_TOKENS, MODES, STEPS, REPEATS)
    cd $CODE || exit 4
    ranks
    ;;
follow)
    follow ${1:-540}
    ;;
esac
