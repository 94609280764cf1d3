#!/bin/bash
# One device call's share of the GPU study (studies/gpu.yaml), for machines that are lent for
# minutes at a time and come back bare: restore the records of the runs that already finished,
# run the study until LIMIT seconds (SIGINT, as Ctrl-C: runs in flight are recorded as
# interrupted and retried next time), then pack every run's results under $OUT without
# checkpoints or exported models, for the next call to carry back.
#
#   LIMIT=540 bash benchmarks/h200_study.sh [deltalab study args, e.g. --only 'kdn_*']
#
# Finished runs come from a carried gpu_jobs/study_gpu/ (an earlier call's $OUT/study_gpu.tgz
# unpacked there) and from docs/study/gpu/records and tasks (the raw records kept in the
# repository), the carried ones first. A run's directory is restored only where the machine has
# none: a machine still warm from the previous call (the next call made within its idle release,
# ~30 s) keeps that call's runs, with the checkpoints and models that cannot come back, and those
# are newer than anything carried. (Copying over them once put an earlier training's metrics
# beside a later training's evaluations: 2026-12-01, docs/STUDY.md.) On a warm machine a run cut
# off by LIMIT resumes from its checkpoint; on a fresh one it starts over, so select with --only
# what finishes inside the limit. On the H200 (2026-12-01, docs/STUDY.md), 8 at a time: a GDN-2
# or Muir run ~330-480 s with its evaluations, a Diagonal KDN run ~360 s, a Transformer ~130 s;
# an MQAR job 65-115 s.
set -u
LIMIT=${LIMIT:-540}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT" runs/study/gpu
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
restore() {  # restore SOURCE_DIR TARGET_DIR: each entry of SOURCE_DIR the target lacks
    [ -d "$1" ] || return 0
    mkdir -p "$2"
    for entry in "$1"/*; do
        [ -e "$entry" ] && [ ! -e "$2/$(basename "$entry")" ] && cp -r "$entry" "$2/"
    done
    return 0
}
restore gpu_jobs/study_gpu/runs runs/study/gpu/runs
restore gpu_jobs/study_gpu/tasks runs/study/gpu/tasks
restore docs/study/gpu/records runs/study/gpu/runs
restore docs/study/gpu/tasks runs/study/gpu/tasks
(while true; do
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader >> "$OUT/smi.txt"
    sleep 10
done) &
smi=$!
start=$(date +%s)
timeout -s INT -k 30 "$LIMIT" python3 -m deltalab study studies/gpu.yaml "$@" > "$OUT/study.log" 2>&1
echo "study rc=$? $(( $(date +%s) - start ))s"
kill $smi
tail -30 "$OUT/study.log"
tar -C runs/study --exclude=checkpoints --exclude=model --exclude='*.safetensors' --exclude='*.pt' \
    -czf "$OUT/study_gpu.tgz" gpu
