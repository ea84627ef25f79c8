#!/usr/bin/env bash
# The GPU recipes' architectures, random weights, nothing downloaded: a first launch rehearsed on a GPU.
#
#   bash scripts/gpu_check.sh [OUT_DIR] [SECTION ...]      # one NVIDIA GPU; docs/gpu.md
#
# Sections (default: all, in this order); each writes OUT_DIR/<section>.log, and the training ones
# OUT_DIR/<section>.metrics.jsonl:
#   grpo15    configs/qwen2.5-math-1.5b/grpo.yaml, 1.5B at full size: 2 steps of 48 completions
#             (max_new_tokens cut to $GEN tokens), the sample open-rs/MATH-500 rows in the hub's format,
#             evaluation, a checkpoint, then eval.py reloading that checkpoint through from_pretrained
#   micro15   bench/micro_batches.py on the 1.5B: one update of 48 sequences (completions 10-3584
#             tokens), fixed vs token-budget micro-batches: tokens/s, MFU, peak memory, a profile;
#             checkpointing on and off; the 7B's widths at 4 layers
#   rpp7b     configs/qwen2.5-7b-instruct-1m/reinforce_pp.yaml, 7B widths at $LAYERS7 of 28 layers
#             (the full 7B needs 3+ GPUs: train.py --plan), 2 steps of 64 completions on K&K; and
#             the plan of that truncated model beside the measured peak_mem_gib
#   spo15     configs/qwen2.5-math-1.5b/spo_tree.yaml, 1.5B: 1 step of SPO-tree (6-6-6 trees,
#             segments cut to $SEG tokens): the share of the step spent growing trees (mc_gen_s)
#   rollout15 bench/rollout.py on the 1.5B (bf16 autocast): 48 completions (8 prompts x 6) of 512
#             tokens, transformers `generate` vs the static-cache loop (compiled, CUDA graphs):
#             first call, tokens/s, ms per decoding step, peak memory; the compiled sampler checked
#   prm15     (not in the default list) bench/prm_scoring.py: a BERT-base-sized PRM scoring 48 completions
#             x 20 steps batched against one step at a time (steps/s, peak memory)
#   vllm15    (not in the default list; needs vLLM installed) the 1.5B recipe with the vLLM engine in bf16,
#             rollout.sleep on, token TIS, a sync check every step: 3 steps of 48 completions; the
#             metrics hold sync_gap_*, engine_gap_*, tis_*, weight_sync_s (docs/gpu.md, the vLLM list)
# Random weights never emit end-of-sequence, so every completion runs to max_new_tokens: the
# lengths are the worst case, the rewards are 0. The engine is vLLM where it is installed, else
# transformers `generate` (--rollout.engine=hf forced by ENGINE=hf).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_check}; shift || true
SECTIONS=${*:-grpo15 micro15 rpp7b spo15 rollout15}
PY=${PYTHON:-python3}
MODELS=${MODELS:-/tmp/pspo-gpu-models}
GEN=${GEN:-512}; LAYERS7=${LAYERS7:-6}; SEG=${SEG:-64}; ENGINE=${ENGINE:-auto}
SIZE=${SIZE:-full}     # SIZE=small: the CPU stand-ins' widths, to rehearse this script without a GPU
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT" "$MODELS"

model() {   # model NAME CONFIG [LAYERS]: build a random full-width model once
  local full=--full; [ "$SIZE" = full ] || full=
  [ -d "$MODELS/$1-$SIZE" ] || $PY -m pspo.offline.standin "$2" "$MODELS/$1-$SIZE" $full ${3:+--layers $3} || exit 1
}
train() {   # train SECTION CONFIG OVERRIDES...: torchrun with one process, metrics copied to OUT
  local name=$1 config=$2; shift 2
  local run=/tmp/pspo-gpu-runs/$name
  rm -rf "$run"
  torchrun --standalone --nproc_per_node=1 train.py --config "$config" --train.output_dir="$run" \
    --rollout.engine=$ENGINE "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  cp "$run/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
  echo "[$name] train.py exit code $rc" | tee -a "$OUT/$name.log"
  return $rc
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__)"
  $PY -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null || echo "vllm: not installed (engine: transformers)"
} 2>&1 | tee "$OUT/env.log"

