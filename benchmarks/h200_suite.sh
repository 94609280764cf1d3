#!/bin/bash
# Every GPU measurement of issue 10 in one device call, each part under its own time limit, so
# that one part that stalls (fla autotunes each kernel on its first call: 1-3 minutes) costs
# only its own budget. Packs each part's output and JSON into $OUT/suite.tgz ($OUT: ./gpu-out).
#
#   bash benchmarks/h200_suite.sh [PART ...]     # parts: tests kernel_tests time time_fla time_fla_kda time_fla_gdn2 prof prof_ours tune_stage12 stability train decode kdn tune tune340 tune32k split split_tests split_ptrain time_deep ptrain ptrain16k split_ptrain16k split16k ptrain_gdn2 train32k kdn_ptrain keep_ptrain keep_train checks_ptrain compile compile_ptrain conv conv_tests norms norms_tests swiglu swiglu_tests decay decay_tests rope rope_tests read_gate read_gate_tests ops_ab ops16_ptrain keepin_ptrain keepin_train ffn_train stages340 stages16 warm graphs_tests graphs_train graphs_train16k graphs_train32k graphs_ptrain walkdots walkdots_tune dotscheck time32k prof_kdn ffn16k gain_launch kdn_train gain_chunks ncu_gain overhead strength_tests strength_train gaps kdn_tests prof_kdn32k layers_tests gain_split_tests ncu_walks32k walk_launch32k decode_prof
#
# With fla (a yardstick, not a dependency): put its wheels in .whl/ (`pip download --no-deps`
# of fla-core==0.6.0, flash-linear-attention==0.6.0 and einops for the GPU machine's Python)
# and they are installed first. Budget the call: time_fla 300 s (the time part at the 4K shape
# alone; on 2026-12-01 fla's autotuning of chunk_gdn2 ran past it, after chunk_kda's row), time_fla_kda 420 s (the same without fla's chunk_gdn2; at 260 s fla's chunk_kda autotuning ran past the limit twice on 2026-12-02), time_fla_gdn2 420 s (the GDN-2 form
# against fla's chunk_gdn2 alone, with room for its autotuning), prof_ours 60 s (prof without fla's autotuning),
# tune_stage12 120 s (stage 1's and the solve's launches at the 340M heads), tests 360 s (on 2026-12-02, 240 s ran 106 of its 110 tests; the delta rule's kernels and
# tests/test_cuda.py: on 2026-12-01 both passed inside the limit, and 21 tests of the layers'
# file after them), kernel_tests 150 s (the layers
# on Triton and the fused KDN gain; with tests, every Triton test file but the small ops'), time 300 s,
# prof 90 s, stability 240 s, train 300 s, decode 200 s, kdn 180 s (with the split diagonal gain and its chunk sweep), tune 180 s, tune340 180 s (the same at the 340M
# preset's heads, H=8: the state pass's BLOCK_V was tuned at H=16), tune32k 120 s (the state
# pass at B=1 T=32768: 32 programs with BLOCK_V 64), split 240 s (the fused and the split
# state pass timed side by side at the 340M heads, --state-pass), split_tests 120 s (the
# state-pass tests compiled on the GPU), split_ptrain 180 s (ptrain's gdn2 step with the split
# state pass: compare with ptrain's gdn2), ptrain16k 150 s, split_ptrain16k 90 s and
# split16k 150 s (the same three at B=1 T=16384: a quarter of the programs, walks four times as
# long), ptrain_gdn2 120 s (ptrain's gdn2 at 4K and 16K alone), train32k 150 s (train at B=1
# T=32768: Muir, GDN-2, the Transformer), keep_ptrain 120 s and keep_train 240 s (ptrain_gdn2's profiles and
# train's tokens/s and peak memory with the Triton delta rule keeping its chunk-start states for
# the backward, KernelOptions.recompute_states off: compare with ptrain_gdn2 and train),
# checks_ptrain 240 s (GDN-2's
# 4K step, kernel and wall time, with the value checks read after the backward, an experiment,
# and after the forward, the trainer's way, then the Transformer's), time_deep
# 120 s (log decays down to -8 per token: stage 1 walks most diagonal sub-blocks, as on trained
# gates; benchmarks/diagonal_forms.py), ptrain 180 s (a 340M training step's kernel time by
# category), compile 300 s (340M training throughput with torch.compile), compile_ptrain 200 s
# (ptrain's 4K step compiled, GDN-2 and the Transformer: kernel and wall time), conv 90 s (the short
# convolution: Triton kernels against the conv1d path, errors against float64, a launch sweep),
# conv_tests 120 s (tests/test_short_conv.py compiled on the GPU, bf16 included), norms 150 s
# (the block, gated and L2 norms: Triton kernels against the torch path, errors against
# float64), norms_tests 120 s (tests/test_norms.py compiled on the GPU, bf16 included), swiglu
# 120 s (the FFN's SwiGLU gating at the 340M shapes: Triton kernels against the torch path, errors
# against float64), swiglu_tests 90 s (tests/test_swiglu.py compiled on the GPU, bf16 included), decay
# 120 s (the log decay: Triton kernels against the torch path, errors against float64),
# decay_tests 90 s (tests/test_log_decay.py compiled on the GPU, bf16 included), rope 120 s (the
# Transformer's RoPE at the 340M shapes: the Triton kernel against the torch path, errors against
# float64), rope_tests 90 s (tests/test_rope.py compiled on the GPU, bf16 included), read_gate 120 s
# (Muir's read gate fused with the query: Triton kernels against the torch path, errors against
# float64), read_gate_tests 90 s (tests/test_read_gate.py compiled on the GPU, bf16 included),
# ops_ab 240 s (the op's errors against float64, at bench_triton.py's check shape, and its times
# at B=4 T=4096 H=16, chunk 64, with the chunk operators stored in float32 and then in the
# inputs' dtype, KernelOptions.operator_dtype), ops16_ptrain 80 s (ptrain_gdn2's 4K profile
# with 16-bit operators: compare with ptrain_gdn2), keepin_ptrain 80 s and keepin_train 240 s
# (ptrain_gdn2's 4K profile, and train's GDN-2 and Muir rows, with the delta rule keeping the
# inputs it otherwise rebuilds in the backward, KernelOptions.rebuild_in_backward off: compare
# with ptrain_gdn2 and train), ffn_train 200 s (train's rows with each block's FFN branch
# computed again in the backward, train.recompute_ffn: compare with train), stages340
# 200 s (the fused and the split state pass's launch sweep at the 340M heads with the chunk
# operators in bf16, pipeline stages included: compare with split), stages16 200 s (the same
# at H=16, where "auto" takes the fused pass), warm 120 s (a throwaway
# 340M GDN-2 training run: on a fresh machine each training process ran faster than the one
# before it, 51K -> 60K -> 68K tokens/s on 2026-12-02, docs/RESULTS.md; put it before the
# parts that measure training throughput), graphs_tests 500 s (a CUDA graph's replayed step
# against eager steps, and every mixer's graphed training against its eager loss curve,
# tests/test_cuda.py: 24 short training runs; 5 tests took 59 s on 2026-12-02), graphs_train 300 s, graphs_train16k 240 s and graphs_train32k 300 s
# (train's rows at 4K, 16K and 32K, eager and with train.cuda_graphs, each mixer's two runs
# back to back), graphs_ptrain 150 s (ptrain's 4K step of GDN-2 and the Transformer replayed as
# a CUDA graph: kernel and wall time), walkdots 300 s (the op's errors against float64 and its
# times at B=4 T=4096 H=16 with the fused walks' products widened to float32 and in the
# operators' bf16, KernelOptions.walk_dots), walkdots_tune 240 s (the state pass's launch
# sweep at H=16 and H=8, its walk_dots rows among them), dotscheck 300 s (the op's errors
# against float64 with the walks' products in the operators' dtype, chunks of 64: at 150 s and
# chunks of 64 and 128 it ran past its limit on 2026-12-02), time32k 150 s (every form and SDPA at
# B=1 T=32768 H=16, without fla: the target of 2x SDPA's forward+backward), prof_kdn 90 s (the
# kernels of the KDA form and the two KDN forms by time: where the KDN gains' cost goes), ffn16k 200 s (graphs_train16k's rows with
# train.recompute_ffn: the 16K peak memory against the Transformer's), gain_launch 200 s (the split diagonal
# gain's launch sweep, one kernel's (BLOCK_T, warps) at a time, bf16 inputs), kdn_train 200 s
# (the two KDN presets' graphed 340M training at 4K beside the Transformer's), gain_chunks 120 s
# (the split diagonal gain's tokens per program at the three shapes, bf16 inputs), ncu_gain 150 s
# (Nsight Compute's counters of the split diagonal gain's four walks, B=4 T=4096 H=16, bf16,
# the loss reaching the gain and the routed k and g: throughput, occupancy, warp stalls; the
# token walks since 2026-12-04, the tile kernels before), overhead 150 s (bench_triton.py's overhead part at B=4
# T=4096 H=16: wall time with the value checks on and off, kernel time, the host's launch time,
# and the host's op table of the KDN forms), strength_tests 120 s (the delta rule's per-token
# write strength against the float64 loop, compiled), strength_train 200 s (KDA and Isotropic
# KDN 340M graphed training at 4K beside the Transformer's), gaps 150 s (device_gaps.py: the
# device's idle gaps in the KDA, Isotropic and Diagonal KDN forms' forward and backward, checks
# on and off, by the host code that launched the work after them), kdn_tests 420 s (the KDN
# gains' and the Mobius scans' kernel tests compiled, and the value checks' GPU test:
# tests/test_kdn_triton.py, tests/test_mobius_triton.py, tests/test_value_checks.py; at 240 s
# it ran past its limit on 2026-12-04 after ~100 tests: test_kdn_triton.py alone took 136 s),
# prof_kdn32k 120 s (prof_kdn at B=1 T=32768), layers_tests 300 s (the layers on Triton
# alone: kernel_tests without the KDN gains' file, which kdn_tests runs), gain_split_tests 240 s
# (the diagonal gain's tests in tests/test_kdn_triton.py compiled: split, NaN-filled
# outputs; 123 s on 2026-12-04), ncu_walks32k 200 s (ncu_gain's counters for the diagonal gain's
# token walks at B=1 T=32768 H=16), walk_launch32k 200 s (gain_launch at B=1 T=32768 H=16;
# since 2026-12-04 gain_launch's loss reaches the routed k and g, and its walks are the token
# walks, each one's (tokens unrolled, warps) in turn), decode_prof 240 s (the
# kernels of one graphed decoding step of the 340M presets at 4K of context, by time and count
# per token: benchmarks/profile_decode.py). The part gain_lanes (the token walks at two and four
# chunks a program, slower) is in the tree of `2864f56`; the part factors_ab (stage 1 writing
# the decay factors) in the tree of `a424144`; the part intradots (stage 1's products in the
# inputs' 16-bit dtype) and sep_ptrain (each projection of a layer input differentiated alone)
# in the tree of `9dc4393`.
set -u
# The device returns at most 8 files: parts write under a work folder, and after every part the
# whole of it is packed into $OUT/suite.tgz (so a call cut off still returns what finished).
DEST=${OUT:-gpu-out}
OUT=${SUITE_WORK:-/tmp/h200_suite}
mkdir -p "$DEST" "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
parts=("$@")
# graphs_train*'s --cuda-graphs: "both" (each mixer graphed, then eager), or GRAPHS=on for the
# graphed rows alone (about half the time).
GRAPHS=${GRAPHS:-both}
[ ${#parts[@]} -eq 0 ] && parts=(tests time prof stability train decode kdn)

part() {  # part NAME SECONDS COMMAND...: run, log to $OUT/NAME.txt, record rc and seconds
    local name=$1 limit=$2
    shift 2
    local start=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    echo "$name rc=$? $(( $(date +%s) - start ))s" | tee -a "$OUT/parts.txt"
    tar -czf "$DEST/suite.tgz" -C "$OUT" .
}

# bench_train.py at the 340M preset, B=4 T=4096 and then B=1 T=16384 (8 steps each):
# train_pair "MIXERS AT 4K" "MIXERS AT 16K" [OPTION ...], the options passed to both runs.
train_pair() {
    python3 benchmarks/bench_train.py --device cuda --preset 340M --seq-len 4096 --batch 4 \
        --steps 8 --mixers $1 "${@:3}" && \
    python3 benchmarks/bench_train.py --device cuda --preset 340M --seq-len 16384 --batch 1 \
        --steps 8 --mixers $2 "${@:3}"
}
export -f train_pair

# Nsight Compute's counters of the diagonal gain's four token walks in the second of two
# forward+backward runs (four matching launches a run): ncu_walks OUT_JSON [OPTION ...], the
# options passed to bench_kdn_triton.py --gain-profile (--shape).
ncu_walks() {
    ncu --clock-control none --kernel-name \
        regex:'_kdn_diag_gain_token_(maps|forward|adjoints|backward)_kernel' \
        --launch-skip 4 --launch-count 4 --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        python3 benchmarks/bench_kdn_triton.py --gain-profile --repeats 2 --dtype bfloat16 \
        --out "$1" "${@:2}"
}
export -f ncu_walks

for p in "${parts[@]}"; do
    case $p in
    tests) part tests 360 python3 -m pytest -q --maxfail=3 -p no:cacheprovider \
        tests/test_delta_rule_triton.py tests/test_cuda.py -k "not trains and not graphed_training" ;;
    strength_tests) part strength_tests 120 python3 -m pytest -q --maxfail=3 -p no:cacheprovider \
        tests/test_delta_rule_triton.py -k "strength or per_token" ;;
    kdn_tests) part kdn_tests 420 python3 -m pytest -q --maxfail=3 -p no:cacheprovider \
        tests/test_kdn_triton.py tests/test_mobius_triton.py tests/test_value_checks.py ;;
    prof_kdn32k) part prof_kdn32k 120 python3 benchmarks/profile_triton.py --forms kda_c64 \
        kdn_iso_c64 kdn_diag_c64 --batch 1 --length 32768 --out "$OUT/prof_kdn32k.json" ;;
    layers_tests) part layers_tests 300 python3 -m pytest -q --maxfail=3 -p no:cacheprovider \
        tests/test_layers_triton.py ;;
    kernel_tests) part kernel_tests 300 python3 -m pytest -q --maxfail=3 -p no:cacheprovider \
        tests/test_layers_triton.py tests/test_kdn_triton.py ;;
    time) part time 300 python3 benchmarks/bench_triton.py --parts time \
        --only kda_c64 gdn2_c64 gdn_c64 kdn_iso_c64 kdn_diag_c64 kda_c128 fla sdpa \
        --out "$OUT/time.json" ;;
    time_deep) part time_deep 120 python3 benchmarks/bench_triton.py --parts time --gmax 8 \
        --shapes 4x4096x16x128 --only kda_c64 gdn2_c64 kdn_diag_c64 --out "$OUT/time_deep.json" ;;
    time_fla) part time_fla 300 python3 benchmarks/bench_triton.py --parts time \
        --shapes 4x4096x16x128 --only kda_c64 gdn2_c64 kdn_iso_c64 kdn_diag_c64 fla_kda fla_gdn2 \
        sdpa --out "$OUT/time_fla.json" ;;
    time_fla_gdn2) part time_fla_gdn2 420 python3 benchmarks/bench_triton.py --parts time \
        --shapes 4x4096x16x128 --only gdn2_c64 fla_gdn2 --out "$OUT/time_fla_gdn2.json" ;;
    time32k) part time32k 150 python3 benchmarks/bench_triton.py --parts time \
        --shapes 1x32768x16x128 --only kda_c64 kda_product_c64 gdn2_c64 gdn_c64 kdn_iso_c64 kdn_diag_c64 sdpa \
        --out "$OUT/time32k.json" ;;
    time_fla_kda) part time_fla_kda 420 python3 benchmarks/bench_triton.py --parts time \
        --shapes 4x4096x16x128 --only kda_c64 kda_product_c64 gdn2_c64 kdn_iso_c64 kdn_diag_c64 fla_kda sdpa \
        --out "$OUT/time_fla_kda.json" ;;
    prof_kdn) part prof_kdn 90 python3 benchmarks/profile_triton.py --forms kda_c64 \
        kdn_iso_c64 kdn_diag_c64 --out "$OUT/prof_kdn.json" ;;
    prof_ours) part prof_ours 60 python3 benchmarks/profile_triton.py --forms kda_c64 gdn2_c64 \
        --out "$OUT/prof_ours.json" ;;
    tune_stage12) part tune_stage12 120 python3 benchmarks/tune_triton.py --shape 4x4096x8x128 \
        --stages intra solve --out "$OUT/tune_stage12.json" ;;
    prof) part prof 90 python3 benchmarks/profile_triton.py --forms kda_c64 fla_kda \
        --out "$OUT/prof.json" ;;
    stability) part stability 240 python3 benchmarks/bench_triton.py --parts stability \
        --out "$OUT/stability.json" ;;
    train) part train 300 bash -c 'train_pair "gdn2 muir kdn_diag transformer" \
        "gdn2 muir transformer"' ;;
    decode) part decode 200 python3 benchmarks/bench_decode_gpu.py --out "$OUT/decode.json" ;;
    kdn) part kdn 180 python3 benchmarks/bench_kdn_triton.py --out "$OUT/kdn.json" ;;
    tune) part tune 180 python3 benchmarks/tune_triton.py --out "$OUT/tune.json" ;;
    tune340) part tune340 180 python3 benchmarks/tune_triton.py --shape 4x4096x8x128 \
        --out "$OUT/tune340.json" ;;
    tune32k) part tune32k 120 python3 benchmarks/tune_triton.py --shape 1x32768x16x128 \
        --stages state_pass --out "$OUT/tune32k.json" ;;
    split) part split 240 python3 benchmarks/tune_triton.py --shape 4x4096x8x128 \
        --stages state_pass state_pass_split --out "$OUT/split.json" ;;
    split_tests) part split_tests 120 python3 -m pytest -q --maxfail=3 -p no:cacheprovider \
        tests/test_delta_rule_triton.py -k "split or state_pass or every_gradient or chunk_128" ;;
    split_ptrain) part split_ptrain 180 python3 benchmarks/profile_train.py --state-pass split \
        --device cuda --preset 340M --seq-len 4096 --batch 4 --mixers gdn2 \
        --out "$OUT/split_ptrain.json" ;;
    ptrain) part ptrain 180 python3 benchmarks/profile_train.py --device cuda --preset 340M \
        --seq-len 4096 --batch 4 --mixers gdn2 muir kdn_diag transformer --out "$OUT/ptrain.json" ;;
    ptrain16k) part ptrain16k 150 python3 benchmarks/profile_train.py --device cuda --preset 340M \
        --seq-len 16384 --batch 1 --mixers gdn2 muir transformer --out "$OUT/ptrain16k.json" ;;
    split_ptrain16k) part split_ptrain16k 90 python3 benchmarks/profile_train.py --state-pass split \
        --device cuda --preset 340M --seq-len 16384 --batch 1 --mixers gdn2 \
        --out "$OUT/split_ptrain16k.json" ;;
    split16k) part split16k 150 python3 benchmarks/tune_triton.py --shape 1x16384x8x128 \
        --stages state_pass state_pass_split --out "$OUT/split16k.json" ;;
    ptrain_gdn2) part ptrain_gdn2 120 bash -c "python3 benchmarks/profile_train.py --device cuda \
        --preset 340M --seq-len 4096 --batch 4 --mixers gdn2 --out \"$OUT/ptrain_gdn2_4k.json\" && \
        python3 benchmarks/profile_train.py --device cuda --preset 340M --seq-len 16384 --batch 1 \
        --mixers gdn2 --out \"$OUT/ptrain_gdn2_16k.json\"" ;;
    train32k) part train32k 150 python3 benchmarks/bench_train.py --device cuda --preset 340M \
        --seq-len 32768 --batch 1 --steps 6 --mixers muir gdn2 transformer ;;
    keep_ptrain) part keep_ptrain 120 bash -c "python3 benchmarks/profile_train.py \
        --keep-states --device cuda --preset 340M --seq-len 4096 --batch 4 --mixers gdn2 \
        --out \"$OUT/keep_ptrain_4k.json\" && python3 benchmarks/profile_train.py \
        --keep-states --device cuda --preset 340M --seq-len 16384 --batch 1 --mixers gdn2 \
        --out \"$OUT/keep_ptrain_16k.json\"" ;;
    checks_ptrain) part checks_ptrain 240 bash -c "python3 benchmarks/profile_train.py \
        --checks-after-backward --device cuda --preset 340M --seq-len 4096 --batch 4 --mixers gdn2 \
        --warmup 2 --steps 5 --out \"$OUT/checks_after_backward.json\" && python3 benchmarks/profile_train.py \
        --device cuda --preset 340M --seq-len 4096 --batch 4 --mixers gdn2 \
        --warmup 2 --steps 5 --out \"$OUT/checks_after_forward.json\" && python3 \
        benchmarks/profile_train.py --device cuda --preset 340M --seq-len 4096 --batch 4 \
        --mixers transformer --warmup 2 --steps 5 --out \"$OUT/checks_transformer.json\"" ;;
    ops_ab) part ops_ab 240 bash -c "for dtype in float32 inputs; do python3 \
        benchmarks/bench_triton.py --parts check time --chunk-sizes 64 --shapes 4x4096x16x128 \
        --operator-dtype \$dtype --out \"$OUT/ops_\$dtype.json\"; done" ;;
    walkdots) part walkdots 300 bash -c "for dots in float32 operators; do python3 \
        benchmarks/bench_triton.py --parts check time --chunk-sizes 64 --shapes 4x4096x16x128 \
        --walk-dots \$dots --out \"$OUT/walkdots_\$dots.json\"; done" ;;
    dotscheck) part dotscheck 300 python3 benchmarks/bench_triton.py --parts check \
        --chunk-sizes 64 --walk-dots operators --out "$OUT/dotscheck.json" ;;
    walkdots_tune) part walkdots_tune 240 bash -c "python3 benchmarks/tune_triton.py \
        --shape 4x4096x16x128 --stages state_pass --out \"$OUT/walkdots16.json\" && \
        python3 benchmarks/tune_triton.py --shape 4x4096x8x128 --stages state_pass \
        --out \"$OUT/walkdots8.json\"" ;;
    ops16_ptrain) part ops16_ptrain 80 python3 benchmarks/profile_train.py \
        --operator-dtype inputs --device cuda --preset 340M --seq-len 4096 --batch 4 \
        --mixers gdn2 --out "$OUT/ops16_ptrain_4k.json" ;;
    keepin_ptrain) part keepin_ptrain 80 python3 benchmarks/profile_train.py --keep-inputs \
        --device cuda --preset 340M --seq-len 4096 --batch 4 --mixers gdn2 \
        --out "$OUT/keepin_ptrain_4k.json" ;;
    keepin_train) part keepin_train 240 bash -c 'train_pair "gdn2 muir" "gdn2 muir" \
        --keep-inputs' ;;
    stages16) part stages16 200 python3 benchmarks/tune_triton.py --shape 4x4096x16x128 \
        --stages state_pass state_pass_split --out "$OUT/stages16.json" ;;
    warm) part warm 120 python3 benchmarks/bench_train.py --device cuda --preset 340M \
        --seq-len 4096 --batch 4 --steps 12 --mixers gdn2 ;;
    ffn_train) part ffn_train 200 bash -c 'train_pair "gdn2 transformer" \
        "gdn2 muir transformer" --recompute-ffn' ;;
    graphs_tests) part graphs_tests 500 python3 -m pytest -q --maxfail=3 -p no:cacheprovider \
        tests/test_cuda.py -k "graph_replay_writes or graphed_training" ;;
    graphs_train) part graphs_train 300 python3 benchmarks/bench_train.py --device cuda \
        --preset 340M --seq-len 4096 --batch 4 --steps 8 --cuda-graphs "$GRAPHS" \
        --mixers gdn2 muir kdn_diag transformer ;;
    graphs_train16k) part graphs_train16k 240 python3 benchmarks/bench_train.py --device cuda \
        --preset 340M --seq-len 16384 --batch 1 --steps 8 --cuda-graphs "$GRAPHS" \
        --mixers gdn2 muir transformer ;;
    walk_launch32k) part walk_launch32k 200 python3 benchmarks/bench_kdn_triton.py \
        --gain-launches --dtype bfloat16 --shape 1x32768x16x128 --out "$OUT/walk_launch32k.json" ;;
    decode_prof) part decode_prof 240 python3 benchmarks/profile_decode.py \
        --out "$OUT/decode_prof.json" ;;
    gain_split_tests) part gain_split_tests 240 python3 -m pytest -q --maxfail=3 \
        -p no:cacheprovider tests/test_kdn_triton.py -k "split or writes_every or diag" ;;
    gain_launch) part gain_launch 200 python3 benchmarks/bench_kdn_triton.py --gain-launches \
        --dtype bfloat16 --out "$OUT/gain_launch.json" ;;
    gain_chunks) part gain_chunks 120 python3 benchmarks/bench_kdn_triton.py --gain-chunks \
        --dtype bfloat16 --out "$OUT/gain_chunks.json" ;;
    ncu_gain) part ncu_gain 150 bash -c "ncu_walks '$OUT/ncu_gain.json'" ;;
    ncu_walks32k) part ncu_walks32k 200 bash -c \
        "ncu_walks '$OUT/ncu_walks32k.json' --shape 1x32768x16x128" ;;
    overhead) part overhead 150 python3 benchmarks/bench_triton.py --parts overhead \
        --shapes 4x4096x16x128 --only kda_c64 gdn2_c64 kdn_iso_c64 kdn_diag_c64 \
        --out "$OUT/overhead.json" ;;
    kdn_train) part kdn_train 200 python3 benchmarks/bench_train.py --device cuda --preset 340M \
        --seq-len 4096 --batch 4 --steps 8 --cuda-graphs on --mixers kdn_diag kdn_iso transformer ;;
    gaps) part gaps 150 python3 benchmarks/device_gaps.py --forms kda_c64 kdn_iso_c64 \
        kdn_diag_c64 --out "$OUT/gaps.json" ;;
    strength_train) part strength_train 200 python3 benchmarks/bench_train.py --device cuda \
        --preset 340M --seq-len 4096 --batch 4 --steps 8 --cuda-graphs on \
        --mixers kda kdn_iso transformer ;;
    ffn16k) part ffn16k 200 python3 benchmarks/bench_train.py --device cuda --preset 340M \
        --seq-len 16384 --batch 1 --steps 8 --cuda-graphs "$GRAPHS" --recompute-ffn \
        --mixers gdn2 muir transformer ;;
    graphs_ptrain) part graphs_ptrain 150 python3 benchmarks/profile_train.py --cuda-graphs \
        --device cuda --preset 340M --seq-len 4096 --batch 4 --mixers gdn2 transformer \
        --out "$OUT/graphs_ptrain.json" ;;
    graphs_train32k) part graphs_train32k 300 python3 benchmarks/bench_train.py --device cuda \
        --preset 340M --seq-len 32768 --batch 1 --steps 8 --cuda-graphs "$GRAPHS" \
        --mixers muir gdn2 transformer ;;
    stages340) part stages340 200 python3 benchmarks/tune_triton.py --shape 4x4096x8x128 \
        --stages state_pass state_pass_split --out "$OUT/stages340.json" ;;
    keep_train) part keep_train 240 bash -c 'train_pair "gdn2 kdn_diag" "gdn2 muir" \
        --keep-states' ;;
    compile) part compile 300 python3 benchmarks/bench_train.py --device cuda --preset 340M \
        --seq-len 4096 --batch 4 --steps 8 --mixers gdn2 muir transformer --compile ;;
    compile_ptrain) part compile_ptrain 200 bash -c "python3 benchmarks/profile_train.py --compile \
        --device cuda --preset 340M --seq-len 4096 --batch 4 --mixers gdn2 transformer \
        --out \"$OUT/compile_ptrain.json\"" ;;
    conv) part conv 90 python3 benchmarks/bench_short_conv.py --sweep --out "$OUT/conv.json" ;;
    conv_tests) part conv_tests 120 python3 -m pytest -q --maxfail=3 -p no:cacheprovider \
        tests/test_short_conv.py ;;
    norms) part norms 150 python3 benchmarks/bench_norms.py --out "$OUT/norms.json" ;;
    norms_tests) part norms_tests 120 python3 -m pytest -q --maxfail=3 -p no:cacheprovider \
        tests/test_norms.py ;;
    swiglu) part swiglu 120 python3 benchmarks/bench_swiglu.py --out "$OUT/swiglu.json" ;;
    swiglu_tests) part swiglu_tests 90 python3 -m pytest -q --maxfail=3 -p no:cacheprovider \
        tests/test_swiglu.py ;;
    decay) part decay 120 python3 benchmarks/bench_log_decay.py --out "$OUT/decay.json" ;;
    decay_tests) part decay_tests 90 python3 -m pytest -q --maxfail=3 -p no:cacheprovider \
        tests/test_log_decay.py ;;
    rope) part rope 120 python3 benchmarks/bench_rope.py --out "$OUT/rope.json" ;;
    rope_tests) part rope_tests 90 python3 -m pytest -q --maxfail=3 -p no:cacheprovider \
        tests/test_rope.py ;;
    read_gate) part read_gate 120 python3 benchmarks/bench_read_gate.py \
        --out "$OUT/read_gate.json" ;;
    read_gate_tests) part read_gate_tests 90 python3 -m pytest -q --maxfail=3 \
        -p no:cacheprovider tests/test_read_gate.py ;;
    *) echo "unknown part: $p (the parts are listed at the top of $0)"; exit 2 ;;
    esac
done
