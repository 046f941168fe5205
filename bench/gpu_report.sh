#!/usr/bin/env bash
# One prepared run for a lent GPU machine (the `device` tool; 15 minutes a session, 10 a command):
# the checks in priority order, each bounded by its own timeout, the report written as it goes so
# that a run cut short still returns what it finished.
#   bash bench/gpu_report.sh [OUT]      (OUT defaults to $OUT, then ./out)
#   SECTIONS="bench worker varlen cuda cpu" (the default: all, in this order) picks sections;
#   WORKLOADS="demo gpu-bert-base-mlm ..." the bench's workloads, AUTOCASTS="none bf16" its dtypes.
# A GPU-sized workload's bench (five modes, two of them compiling) takes minutes: one device session
# holds the demo and the suite, or two or three GPU-sized workloads (SECTIONS=bench), not both.
# The machine's image has its own torch (2.11 on Python 3.12 when this was written) and no package
# registry: fxtrain is used from this checkout (PYTHONPATH), with the image's packages.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-out}}
mkdir -p "$OUT"
REPORT=$OUT/report.md
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
# `fxtrain` as a command (tests/test_cli.py runs it): a shim beside the interpreter's own scripts.
if ! command -v fxtrain >/dev/null; then
    mkdir -p /tmp/fxtrain-bin
    printf '#!/bin/sh\nexec %s -m fxtrain.cli "$@"\n' "$(command -v $PY)" > /tmp/fxtrain-bin/fxtrain
    chmod +x /tmp/fxtrain-bin/fxtrain
    export PATH=/tmp/fxtrain-bin:$PATH
fi

wanted() { [[ " ${SECTIONS:-bench worker varlen cuda cpu} " == *" $1 "* ]]; }
section() { printf '\n## %s (%s)\n\n' "$1" "$(date -u +%H:%M:%S)" >> "$REPORT"; echo "=== $1"; }
tail_of() { printf '```\n%s\n```\n' "$(tail -n "${2:-15}" "$1")" >> "$REPORT"; }
# Suites run with -v: each test's outcome is a line of the log as it ends, so a run the timeout cuts
# short still names every failure so far (-q prints them only in the summary it never reaches).
failures() { grep -oE "(FAILED|ERROR) tests/[^ ]+" "$1" | sort -u; }
outcomes() {
    echo "so far: $(grep -cE '\] PASSED ' "$1") passed, $(failures "$1" | wc -l) failed or errors," \
         "$(grep -cE '\] SKIPPED ' "$1") skipped"
}

{
    echo "# fxtrain on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
    echo
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%Y-%m-%d)"
    $PY -c "import sys, torch, transformers; print(f'python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, cuda {torch.cuda.is_available()}')"
} > "$REPORT" 2>&1

# 1. The demo (WORKLOADS="demo gpu-bert-base-mlm ..." adds others) on the GPU, in float32 and under
#    bf16 autocast: eager, torch.compile and fxtrain's executors, interleaved. The table and the JSON
#    carry each mode's ops and kernels per step and fxtrain's pass decisions (the launch-cost model
#    of cost/launches.py turns a pass off where its launches cost more than its FLOPs).
if wanted bench; then
    for workload in ${WORKLOADS:-demo}; do
        for autocast in ${AUTOCASTS:-none bf16}; do
            section "fxtrain bench --workload $workload --device cuda, autocast $autocast"
            ac=(); [ "$autocast" != none ] && ac=(--autocast "$autocast")
            limit=${BENCH_S:-$([ "$workload" = demo ] && echo 100 || echo 300)}
            timeout "$limit" $PY -m fxtrain.cli bench --workload "$workload" --device cuda --no-progress \
                ${ac[@]+"${ac[@]}"} --modes eager,compile,fxtrain:eager,fxtrain:inductor,fxtrain:auto \
                --json "$OUT/bench_${workload}_$autocast.json" > "$OUT/bench_${workload}_$autocast.log" 2>&1
            echo "exit $?" >> "$OUT/bench_${workload}_$autocast.log"
            tail_of "$OUT/bench_${workload}_$autocast.log" 24
        done
    done
fi

# 1b. The tier's background compile on the GPU: the worker's device and GPU memory (issue 17).
if wanted worker; then
    section "the compiled tier's worker on the GPU (bench/worker_gpu_memory.py)"
    timeout "${WORKER_S:-90}" $PY bench/worker_gpu_memory.py --json "$OUT/worker_gpu_memory.json" \
        > "$OUT/worker_gpu_memory.log" 2>&1
    echo "exit $?" >> "$OUT/worker_gpu_memory.log"
    tail_of "$OUT/worker_gpu_memory.log" 14
fi

# 2. The CUDA attention routes first (one variable-length kernel call per direction: flash for
#    fp16/bf16 on sm80+, memory-efficient for fp32), then the passes that use them.
if wanted varlen; then
    section "varlen attention and the passes over it, FXTRAIN_TEST_DEVICE=cuda"
    FXTRAIN_TEST_DEVICE=cuda timeout "${VARLEN_S:-100}" $PY -m pytest -v -n 4 -p no:cacheprovider -m "not extended" \
        tests/test_varlen_route.py tests/test_varlen_attention.py tests/test_padding_elimination.py \
        tests/test_packed_batches.py > "$OUT/varlen_cuda.log" 2>&1
    echo "exit $?" >> "$OUT/varlen_cuda.log"
    failures "$OUT/varlen_cuda.log" | cut -c1-200 >> "$REPORT"
    outcomes "$OUT/varlen_cuda.log" >> "$REPORT"
    tail_of "$OUT/varlen_cuda.log" 4
fi

# 3. The suite with FXTRAIN_TEST_DEVICE=cuda (issue 17 makes every test honour it).
if wanted cuda; then
    section "make test's selection, FXTRAIN_TEST_DEVICE=cuda"
    FXTRAIN_TEST_DEVICE=cuda timeout "${CUDA_SUITE_S:-200}" $PY -m pytest -v -n "${CUDA_WORKERS:-6}" -m "not extended" \
        -p no:cacheprovider --durations=20 > "$OUT/suite_cuda.log" 2>&1
    echo "exit $?" >> "$OUT/suite_cuda.log"
    failures "$OUT/suite_cuda.log" | cut -c1-200 > "$OUT/suite_cuda_failures.txt"
    tail_of "$OUT/suite_cuda.log" 4
    echo "$(outcomes "$OUT/suite_cuda.log"); the failures in suite_cuda_failures.txt" >> "$REPORT"
fi

# 4. The suite on this image's torch, CPU device (issue 16: the oldest release, Python 3.12); last, as
#    CI runs the oldest release on the CPU too.
if wanted cpu; then
    section "make test's selection, CPU device"
    timeout "${CPU_SUITE_S:-150}" $PY -m pytest -v -n "${CPU_WORKERS:-12}" -m "not extended" -p no:cacheprovider \
        > "$OUT/suite_cpu.log" 2>&1
    echo "exit $?" >> "$OUT/suite_cpu.log"
    failures "$OUT/suite_cpu.log" | cut -c1-200 > "$OUT/suite_cpu_failures.txt"
    tail_of "$OUT/suite_cpu.log" 4
    echo "$(outcomes "$OUT/suite_cpu.log"); the failures in suite_cpu_failures.txt" >> "$REPORT"
fi

echo "=== done"