for section in $SECTIONS; do
  start=$(date +%s)
  case $section in
    grpo15)
      model qwen15 configs/qwen2.5-math-1.5b/model_config.json
      train grpo15 configs/qwen2.5-math-1.5b/grpo.yaml --model.name_or_path="$MODELS/qwen15-$SIZE" \
        --data.train=data/samples/open-rs.jsonl --data.eval=data/samples/math500.jsonl \
        --data.max_eval_examples=8 --rollout.max_new_tokens="$GEN" --train.max_steps=2 --train.save_steps=2 \
        && $PY eval.py --config configs/qwen2.5-math-1.5b/grpo.yaml --rollout.engine=$ENGINE \
             --model.name_or_path=/tmp/pspo-gpu-runs/grpo15/checkpoint-2 --data.eval=data/samples/math500.jsonl \
             --data.max_eval_examples=8 --rollout.max_new_tokens=64 2>&1 | tee -a "$OUT/grpo15.log" ;;
    micro15)
      SMALL_UPDATE="--layers 1 --sequences 6 --max-completion 64 --budget 0 --reps 1"     # SIZE=small
      # the 1.5B recipe's update (token budget 36864, checkpointing) with a profile; checkpointing off at
      # the budget the plan fits without it (8192); the 7B's widths at 4 layers with its recipe's budget
      $PY bench/micro_batches.py --arch configs/qwen2.5-math-1.5b/model_config.json --sequences 48 --micro 4 \
        --max-completion 3584 --max-prompt 512 --bf16 --checkpointing --budget 36864 --profile --reps 2 \
        $([ "$SIZE" = full ] || echo $SMALL_UPDATE) 2>&1 | tee "$OUT/micro15.log"
      $PY bench/micro_batches.py --arch configs/qwen2.5-math-1.5b/model_config.json --sequences 48 --micro 2 \
        --max-completion 3584 --max-prompt 512 --bf16 --budget 8192 --reps 2 \
        $([ "$SIZE" = full ] || echo $SMALL_UPDATE) 2>&1 | tee -a "$OUT/micro15.log"
      [ "$SIZE" != full ] || $PY bench/micro_batches.py --arch configs/qwen2.5-7b-instruct-1m/model_config.json \
        --layers 4 --sequences 32 --micro 4 --max-completion 4096 --max-prompt 512 --bf16 --checkpointing \
        --budget 36864 --profile --reps 2 2>&1 | tee -a "$OUT/micro15.log" ;;
    rpp7b)
      model "qwen7b-$LAYERS7" configs/qwen2.5-7b-instruct-1m/model_config.json "$LAYERS7"
      train rpp7b configs/qwen2.5-7b-instruct-1m/reinforce_pp.yaml --model.name_or_path="$MODELS/qwen7b-$LAYERS7-$SIZE" \
        --data.eval= --rollout.max_new_tokens="$GEN" --train.max_steps=2 --train.save_steps=0
      $PY train.py --config configs/qwen2.5-7b-instruct-1m/reinforce_pp.yaml --plan --gpus=1 \
        --gpu_gib="$($PY -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory / 2**30)' || echo 80)" \
        --model.name_or_path="$MODELS/qwen7b-$LAYERS7-$SIZE" --rollout.max_new_tokens="$GEN" --rollout.engine=$ENGINE \
        2>&1 | tee -a "$OUT/rpp7b.log" ;;
    spo15)
      model qwen15 configs/qwen2.5-math-1.5b/model_config.json
      train spo15 configs/qwen2.5-math-1.5b/spo_tree.yaml --model.name_or_path="$MODELS/qwen15-$SIZE" \
        --data.train=data/samples/open-rs.jsonl --data.eval= --train.prompts_per_step=2 \
        --spo.segment_tokens="$SEG" --rollout.max_new_tokens="$GEN" --train.max_steps=1 --train.save_steps=0 ;;
    vllm15)    # the vLLM-on-GPU calls CPU cannot run (sleep, bf16, memory share); tol 1: log the gap, do not stop
      model qwen15 configs/qwen2.5-math-1.5b/model_config.json
      train vllm15 configs/qwen2.5-math-1.5b/grpo.yaml --model.name_or_path="$MODELS/qwen15-$SIZE" \
        --rollout.engine=vllm --rollout.sleep=true --rollout.is_correction=token --rollout.sync_check_steps=1 \
        --rollout.sync_check_tol=1 --data.train=data/samples/open-rs.jsonl --data.eval= \
        --rollout.max_new_tokens="$GEN" --train.max_steps=3 --train.save_steps=0 ;;
    rollout15)
      $PY bench/rollout.py --arch configs/qwen2.5-math-1.5b/model_config.json --prompts 8 --n 6 \
        --max-new-tokens 512 --bf16 --repeats 3 \
        $([ "$SIZE" = full ] || echo --layers 1 --max-new-tokens 16 --repeats 1) 2>&1 | tee "$OUT/rollout15.log" ;;
    prm15)
      $PY bench/prm_scoring.py $([ "$SIZE" = full ] || echo --small --completions 8 --steps 5) 2>&1 \
        | tee "$OUT/prm15.log" ;;
    *) echo "unknown section $section (grpo15 micro15 rpp7b spo15 rollout15 vllm15 prm15)" >&2; exit 2 ;;
  esac
  rm -rf "/tmp/pspo-gpu-runs/$section"                  # checkpoints of a 1.5B or 7B model fill a disk
  echo "[$section] $(( $(date +%s) - start )) s" | tee -a "$OUT/times.log"
done
