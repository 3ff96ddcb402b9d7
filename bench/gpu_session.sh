#!/usr/bin/env bash
# The GPU measurements of bench/, sized for a lease of 15 minutes of device time in all (the machine's start, 1-2
# minutes, every call and every idle second count): phases 1 and 2 are two device-tool calls, the second made at
# once on the still-warm machine (it goes back 30 s after a call), then give_back; 15 minutes with a 2-minute start
# and every command at its limit, about 11 expected. Phases 3 and 4 are for device time beyond that (a later lease). That machine has
# torch, accelerate, transformers and tiktoken, but not `datasets` (training, eval, sample and export do not need
# it), no installed accel_gpt (PYTHONPATH is this checkout) and no files of ours: the tiktoken files, the HellaSwag
# rows, a text to train on and the peers travel in the git-ignored .carry/ folder.
#
#   bash bench/gpu_session.sh carry HELLASWAG_JSONL TEXT PEERS   # here, once: $TIKTOKEN_CACHE_DIR and files -> .carry/
#   bash bench/gpu_session.sh 1       # there: device run, carry [".carry"], timeout_s 430; then 2 (timeout_s 350)
#   DRY_RUN=1 OUT=/tmp/dry bash bench/gpu_session.sh 1       # rehearsal on a CPU: the same commands at tiny sizes
#
#   1  GPT-2 124M against llm.c's PyTorch trainer and nanoGPT (bench/peers.py; PEERS is a folder holding them,
#      not part of this repo), same tokens, then accel_gpt with Muon + AdamW (gpt2-124m-muon's optimizer: its cost
#      per step) and the gpt2-124m-nanochat preset (the nanochat block with Muon: its cost per step); five runs of
#      at most 76 s (start, compile, 16 steps of 524,288 tokens)
#   2  end to end in bf16: train 124M, SIGKILL it between checkpoints, resume to the end (the steps run twice must
#      give the same losses); eval with all 10,042 HellaSwag rows (target: under 60 s, start-up included), sample,
#      export, transformers reads the export. Its compiles reuse phase 1's kernels (one inductor cache folder).
#   3  two A/Bs of accel_gpt (the chunked LM-head loss, cuDNN attention); HellaSwag's scoring rate at two batch
#      sizes; FSDP (fsdp.yaml, one process): a gpt2-medium-wide model stopped by SIGTERM after its first checkpoint
#      (the graceful stop, which saves), resumed to the end, its last checkpoint's gathered weights checked, exported
#   4  the largest micro-batch for 124M, 350M and 774M
#
# Every command runs under its own `timeout -s KILL` (it kills the command's whole process group: launcher,
# trainer, compile workers), so one that hangs costs its own limit, not the phase; a phase's limits add up to
# less than its call's timeout_s. Output goes to $OUT/phaseN.log as it comes (the device tool brings $OUT back,
# after a timeout too; at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:?usage: bash bench/gpu_session.sh carry HELLASWAG_JSONL TEXT PEERS | 1 | 2 | 3 | 4}

if [ "$phase" = carry ]; then
    hellaswag_src=${2:?carry needs the HellaSwag validation jsonl (10,042 rows)}
    [ -d "${TIKTOKEN_CACHE_DIR:-}" ] || { echo "set TIKTOKEN_CACHE_DIR to tiktoken's cache folder" >&2; exit 2; }
    rm -rf .carry && mkdir -p .carry/data
    cp -r "$TIKTOKEN_CACHE_DIR" .carry/tiktoken_cache
    cp "$hellaswag_src" .carry/data/hellaswag_val.jsonl
    if [ -n "${3:-}" ]; then cp "$3" .carry/data/text.txt; fi
    if [ -n "${4:-}" ]; then cp -r "$4" .carry/peers; fi
    du -sh .carry
    exit 0
fi

