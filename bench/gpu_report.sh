#!/usr/bin/env bash
# One prepared run for a lent GPU machine (the `device` tool; 15 minutes a session, 10 a command):
# the checks in priority order, each bounded by its own timeout, the report written as it goes so
# that a run cut short still returns what it finished.
#   bash bench/gpu_report.sh [OUT]      (OUT defaults to $OUT, then ./out)
#   SECTIONS="cuda bench breakdown worker varlen hf cpu" (the default: all, in this order) picks sections;
#   WORKLOADS="demo gpu-bert-base-mlm ..." the bench's workloads, AUTOCASTS="none bf16" its dtypes,
#   MODES the bench's modes (default: eager, torch.compile and fxtrain's three executors; the demo adds
#   torch.compile's CUDA-graph mode, compile:reduce-overhead).
# OUT gets two files, rewritten after each section: report.md and gpu_report.tgz (every log, JSON
# and traceback; the device tool returns at most 8 files). The work folder is $WORK (/tmp/gpu_report).
# Timings of 2026-11-29 on an H200 (torch 2.11): the CUDA suite ~230 s on 8 workers; the demo's bench
# ~60 s per dtype; a GPU-sized workload's bench 60-90 s for three modes, two of them compiling
# (fxtrain's inductor tier compiles for ~45 s on the first step, torch.compile ~25 s).
# The machine's image has its own torch (2.11 on Python 3.12 when this was written) and no package
# registry: fxtrain is used from this checkout (PYTHONPATH), with the image's packages.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-out}}
WORK=${WORK:-/tmp/gpu_report}
mkdir -p "$OUT" "$WORK"
REPORT=$WORK/report.md
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
# `fxtrain` as a command beside the interpreter, where an installed console script would be
# (tests/test_cli.py runs it from there); on PATH elsewhere when that folder is not writable.
BIN=$(dirname "$($PY -c 'import sys; print(sys.executable)')")
if [ ! -e "$BIN/fxtrain" ]; then
    [ -w "$BIN" ] || { BIN=/tmp/fxtrain-bin; mkdir -p "$BIN"; export PATH=$BIN:$PATH; }
    printf '#!/bin/sh\nexec %s -m fxtrain.cli "$@"\n' "$(command -v $PY)" > "$BIN/fxtrain"
    chmod +x "$BIN/fxtrain"
fi
pack() { cp "$REPORT" "$OUT/report.md"; tar czf "$OUT/gpu_report.tgz" -C "$WORK" .; }

wanted() { [[ " ${SECTIONS:-cuda bench breakdown worker varlen hf cpu} " == *" $1 "* ]]; }
section() { [ -e "$REPORT" ] && pack; printf '\n## %s (%s)\n\n' "$1" "$(date -u +%H:%M:%S)" >> "$REPORT"; echo "=== $1"; }
tail_of() { printf '```\n%s\n```\n' "$(tail -n "${2:-15}" "$1")" >> "$REPORT"; }
# Suites run with -v: each test's outcome is a line of the log as it ends, so a run the timeout cuts
# short still names every failure so far (-q prints them only in the summary it never reaches).
# Their tracebacks go to a --failure-log file as each test fails (tests/conftest.py).
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

# 1. The suite with FXTRAIN_TEST_DEVICE=cuda (issue 17 makes every test honour it): first, as its
#    failures need the most work between device sessions and their tracebacks say where.
if wanted cuda; then
    section "make test's selection, FXTRAIN_TEST_DEVICE=cuda"
    FXTRAIN_TEST_DEVICE=cuda timeout "${CUDA_SUITE_S:-280}" $PY -m pytest -v -n "${CUDA_WORKERS:-8}" -m "not extended" \
        -p no:cacheprovider --durations=20 --failure-log "$WORK/suite_cuda_tracebacks.txt" > "$WORK/suite_cuda.log" 2>&1
    echo "exit $?" >> "$WORK/suite_cuda.log"
    failures "$WORK/suite_cuda.log" | cut -c1-200 > "$WORK/suite_cuda_failures.txt"
    tail_of "$WORK/suite_cuda.log" 4
    echo "$(outcomes "$WORK/suite_cuda.log"); the failures in suite_cuda_failures.txt, their tracebacks in" \
         "suite_cuda_tracebacks.txt" >> "$REPORT"
