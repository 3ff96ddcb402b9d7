#!/usr/bin/env bash
# Issue 6's GPU measurements, cut into phases that each fit one call of the device tool (10 minutes at most,
# about 30 minutes of device time in a session). The machine there has torch, accelerate, transformers and
# tiktoken but neither `datasets` (the training path does not need it) nor ../shared, so the tiktoken files,
# tiny Shakespeare and the HellaSwag rows travel in .carry/ (git-ignored).
#
#   bash bench/gpu_session.sh carry       # here, once: copy ../shared's files into .carry/
#   bash bench/gpu_session.sh 1           # there (device run with carry [".carry"]), then the others
#
#   1  GPT-2 124M, accel_gpt vs the plain loop, compile off; largest micro-batch for 124M
#   2  the same with compile on; HellaSwag over all 10,042 rows (124M, bf16); generation speed
#   3  Accelerate's fp32 output cast A/B; largest micro-batch for 350M
#   4  a short real run end to end: train 124M on tiny Shakespeare (compile, bf16, eval, HellaSwag,
#      checkpoints), resume it, then eval, sample and export from its directory
#   5  largest micro-batch for 774M, without and with activation checkpointing
#   6  compile_mode max-autotune-no-cudagraphs against phase 2's compile-on figure
#
# A phase takes 5 to 9 minutes and a session has about 30 minutes of device time: run 1, 2 and 4 first
# (the issue's targets and the end-to-end check), then 3, 5 and 6 as the time allows.
#
# Every command's output goes to $OUT/phaseN.log (the device tool brings $OUT back), else runs/gpu/. Each
# command has its own time limit, so one that hangs costs its own budget and not the rest of the phase; a
# phase's limits add up to under 600 s, the device tool's limit for one call.
# DRY_RUN_FLAGS (train flags appended in phase 4, e.g. a 2-layer model without compile) checks it on a CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:?usage: bash bench/gpu_session.sh carry|1|2|3|4|5|6}

if [ "$phase" = carry ]; then
    mkdir -p .carry/data
    cp -r ../shared/tiktoken_cache .carry/
    cp ../shared/data/tinyshakespeare.txt ../shared/data/hellaswag_val.jsonl .carry/data/
    du -sh .carry
    exit 0
fi

PY=${PYTHON:-python3}
out=${OUT:-runs/gpu}
mkdir -p "$out"
log="$out/phase$phase.log"
[ -e ../shared ] || ln -s "$PWD/.carry" ../shared  # the bench scripts look for ../shared, as they do here
export TIKTOKEN_CACHE_DIR="$PWD/.carry/tiktoken_cache" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="$PWD/runs/inductor-cache"  # compiled kernels reused by later commands
hellaswag=.carry/data/hellaswag_val.jsonl

step() {  # step SECONDS COMMAND...: run one measurement, logged, under its own limit
    local limit=$1
    shift
    echo "=== $(date +%T) $* (limit ${limit}s)" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    echo "=== exit ${PIPESTATUS[0]}" | tee -a "$log"
}

launch=("$PY" -m accelerate.commands.launch --config_file accelerate_configs/single_gpu.yaml run.py)  # bf16

case $phase in
1)
    step 20 nvidia-smi
    step 30 "$PY" -c "import torch, accelerate, transformers; print(torch.__version__, accelerate.__version__, transformers.__version__, torch.cuda.get_device_name())"
    step 330 "$PY" bench/bench.py --compile off
    step 200 "$PY" bench/bench.py --find_max_batch 124m
    ;;
2)
    step 360 "$PY" bench/bench.py --compile on
    step 150 "$PY" bench/hellaswag_throughput.py --model gpt2-124m --limit 0 --batch_sizes 16,64 --mixed_precision bf16
    step 60 "$PY" bench/sample_throughput.py
    ;;
3)
    step 300 "$PY" bench/ab.py fp32_outputs --compile true --pairs 2 --warmup 3 --steps 10
    step 240 "$PY" bench/bench.py --find_max_batch 350m
    ;;
4)
    run=runs/gpu-train
    rm -rf "$run"
    # tiny Shakespeare as GPT-2 token shards (90/10 split), written with tiktoken alone: `prepare` needs
    # `datasets`, which that machine lacks and the training path does not need
    step 60 "$PY" -c "import sys; sys.path.insert(0, 'bench'); from benchlib import ensure_data; print(*ensure_data(None))"
    # 65,536 tokens per step (one micro-step of 64 x 1024): 100 steps see Shakespeare ~20 times
    train_flags=(--config gpt2-124m --data_dir runs/bench/data-shakespeare --out_dir "$run" --total_batch_size 65536
        --warmup_steps 10 --eval_every 50 --eval_steps 4 --hellaswag "$hellaswag" --hellaswag_every 100
        --hellaswag_limit 2000 --save_every 50 --log_every 10 ${DRY_RUN_FLAGS:-})
    step 240 "${launch[@]}" train "${train_flags[@]}" --max_steps 100
    step 120 "${launch[@]}" train "${train_flags[@]}" --max_steps 120 --resume auto
    step 90 "${launch[@]}" eval --checkpoint "$run" --hellaswag "$hellaswag" --data_dir runs/bench/data-shakespeare
    step 40 "$PY" run.py sample --checkpoint "$run" --prompt "ROMEO:" --max_new_tokens 64 --seed 0
    step 40 "$PY" run.py export --checkpoint "$run" --out_dir runs/gpu-export
    cp "$run/metrics.jsonl" "$out/train_metrics.jsonl" 2>/dev/null
    ;;
5)
    step 270 "$PY" bench/bench.py --find_max_batch 774m
    step 270 "$PY" bench/bench.py --find_max_batch 774m --flags "--activation_checkpointing true"
    ;;
6)
    step 540 "$PY" bench/bench.py --compile on --pairs 1 --flags "--compile_mode max-autotune-no-cudagraphs"
    ;;
*)
    echo "unknown phase $phase: carry or 1 to 6" >&2
    exit 2
    ;;
esac