PY=${PYTHON:-python3}
out=${OUT:-runs/gpu}
mkdir -p "$out"
log="$out/phase$phase.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ -d .carry/tiktoken_cache ]; then export TIKTOKEN_CACHE_DIR="$PWD/.carry/tiktoken_cache"; fi
hellaswag=.carry/data/hellaswag_val.jsonl
[ -f "$hellaswag" ] || hellaswag=tests/data/hellaswag_val.jsonl
text=.carry/data/text.txt
[ -f "$text" ] || text=tests/data/tinyshakespeare.txt
launch=("$PY" -m accelerate.commands.launch --config_file accelerate_configs/single_gpu.yaml run.py)  # bf16
data=$("$PY" bench/benchlib.py --text "$text")  # GPT-2 tokens written with tiktoken alone (no `datasets`)

export TORCHINDUCTOR_CACHE_DIR="$PWD/runs/inductor-cache"  # one cache for every phase: later compiles reuse kernels

muon=(--variant muon='--optimizer muon --muon_weight_decay 0.01'  # gpt2-124m-muon's optimizer
    --variant nanochat='--config gpt2-124m-nanochat --hellaswag_every 0')  # peers.py's flags (shape, steps) win
if [ -n "${DRY_RUN:-}" ]; then  # the same commands at sizes a CPU runs in seconds
    peers=(--steps 3 --warmup 1 --timeout 100)
    ab=(--variant chunk='--loss_chunk 256')
    tiny=(--flags "--n_layer 1 --n_head 1 --n_embd 16 --seq_len 16")
    model=(--model tiny-cpu)
    e2e=(--n_layer 2 --n_head 4 --n_embd 64 --seq_len 64 --micro_batch_size 4 --total_batch_size 256 --compile false
        --eval_windows 8 --hellaswag_limit 20)
    fsdp_e2e=(--n_layer 2 --n_head 4 --n_embd 64 --seq_len 64 --micro_batch_size 4 --total_batch_size 512)  # refused
    limit=(--limit 20)
    resume_limit=150  # bf16 emulated on a CPU without bf16 units: 2.2 s a step, 40 steps past the checkpoint
else
    tiny=() model=() e2e=() limit=() fsdp_e2e=()
    resume_limit=85
    peers=(--steps 16 --warmup 5 --timeout 76)
    ab=(--variant chunk='--loss_chunk 16384' --variant cudnn='--attention_backend cudnn')
fi

step() {  # step SECONDS COMMAND...: one command under its own limit, its output appended to the log as it comes
    local limit=$1 started=$SECONDS
    shift
    echo "=== $(date +%T) $* (limit ${limit}s)" | tee -a "$log"
    timeout -s KILL "$limit" "$@" 2>&1 | tee -a "$log"
    echo "=== exit ${PIPESTATUS[0]} after $((SECONDS - started)) s" | tee -a "$log"
}