fi

# 2. The bench (WORKLOADS="demo gpu-bert-base-mlm ..."), in float32 and under bf16 autocast: eager,
#    torch.compile and fxtrain's executors, interleaved, fxtrain:auto after its background compile
#    (--await-compiles: the steady state a training run reaches). The table and the JSON carry each
#    mode's ops and kernels per step and fxtrain's pass decisions (the launch-cost model of
#    cost/launches.py turns a pass off where its launches cost more than its FLOPs).
if wanted bench; then
    for workload in ${WORKLOADS:-demo}; do
        for autocast in ${AUTOCASTS:-none bf16}; do
            section "fxtrain bench --workload $workload --device cuda, autocast $autocast"
            ac=(); [ "$autocast" != none ] && ac=(--autocast "$autocast")
            limit=${BENCH_S:-$([ "$workload" = demo ] && echo 120 || echo 200)}
            log=$WORK/bench_${workload}_$autocast.log
            # The demo's step is bound by the host (8 ms of host work for ~3.5 ms of device work on an
            # H200): torch.compile's CUDA-graph mode beside its default says what CUDA graphs would
            # give fxtrain's compiled tier there (issue 17: measure before building them).
            modes=${MODES:-eager,compile,fxtrain:eager,fxtrain:inductor,fxtrain:auto}
            [ -z "${MODES:-}" ] && [ "$workload" = demo ] && modes=eager,compile,compile:reduce-overhead,fxtrain:eager,fxtrain:inductor,fxtrain:auto
            timeout "$limit" $PY -m fxtrain.cli bench --workload "$workload" --device cuda --no-progress \
                --await-compiles ${ac[@]+"${ac[@]}"} \
                --modes "$modes" \
                --json "$WORK/bench_${workload}_$autocast.json" > "$log" 2>&1
            echo "exit $?" >> "$log"
            tail_of "$log" 24
        done
    done
fi

# 3. Where a GPU-sized step's time goes (bench/step_breakdown.py): device busy share, syncs, and the
#    kernels that fill the device, the ops the host dispatches, torch.compile against fxtrain's compiled step (issue 17: BERT-base
#    MLM ran ~1.05x torch.compile at 2.6x fewer FLOPs).
if wanted breakdown; then
    section "step breakdown: ${BREAKDOWN_WORKLOAD:-gpu-bert-base-mlm}, bf16 autocast"
    timeout "${BREAKDOWN_S:-200}" $PY bench/step_breakdown.py --workload "${BREAKDOWN_WORKLOAD:-gpu-bert-base-mlm}" \
        --device cuda --autocast bf16 --modes "${BREAKDOWN_MODES:-eager,dynamo,compile,fxtrain:inductor}" \
        --json "$WORK/breakdown.json" > "$WORK/breakdown.log" 2>&1
    echo "exit $?" >> "$WORK/breakdown.log"
    cat "$WORK/breakdown.log" >> "$REPORT"
fi

# 4. The tier's background compile on the GPU: the worker's device and GPU memory (issue 17).
if wanted worker; then
    section "the compiled tier's worker on the GPU (bench/worker_gpu_memory.py)"
    timeout "${WORKER_S:-90}" $PY bench/worker_gpu_memory.py --json "$WORK/worker_gpu_memory.json" \
        > "$WORK/worker_gpu_memory.log" 2>&1
    echo "exit $?" >> "$WORK/worker_gpu_memory.log"
    tail_of "$WORK/worker_gpu_memory.log" 14
fi

