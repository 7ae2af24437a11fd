#!/usr/bin/env bash
# A tiny Mix-LN run on CPU (gloo, mock data) through the project's entry point
# mixln_megatron.training.pretrain: Megatron-LM's training loop with the same flags as pretrain_gpt.py,
# plus --mixln-* and --cpu. A development aid (a laptop, CI, debugging a launcher); it trains
# nothing useful.
#
#   bash examples/cpu_tiny_mixln.sh                  # 1 process
#   NPROC=2 TP=2 bash examples/cpu_tiny_mixln.sh     # tensor parallel over 2 gloo processes
#   NPROC=2 PP=2 bash examples/cpu_tiny_mixln.sh     # pipeline parallel
# (A single process also runs without torchrun: python -m mixln_megatron.training.pretrain <same flags>.)
# torchrun is started as `$PYTHON -m torch.distributed.run`, so no activated venv is needed.
#
# Environment [default]:
#   NPROC                 processes [1]
#   TP                    tensor parallel size [1]
#   PP                    pipeline parallel size [1]
#   OUT_DIR               checkpoints go to OUT_DIR/checkpoints [runs/cpu-tiny-mixln]
#   PYTHON                [the checkout's .venv/bin/python (what `make` creates), else python3]
#
# --cpu applies mixln_megatron.cpu.enable_training() and adds the flags a CPU run needs
# (mixln_megatron.cpu.CPU_MEGATRON_FLAGS: --distributed-backend gloo, --transformer-impl local,
# the CUDA-only fusions off). The entry point builds the Mix-LN model itself (local modules here,
# TransformerEngine with --transformer-impl transformer_engine), so no --spec is passed.
# Mix-LN comes from the flag --mixln-alpha, which every rank parses (the entry point reads no
# MIXLN_* variables). Paper settings for real runs: alpha 0.25 up to 1B (24 layers -> 6 Post-LN layers),
# 0.0625 at 7B (32 layers -> 2) with a 10% warm-up; see examples/pretrain_llama1b_mixln.sh and
# examples/pretrain_llama7b_mixln.sh.
set -euo pipefail

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "${REPO_DIR}/.venv/bin/python" ]]; then PYTHON="${REPO_DIR}/.venv/bin/python"; else PYTHON=python3; fi
fi
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
    # CPU: the shims plus gloo, local modules, no CUDA fusions
    --cpu
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
exec "${PYTHON}" -m torch.distributed.run "${TORCHRUN_ARGS[@]}" -m mixln_megatron.training.pretrain "${MEGATRON_ARGS[@]}"
