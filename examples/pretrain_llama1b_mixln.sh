#!/usr/bin/env bash
# Mix-LN pre-training of a LLaMA-1B-shaped model (the authors' 24-layer 1B configuration) with stock
# Megatron-LM (a checkout with megatron-core >=0.17,<0.21: branch core_r0.17.0, core_r0.18.0 or
# core_r0.19.0, or main): one node x 8 GPUs by default, pure data parallelism (the model fits on
# one GPU), TransformerEngine, bf16, distributed optimizer.
# Mix-LN comes in through `--spec mixln_megatron.spec mixln_layer_spec` and the MIXLN_*
# environment (with patches/<release>/0001-mixln-cli-flags.patch applied, `--mixln-alpha 0.25` works too).
#
#   MEGATRON_LM_DIR=/opt/Megatron-LM DATA_PATH=/data/c4/c4_en_t5_text_document \
#   TOKENIZER_MODEL=/data/tokenizers/t5-base bash examples/pretrain_llama1b_mixln.sh
# More nodes: run it on each with NNODES, NODE_RANK (0 .. NNODES-1), MASTER_ADDR set; torchrun
# hands this shell's environment (the MIXLN_* exports below) to every rank it starts.
#
# Environment [default]:
#   MEGATRON_LM_DIR       the Megatron-LM checkout whose pretrain_gpt.py runs (required)
#   DATA_PATH             a Megatron indexed dataset, PREFIX of PREFIX.bin / .idx (required)
#   TOKENIZER_MODEL       the tokenizer DATA_PATH was made with (required): a local Hugging Face
#                         tokenizer directory, or a hub name (t5-base), which every rank downloads
#   CHECKPOINT_DIR        saved to and resumed from [/checkpoints/llama1b-mixln]
#   SEQ_LENGTH            [256]
#   TRAIN_ITERS           [100000]
#   MIXLN_ALPHA           [0.25]
#   MIXLN_POST_LN_LAYERS  instead of MIXLN_ALPHA (at most one of the three)
#   MIXLN_LAYOUT          instead of MIXLN_ALPHA: one arm of examples/compare_schemes.sh
#   NNODES                [1]
#   NODE_RANK             [0]
#   MASTER_ADDR           [localhost]
#   MASTER_PORT           [6000]
#   GPUS_PER_NODE         [8]
#   PYTHON                the interpreter that checks the plugin imports before torchrun [python]
# Resuming: export the same MIXLN_* values (docs/checkpoints.md).
#
# Settings of the paper (Mix-LN, arXiv 2412.13795) and of the authors' 1B reference run:
#   model    24 layers, hidden 2048, FFN 5461 (SwiGLU), 32 heads, RMSNorm eps 1e-6, RoPE,
#            no biases, untied embeddings; T5 tokenizer (t5-base), C4 data.
#   Mix-LN   alpha = 0.25 (the paper's default up to 1B): floor(0.25 * 24) = 6 Post-LN layers.
#   training sequence length 256, global batch 512 sequences, Adam (0.9, 0.999, eps 1e-8),
#            lr 5e-4, cosine decay to 10% of the peak, no weight decay, bf16, 100k steps,
#            gradient clipping off.
#   warm-up  10% of the iterations. The authors' 1B reference script warmed up over 1k of 100k
#            steps (1%); their later advice for models with Post-LN layers is a 10% warm-up (the
#            7B setting), and mixln_megatron warns at model build below that. To reproduce the
#            1B reference run exactly, use --lr-warmup-iters 1000 instead.
#   FFN 5461 cannot be split by tensor parallelism: for TP > 1 round it to a multiple of TP.
set -euo pipefail

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
PYTHON=${PYTHON:-python}

MEGATRON_LM_DIR=${MEGATRON_LM_DIR:?set MEGATRON_LM_DIR to a Megatron-LM checkout with megatron-core >=0.17,<0.21}
DATA_PATH=${DATA_PATH:?set DATA_PATH to a Megatron indexed dataset prefix (Megatron-LM tools/preprocess_data.py or mixln-megatron preprocess)}
TOKENIZER_MODEL=${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the tokenizer DATA_PATH was made with (a local Hugging Face tokenizer directory, or a hub name)}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-/checkpoints/llama1b-mixln}
SEQ_LENGTH=${SEQ_LENGTH:-256}
TRAIN_ITERS=${TRAIN_ITERS:-100000}

# Mix-LN: 6 of 24 layers Post-LN.
# Another arm of the paper's comparison (a per-layer MIXLN_LAYOUT, see examples/compare_schemes.sh)
# or MIXLN_POST_LN_LAYERS=6 replaces the default alpha; two of them at once are an error.
if [[ -z "${MIXLN_LAYOUT:-}${MIXLN_POST_LN_LAYERS:-}" ]]; then
    export MIXLN_ALPHA=${MIXLN_ALPHA:-0.25}
fi

# Megatron-LM 0.19 logs a --spec that fails to import and then trains the stock Pre-LN model
# (unless patches/<release>/0002-fatal-spec-import.patch is applied): fail here instead.
"${PYTHON}" -c 'import mixln_megatron.spec' || {
    echo "mixln_megatron is not importable on $(hostname); install it on every node" >&2
    exit 1
}

TORCHRUN_ARGS=(
    --nnodes="${NNODES}"
    --node-rank="${NODE_RANK}"
    --nproc-per-node="${GPUS_PER_NODE}"
    --master-addr="${MASTER_ADDR}"
    --master-port="${MASTER_PORT}"
)

MEGATRON_ARGS=(
    # LLaMA-1B shape
    --num-layers 24
    --hidden-size 2048
    --ffn-hidden-size 5461
    --num-attention-heads 32
    --seq-length "${SEQ_LENGTH}"
    --max-position-embeddings "${SEQ_LENGTH}"
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --disable-bias-linear
    --position-embedding-type rope
    --untie-embeddings-and-output-weights
    --init-method-std 0.02
    --attention-dropout 0.0
    --hidden-dropout 0.0
    # Mix-LN layers (TransformerEngine modules); settings from MIXLN_ALPHA above
    --spec mixln_megatron.spec mixln_layer_spec
    --transformer-impl transformer_engine
    # Parallelism: data parallel only
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
    --bf16
    # Optimisation (paper / reference run)
    --micro-batch-size 16
    --global-batch-size 512
    --train-iters "${TRAIN_ITERS}"
    --lr 5e-4
    --min-lr 5e-5
    --lr-decay-style cosine
    --lr-warmup-fraction 0.1
    --weight-decay 0.0
    --adam-beta1 0.9
    --adam-beta2 0.999
    --adam-eps 1e-8
    --clip-grad 0.0
    # Data
    --data-path "${DATA_PATH}"
    --split "998,1,1"
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "${TOKENIZER_MODEL}"
    # Checkpoints and logging
    --save "${CHECKPOINT_DIR}"
    --load "${CHECKPOINT_DIR}"
    --ckpt-format torch_dist
    --save-interval 1000
    --eval-interval 1000
    --eval-iters 10
    --log-interval 10
    --tensorboard-dir "${CHECKPOINT_DIR}/tensorboard"
)

exec torchrun "${TORCHRUN_ARGS[@]}" "${MEGATRON_LM_DIR}/pretrain_gpt.py" "${MEGATRON_ARGS[@]}"