# 5. The CUDA attention routes (one variable-length kernel call per direction: flash for fp16/bf16
#    on sm80+, memory-efficient for fp32) and the passes that use them: a subset of 1, for a rerun.
if wanted varlen; then
    section "varlen attention and the passes over it, FXTRAIN_TEST_DEVICE=cuda"
    FXTRAIN_TEST_DEVICE=cuda timeout "${VARLEN_S:-100}" $PY -m pytest -v -n 4 -p no:cacheprovider -m "not extended" \
        --failure-log "$WORK/varlen_cuda_tracebacks.txt" tests/test_varlen_route.py tests/test_varlen_attention.py \
        tests/test_padding_elimination.py tests/test_packed_batches.py > "$WORK/varlen_cuda.log" 2>&1
    echo "exit $?" >> "$WORK/varlen_cuda.log"
    failures "$WORK/varlen_cuda.log" | cut -c1-200 >> "$REPORT"
    outcomes "$WORK/varlen_cuda.log" >> "$REPORT"
    tail_of "$WORK/varlen_cuda.log" 4
fi

# 6. Current HF families that padding elimination reaches (bench/hf_families.py --speed, float32
#    then bf16 autocast, 16 x 128 at 50% padding): on the CPU 2.1-2.4x eager (Mixtral: its experts
#    on real tokens too; Gemma 2 and gpt-oss: attention in eager ops, re-padded around); whether
#    the GPU keeps any of it. Then plain attention in eager ops at 4 x 1024.
if wanted hf; then
    section "HF families, bench/hf_families.py --speed --device cuda (float32, then --autocast bf16)"
    timeout "${HF_S:-120}" $PY bench/hf_families.py --speed "${HF_FAMILIES:-Qwen3,Mixtral,Gemma4,Gemma2,GptOss,GPTNeoX}" --device cuda \
        > "$WORK/hf_speed.log" 2>&1
    echo "exit $?" >> "$WORK/hf_speed.log"
    timeout "${HF_S:-120}" $PY bench/hf_families.py --speed "${HF_FAMILIES:-Qwen3,Mixtral,Gemma4,Gemma2,GptOss,GPTNeoX}" --device cuda \
        --autocast bf16 >> "$WORK/hf_speed.log" 2>&1
    echo "exit $?" >> "$WORK/hf_speed.log"
    # Attention in eager ops that is plain (GPT-J; Llama set to eager) runs as one varlen call per
    # layer and direction: at 4 x 1024 on the CPU 3.6-4.1x eager, 1.4x before (docs/benchmarks.md).
    timeout "${HF_S:-120}" $PY bench/hf_families.py --speed GPTJ,Llama --attention eager --shape 4x1024 --device cuda \
        --autocast bf16 >> "$WORK/hf_speed.log" 2>&1
    echo "exit $?" >> "$WORK/hf_speed.log"
    grep -E "eager|exit|Error" "$WORK/hf_speed.log" | cut -c1-240 >> "$REPORT"
fi

# 7. The suite on this image's torch, CPU device (issue 16: the oldest release, Python 3.12); last, as
#    CI runs the oldest release on the CPU too.
if wanted cpu; then
    section "make test's selection, CPU device"
    timeout "${CPU_SUITE_S:-150}" $PY -m pytest -v -n "${CPU_WORKERS:-12}" -m "not extended" -p no:cacheprovider \
        --failure-log "$WORK/suite_cpu_tracebacks.txt" > "$WORK/suite_cpu.log" 2>&1
    echo "exit $?" >> "$WORK/suite_cpu.log"
    failures "$WORK/suite_cpu.log" | cut -c1-200 > "$WORK/suite_cpu_failures.txt"
    tail_of "$WORK/suite_cpu.log" 4
    echo "$(outcomes "$WORK/suite_cpu.log"); the failures in suite_cpu_failures.txt" >> "$REPORT"
fi

pack
echo "=== done"
