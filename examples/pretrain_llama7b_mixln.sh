#!/usr/bin/env bash
# Mix-LN pre-training of a LLaMA-7B-shaped model with stock Megatron-LM (a checkout with
# megatron-core >=0.17,<0.21: branch core_r0.17.0, core_r0.18.0 or core_r0.19.0, or main).
#
# NNODES nodes x 8 GPUs, TP2 x PP4 x VPP2 (8 GPUs = one model replica per node), data parallel
# across nodes, TransformerEngine, bf16, distributed optimizer, sequence parallelism.
# Megatron-LM's own pretrain_gpt.py builds the model; Mix-LN comes in through
#   --spec mixln_megatron.spec mixln_layer_spec
# and the MIXLN_* environment (stock Megatron-LM rejects unknown flags; with
# patches/<release>/0001-mixln-cli-flags.patch applied, `--mixln-alpha 0.0625` in MEGATRON_ARGS works too).
#
# Run the same command on every node, NODE_RANK = 0 .. NNODES-1 (static rendezvous):
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 MEGATRON_LM_DIR=/opt/Megatron-LM \
#   DATA_PATH=/data/c4/c4_en_t5_text_document TOKENIZER_MODEL=/data/tokenizers/t5-base \
#   bash examples/pretrain_llama7b_mixln.sh
# On SLURM use examples/slurm_llama7b_mixln.sbatch instead (c10d rendezvous, no NODE_RANK).
#
# Environment [default]:
#   MEGATRON_LM_DIR       the Megatron-LM checkout whose pretrain_gpt.py runs (required)
#   DATA_PATH             a Megatron indexed dataset, PREFIX of PREFIX.bin / .idx (required)
#   TOKENIZER_MODEL       the tokenizer DATA_PATH was made with (required): a local Hugging Face
#                         tokenizer directory, or a hub name (t5-base), which every rank downloads
#   CHECKPOINT_DIR        saved to and resumed from [/checkpoints/llama7b-mixln]
#   SEQ_LENGTH            [256]
#   TRAIN_ITERS           [150000]
#   MIXLN_ALPHA           [0.0625]
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
# Environment on every rank: torchrun starts its workers with the environment of the shell that
# launched it, so the `export MIXLN_*` below reaches every rank of this node; each node runs this
# script, so each node exports the same values. Everything must be identical on all nodes, and the
# mixln_megatron package must be installed on all of them (the NGC container or its venv).
#
# Settings of the paper (Mix-LN, arXiv 2412.13795) and of the authors' 7B reference run:
#   model    LLaMA-7B: 32 layers, hidden 4096, FFN 11008 (SwiGLU), 32 heads, RMSNorm eps 1e-6,
#            RoPE, no biases, untied embeddings; T5 tokenizer (t5-base), C4 data.
#   Mix-LN   alpha = 0.0625: floor(0.0625 * 32) = 2 Post-LN layers (layers 1-2), Pre-LN after.
#            The small-model default alpha 0.25 would give 8 Post-LN layers; the authors needed
#            the smaller fraction at 7B.
#   training sequence length 256, global batch 512 sequences, Adam (0.9, 0.999, eps 1e-8),
#            lr 5e-4, cosine decay to 10% of the peak, no weight decay, bf16, 150k steps with a
#            LONGER warm-up: 10% of the iterations (15k), per the authors, against 1k at <= 1B.
#            Gradient clipping off (the reference Mix-LN scripts pass clipping 0.0).
#   For production-length runs raise SEQ_LENGTH (RoPE) and TRAIN_ITERS; keep the 10% warm-up.
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
CHECKPOINT_DIR=${CHECKPOINT_DIR:-/checkpoints/llama7b-mixln}
SEQ_LENGTH=${SEQ_LENGTH:-256}
TRAIN_ITERS=${TRAIN_ITERS:-150000}

# Mix-LN: 2 of 32 layers Post-LN.
# Another arm of the paper's comparison (a per-layer MIXLN_LAYOUT, see examples/compare_schemes.sh)
# or MIXLN_POST_LN_LAYERS=2 replaces the default alpha; two of them at once are an error.
if [[ -z "${MIXLN_LAYOUT:-}${MIXLN_POST_LN_LAYERS:-}" ]]; then
    export MIXLN_ALPHA=${MIXLN_ALPHA:-0.0625}
fi
# Tensor + sequence parallelism need one CUDA connection before Blackwell (validate_args checks).
export CUDA_DEVICE_MAX_CONNECTIONS=1

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
    # LLaMA-7B shape
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 11008
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
    # Parallelism: TP2 x PP4 x VPP2 per node (8 layers per stage, 4 per virtual stage);
    # the 2 Post-LN layers sit in the first virtual stage of pipeline rank 0.
    --tensor-model-parallel-size 2
    --sequence-parallel
    --pipeline-model-parallel-size 4
    --num-virtual-stages-per-pipeline-rank 2
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
    --bf16
    # Optimisation (paper / reference run)
    --micro-batch-size 4
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