last_step() {  # the newest step in a run's metrics.jsonl, 0 before its first
    local row
    row=$(tail -n 1 "$1/metrics.jsonl" 2>/dev/null)
    [[ $row =~ \"step\":\ ([0-9]+) ]] && echo "${BASH_REMATCH[1]}" || echo 0
}

case $phase in
1)
    if command -v nvidia-smi >/dev/null; then step 10 nvidia-smi; fi
    step 20 "$PY" -c "import importlib.util, torch, accelerate, transformers, tiktoken
print('torch', torch.__version__, 'accelerate', accelerate.__version__, 'transformers', transformers.__version__)
print('datasets importable:', importlib.util.find_spec('datasets') is not None)
print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')
from accel_gpt.precision import Workload, choose_compile, choose_mixed_precision, detect
device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
auto = choose_mixed_precision('auto', None, detect(device), 768)  # what a run with no precision flag picks here
print('auto precision for GPT-2 124M:', auto)  # expected on an H100: bf16 (auto: bf16 matrix units)
for steps in (50, 19073):  # a smoke run, and the preset's 10B tokens: compile expected for the second only
    work = Workload(steps, 524288 * 6 * 124e6, 12)
    print(f'auto compile, {steps} steps:', choose_compile('auto', detect(device), auto.value, work))"
    # five runs, each appended to peers.jsonl as it ends: past a run's limit only that run is lost
    step 390 "$PY" bench/peers.py --peers .carry/peers --data_dir "$data" --out "$out/peers.jsonl" "${peers[@]}" \
        "${muon[@]}"
    ;;
2)
    run=runs/gpu-e2e
    rm -rf "$run" runs/gpu-export
    # 65,536 tokens per step (one micro-step of 64 x 1024), evaluation, HellaSwag and a checkpoint along the way
    train=(train --config gpt2-124m --data_dir "$data" --out_dir "$run" --total_batch_size 65536 --max_steps 60
        --warmup_steps 10 --eval_every 20 --eval_windows 256 --hellaswag "$hellaswag" --hellaswag_every 30
        --hellaswag_limit 500 --save_every 20 --log_every 1 "${e2e[@]}")
    echo "=== $(date +%T) ${launch[*]} ${train[*]}, SIGKILL at a step past its first checkpoint" | tee -a "$log"
    timeout -s KILL 100 "${launch[@]}" "${train[@]}" >>"$log" 2>&1 &
    pid=$!  # timeout leads its own process group: killing the group kills launcher and trainer
    until [ "$(last_step "$run")" -ge 25 ] || ! kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
    kill -KILL -- -"$pid" 2>/dev/null
    wait "$pid"
    killed=$?
    cp "$run/metrics.jsonl" "$out/e2e_killed_metrics.jsonl" 2>/dev/null
    newest=$(ls -d "$run"/checkpoints/step_*/COMPLETE 2>/dev/null | tail -n 1)
    [[ $newest =~ step_0*([0-9]+) ]] && from=${BASH_REMATCH[1]} || from=0
    printf '\n=== killed (exit %s) at step %s; checkpoints: %s; resumes from step %s\n' "$killed" \
        "$(last_step "$run")" "$(ls "$run/checkpoints" 2>/dev/null | xargs)" "$from" | tee -a "$log"
    step "$resume_limit" "${launch[@]}" "${train[@]}" --resume auto
    cp "$run/metrics.jsonl" "$out/e2e_metrics.jsonl" 2>/dev/null
    # the resumed run redid the steps after its checkpoint: the first one's loss is the restored weights' and data
    # order's (forward only: exact resume means equal); later ones can part by the GPU's non-deterministic backward
    step 5 "$PY" -c "from accel_gpt.metrics import read_metrics
killed = {r['step']: r['loss'] for r in read_metrics('$out/e2e_killed_metrics.jsonl')}
rows = read_metrics('$run/metrics.jsonl')
steps = [r['step'] for r in rows]
assert steps == list(range(1, steps[-1] + 1)) and steps[-1] == 60, steps
redone = [(r['step'], killed[r['step']], r['loss']) for r in rows if $from < r['step'] <= max(killed)]
print('metrics.jsonl: steps 1..60, each once; steps run twice (step, loss killed, loss resumed):')
for s, a, b in redone:
    print(f'  {s:3d} {a!r:>22} {b!r:>22}', 'same' if a == b else f'differ by {b - a:+.3g}')"
    step 80 "${launch[@]}" eval --checkpoint "$run" --hellaswag "$hellaswag" --data_dir "$data" --batch_size 32 \
        "${limit[@]}"
    step 25 "$PY" run.py sample --checkpoint "$run" --prompt "ROMEO:" --max_new_tokens 64 --seed 0
    step 30 "$PY" run.py export --checkpoint "$run" --out_dir runs/gpu-export
    step 20 "$PY" -c "from transformers import AutoTokenizer, GPT2LMHeadModel
model, tok = GPT2LMHeadModel.from_pretrained('runs/gpu-export'), AutoTokenizer.from_pretrained('runs/gpu-export')
ids = model.generate(**tok('ROMEO:', return_tensors='pt'), max_new_tokens=16, do_sample=False)
print('transformers reads the export:', repr(tok.decode(ids[0])))"
    ;;
