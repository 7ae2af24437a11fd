#!/usr/bin/env bash
# Mix-LN pre-training of a DeepSeek-MoE-16B / Qwen-MoE-shaped Mixture-of-Experts model (about 16B
# parameters in all, about 2.5B active per token) with stock Megatron-LM. mixln_megatron supports
# megatron-core >=0.17,<0.21; this model's dense first layer (a --moe-layer-freq stack) needs 0.19+:
# a checkout of branch core_r0.19.0 or main.
#
# NNODES nodes x 8 GPUs, EP8 x TP1 x PP1 (the 64 routed experts spread over the 8 GPUs of a node,
# 8 each; every node holds one model replica), data parallel across nodes, alltoall token
# dispatcher, TransformerEngine grouped-GEMM experts, bf16, distributed optimizer.
# Megatron-LM's own pretrain_gpt.py builds the model; Mix-LN comes in through
#   --spec mixln_megatron.spec mixln_layer_spec
# and the MIXLN_* environment (stock Megatron-LM rejects unknown flags; with
# patches/<release>/0001-mixln-cli-flags.patch applied, `--mixln-alpha 0.0625` in MEGATRON_ARGS works too).
# A Post-LN layer with an MoE MLP is y = N(h + MoE(h)); routing and experts are megatron's own
# (docs/configuration.md).
#
# Run the same command on every node, NODE_RANK = 0 .. NNODES-1 (static rendezvous):
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 MEGATRON_LM_DIR=/opt/Megatron-LM \
#   DATA_PATH=/data/c4/c4_en_t5_text_document TOKENIZER_MODEL=/data/tokenizers/t5-base \
#   bash examples/pretrain_moe16b_a2b_mixln.sh
#
# Environment [default]:
#   MEGATRON_LM_DIR       the Megatron-LM checkout whose pretrain_gpt.py runs (required)
#   DATA_PATH             a Megatron indexed dataset, PREFIX of PREFIX.bin / .idx (required)
#   TOKENIZER_MODEL       the tokenizer DATA_PATH was made with (required): a local Hugging Face
#                         tokenizer directory, or a hub name (t5-base), which every rank downloads
#   CHECKPOINT_DIR        saved to and resumed from [/checkpoints/moe16b-mixln]
#   SEQ_LENGTH            [4096]
#   TRAIN_ITERS           [50000]
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
# Settings:
#   model    28 layers, hidden 2048, 16 heads (head dim 128), RMSNorm eps 1e-6, SwiGLU, RoPE,
#            no biases, untied embeddings, sequence length 4096. Layer 1 is dense (FFN 10944);
#            layers 2-28 are MoE: 64 routed experts of FFN 1408, top-6, softmax over all experts
#            before the top-6 (as DeepSeek-MoE and Qwen-MoE route), fp32 router, the GShard /
#            Switch load-balancing aux loss at 1e-3, plus 2 shared experts as one MLP of FFN 2816.
#            With the T5 vocabulary: 16.1B parameters, 2.5B active per token.
#   Mix-LN   alpha = 0.0625: floor(0.0625 * 28) = 1 Post-LN layer (layer 1, the dense one),
#            Pre-LN after. The paper gives alpha 0.25 up to 24 layers (1B) and 0.0625 at 32 (7B);
#            this model is deeper than 24 layers and larger than 1B, so it takes the deep-model
#            value (0.25 would give 7 Post-LN layers, and is refused past 24 layers unless set).
#            For a Post-LN MoE layer as well, MIXLN_POST_LN_LAYERS=2 makes layers 1-2 Post-LN,
#            the 7B count and within the authors' advice of at most 2 Post-LN layers when deep.
#   training the Mix-LN paper's recipe of the 7B launcher, so that norm placements compare on it
#            (the paper has no MoE run): Adam (0.9, 0.999, eps 1e-8), lr 5e-4, cosine decay to 10%
#            of the peak, no weight decay, clipping off, warm-up over 10% of the iterations (the
#            authors' advice with Post-LN layers); global batch 512 sequences of 4096 tokens
#            (2.1M tokens a step), 50k steps (105B tokens): set TRAIN_ITERS for the token budget
#            and keep the 10% warm-up.
#   memory   by estimate (not yet run on a GPU): on one node each GPU holds 8 experts per layer
#            (1.9B parameters) with their full Adam state, and the dense part (1.1B) with its Adam
#            state sharded over the 8 ranks: about 42 GB before activations. More nodes shard the
#            expert optimizer state further. If 80 GB GPUs run out, raise NNODES or recompute
#            (--recompute-granularity selective --recompute-modules moe_act).
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
CHECKPOINT_DIR=${CHECKPOINT_DIR:-/checkpoints/moe16b-mixln}
SEQ_LENGTH=${SEQ_LENGTH:-4096}
TRAIN_ITERS=${TRAIN_ITERS:-50000}

# Mix-LN: 1 of 28 layers Post-LN.
# Another arm of the paper's comparison (a per-layer MIXLN_LAYOUT, see examples/compare_schemes.sh)
# or MIXLN_POST_LN_LAYERS replaces the default alpha; two of them at once are an error.
if [[ -z "${MIXLN_LAYOUT:-}${MIXLN_POST_LN_LAYERS:-}" ]]; then
    export MIXLN_ALPHA=${MIXLN_ALPHA:-0.0625}
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
    # Attention and dense-layer shape
    --num-layers 28
    --hidden-size 2048
    --ffn-hidden-size 10944
    --num-attention-heads 16
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
    # Mixture of Experts: layer 1 dense, layers 2-28 MoE
    --num-experts 64
    --moe-layer-freq "[0]+[1]*27"
    --moe-ffn-hidden-size 1408
    --moe-shared-expert-intermediate-size 2816
    --moe-router-topk 6
    --moe-router-pre-softmax
    --moe-router-dtype fp32
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-3
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    # Mix-LN layers (TransformerEngine modules); settings from MIXLN_ALPHA above
    --spec mixln_megatron.spec mixln_layer_spec
    --transformer-impl transformer_engine
    # Parallelism: EP8 over the node's 8 GPUs, no tensor or pipeline parallelism; the Post-LN
    # layer sits on every rank (PP1).
    --expert-model-parallel-size 8
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
    --bf16
    # Optimisation (the paper's recipe, as the 7B launcher)
    --micro-batch-size 1
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
