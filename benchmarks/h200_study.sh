#!/bin/bash
# One device call's share of the GPU study (studies/gpu.yaml), for machines that are lent for
# minutes at a time and come back bare: restore the records of the runs that already finished,
# run the study until LIMIT seconds (SIGINT, as Ctrl-C: runs in flight are recorded as
# interrupted and retried next time), then pack every run's results under $OUT without
# checkpoints or exported models, for the next call to carry back.
#
#   LIMIT=540 bash benchmarks/h200_study.sh [deltalab study args, e.g. --only 'kdn_*']
#
# Finished runs come from docs/study/gpu/records (the raw records kept in the repository) and
# from a carried gpu_jobs/study_gpu/ (an earlier call's $OUT/study_gpu.tgz unpacked there), the
# later winning. A run cut off by LIMIT is lost (its checkpoint cannot come back), so select with
# --only what finishes inside it. On the H200 (2026-12-01, docs/RESULTS.md), 8 at a time: a GDN-2
# run ~480 s with its evaluations, a Muir run over 535 s, a Transformer run ~130 s; Diagonal KDN
# trains at half the speed. The gate-sensitivity replay (fifth session) is not in those times.
set -u
LIMIT=${LIMIT:-540}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT" runs/study/gpu
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p runs/study/gpu/runs
[ -d docs/study/gpu/records ] && cp -r docs/study/gpu/records/. runs/study/gpu/runs/
[ -d gpu_jobs/study_gpu/runs ] && cp -r gpu_jobs/study_gpu/runs/. runs/study/gpu/runs/
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
