#!/usr/bin/env bash
# A tiny Mix-LN run on CPU (gloo, mock data) through the project's entry point
# mixln_megatron.pretrain: the same Megatron-LM flags as pretrain_gpt.py plus --mixln-*.
# A development aid (a laptop, CI, debugging a launcher); it trains nothing useful.
#
#   bash examples/cpu_tiny_mixln.sh                  # 1 process
#   NPROC=2 TP=2 bash examples/cpu_tiny_mixln.sh     # tensor parallel over 2 gloo processes
#   NPROC=2 PP=2 bash examples/cpu_tiny_mixln.sh     # pipeline parallel
#
# Mix-LN here comes from the flag --mixln-alpha (the entry point parses it and exports MIXLN_ALPHA
# for every rank) instead of an exported variable. Paper settings for real runs: alpha 0.25 up to
# 1B (24 layers -> 6 Post-LN layers), 0.0625 at 7B (32 layers -> 2) with a 10% warm-up; see
# examples/pretrain_llama1b_mixln.sh and examples/pretrain_llama7b_mixln.sh.
# The CPU-only flags below (gloo, fusions off, local modules) are mixln_megatron.cpu.CPU_MEGATRON_FLAGS.
set -euo pipefail

NPROC=${NPROC:-1}
TP=${TP:-1}
PP=${PP:-1}
OUT_DIR=${OUT_DIR:-runs/cpu-tiny-mixln}

TORCHRUN_ARGS=(
    --standalone
    --nproc-per-node="${NPROC}"
)

MEGATRON_ARGS=(
    # Tiny LLaMA-style model: 8 layers; alpha 0.25 -> layers 1-2 Post-LN, 3-8 Pre-LN
    --num-layers 8
    --hidden-size 64
    --ffn-hidden-size 176
    --num-attention-heads 4
    --seq-length 64
    --max-position-embeddings 64
    --normalization RMSNorm
    --swiglu
    --disable-bias-linear
    --position-embedding-type rope
    --untie-embeddings-and-output-weights
    # Mix-LN
    --mixln-alpha 0.25
    --spec mixln_megatron.spec mixln_local_layer_spec
    # CPU: gloo, no fused CUDA kernels, megatron's local (non-TE) modules
    --distributed-backend gloo
    --no-gradient-accumulation-fusion
    --no-rope-fusion
    --no-persist-layer-norm
    --no-masked-softmax-fusion
    --no-bias-swiglu-fusion
    --transformer-impl local
    --use-cpu-initialization
    # Parallelism
    --tensor-model-parallel-size "${TP}"
    --pipeline-model-parallel-size "${PP}"
    # Optimisation: 10% warm-up, cosine decay
    --micro-batch-size 4
    --global-batch-size 8
    --train-iters 20
    --lr 1e-3
    --min-lr 1e-4
    --lr-decay-style cosine
    --lr-warmup-fraction 0.1
    --weight-decay 0.0
    --clip-grad 1.0
    # Mock data, no tokenizer files
    --mock-data
    --tokenizer-type NullTokenizer
    --vocab-size 128
    --num-workers 0
    # Checkpoints and logging
    --save "${OUT_DIR}/checkpoints"
    --save-interval 10
    --eval-interval 10
    --eval-iters 2
    --log-interval 1
)

mkdir -p "${OUT_DIR}/checkpoints"
exec torchrun "${TORCHRUN_ARGS[@]}" -m mixln_megatron.pretrain "${MEGATRON_ARGS[@]}"
