#!/usr/bin/env bash
# The Mix-LN paper's comparison at scale: one arm per run, every arm on the same model, data,
# seed, steps and parallel layout, through the 1B, 7B or MoE-16B launcher beside this script.
#
#   ARM=mix_deepnorm MODEL=1b NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 \
#   MEGATRON_LM_DIR=/opt/Megatron-LM DATA_PATH=/data/c4/c4_en_t5_text_document \
#   TOKENIZER_MODEL=/data/tokenizers/t5-base bash examples/compare_schemes.sh
#
# Run it on every node (NODE_RANK 0 .. NNODES-1), once per arm. The arms (the same table
# benchmarks/schemes.py trains on CPU): pre_ln post_ln deepnorm deepnorm_authors sandwich lns mix_ln
# mix_deepnorm pre_post post_every4 pre_every4 pre_sandwich; `mixln-megatron arms --num-layers 24`
# lists them, `mixln-megatron arms --num-layers 24 ARM` prints the MIXLN_* exports of one. MODEL=1b: 24 layers,
# the "alpha*L" groups are 6 layers (alpha 0.25); MODEL=7b: 32 layers, 2 layers (alpha 0.0625);
# MODEL=moe16b (examples/pretrain_moe16b_a2b_mixln.sh): 28 layers, 1 layer (alpha 0.0625).
# Each arm writes its own CHECKPOINT_DIR (default /checkpoints/llama1b-<ARM>, llama7b-<ARM> or
# moe16b-<ARM>); compare the validation loss Megatron-LM logs (TensorBoard under
# CHECKPOINT_DIR/tensorboard) at equal steps.
#
# Environment [default]:
#   ARM                   the arm (required)
#   MODEL                 1b, 7b or moe16b [1b]
#   CHECKPOINT_DIR        [/checkpoints/<llama1b|llama7b|moe16b>-<ARM>]
#   PYTHON                the interpreter that prints the arm's settings [python]
# The rest (MEGATRON_LM_DIR, DATA_PATH, TOKENIZER_MODEL, NNODES, ...) as the launcher's header
# says; the launcher's MIXLN_* come from the arm only.
set -euo pipefail

ARM=${ARM:?set ARM to one arm, e.g. mix_ln or mix_deepnorm (python -m mixln_megatron.analysis.arms --help)}
MODEL=${MODEL:-1b}
PYTHON=${PYTHON:-python}
case "${MODEL}" in
    1b) launcher=pretrain_llama1b_mixln.sh; layers=24; alpha=0.25; run=llama1b ;;
    7b) launcher=pretrain_llama7b_mixln.sh; layers=32; alpha=0.0625; run=llama7b ;;
    moe16b) launcher=pretrain_moe16b_a2b_mixln.sh; layers=28; alpha=0.0625; run=moe16b ;;
    *) echo "MODEL must be 1b, 7b or moe16b, got ${MODEL}" >&2; exit 2 ;;
esac

# Only the arm's settings reach the launcher: nothing inherited from this shell mixes in.
unset MIXLN_ALPHA MIXLN_POST_LN_LAYERS MIXLN_LAYOUT MIXLN_SCHEME MIXLN_DEEPNORM_ALPHA MIXLN_DEEPNORM_BETA
exports=$("${PYTHON}" -m mixln_megatron.analysis.arms --num-layers "${layers}" --mixln-alpha "${alpha}" "${ARM}")
eval "${exports}"
export CHECKPOINT_DIR=${CHECKPOINT_DIR:-/checkpoints/${run}-${ARM}}

exec bash "$(dirname "$0")/${launcher}"