3)
    step 200 "$PY" bench/peers.py --peers .carry/peers --data_dir "$data" --out "$out/peers_ab.jsonl" "${peers[@]}" \
        --sides accel_gpt "${ab[@]}"
    step 120 "$PY" bench/generate_throughput.py --what hellaswag --hellaswag "$hellaswag" --batch_sizes 16,64 \
        --rounds 1 "${model[@]}" "${limit[@]}"

    # FSDP2 on one GPU (the code paths of 8: sharded checkpoints, DTensor gradients, the gathered weights), eager,
    # 32,768 tokens per step in 2 micro-steps, activation checkpointing; the width and heads of gpt2-medium, 6 layers.
    frun=runs/gpu-fsdp
    rm -rf "$frun" runs/gpu-fsdp-export
    fsdp=("$PY" -m accelerate.commands.launch --config_file accelerate_configs/fsdp.yaml --num_processes 1 run.py)
    ftrain=(train --config gpt2-medium --n_layer 6 --data_dir "$data" --out_dir "$frun" --total_batch_size 32768
        --micro_batch_size 16 --max_steps 20 --warmup_steps 5 --eval_every 10 --eval_windows 32 --hellaswag "$hellaswag"
        --hellaswag_every 10 --hellaswag_limit 200 --save_every 10 --log_every 5 --compile false
        --activation_checkpointing true "${fsdp_e2e[@]}")
    echo "=== $(date +%T) ${fsdp[*]} ${ftrain[*]}, SIGTERM to its worker after its first checkpoint" | tee -a "$log"
    timeout -s KILL 70 "${fsdp[@]}" "${ftrain[@]}" >>"$log" 2>&1 &
    pid=$!
    until ls "$frun"/checkpoints/step_*/COMPLETE >/dev/null 2>&1 || ! kill -0 "$pid" 2>/dev/null; do sleep 1; done
    launcher=$(pgrep -P "$pid")  # timeout -> accelerate launch (torchrun in-process) -> the worker
    workers=$(for l in $launcher; do pgrep -P "$l"; done)
    for w in $workers; do kill -TERM "$w" 2>/dev/null; done  # finishes its step, saves, exits 0
    wait "$pid"
    stopped=$?
    printf '\n=== stopped (exit %s, SIGTERM to %s); checkpoints: %s\n' "$stopped" "$(echo $workers)" \
        "$(ls "$frun/checkpoints" 2>/dev/null | xargs)" | tee -a "$log"
    newest=$(ls -d "$frun"/checkpoints/step_* 2>/dev/null | tail -n 1)
    echo "=== $newest holds: $(ls -A "$newest" 2>/dev/null | xargs)" | tee -a "$log"
    step 70 "${fsdp[@]}" "${ftrain[@]}" --resume auto
    step 45 "$PY" -c "import torch
from accel_gpt.checkpoint import complete_checkpoints
from accel_gpt.export import export
from accel_gpt.metrics import read_metrics
from accel_gpt.weights import load_model
steps = [r['step'] for r in read_metrics('$frun/metrics.jsonl')]
assert steps == list(range(1, 21)), steps
ckpt = complete_checkpoints('$frun')[-1]
a, b = load_model(ckpt)[0].state_dict(), load_model('$frun')[0].state_dict()
assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), 'the checkpoint is not the final weights'
print('metrics.jsonl: steps 1..20, each once;', ckpt.name, 'holds the final weights, gathered')
print('exported', export(ckpt, 'runs/gpu-fsdp-export'))"
    cp "$frun/metrics.jsonl" "$out/fsdp_metrics.jsonl" 2>/dev/null
    ;;
4)
    step 110 "$PY" bench/train_throughput.py --find_max_batch 124m "${tiny[@]}"
    step 150 "$PY" bench/train_throughput.py --find_max_batch 350m "${tiny[@]}"
    step 170 "$PY" bench/train_throughput.py --find_max_batch 774m "${tiny[@]}"
    ;;
*)
    echo "unknown phase $phase: carry, 1, 2, 3 or 4" >&2
    exit 2
    ;;
esac
