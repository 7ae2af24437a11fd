#!/usr/bin/env bash
# The TransformerEngine check, for machines with TE (e.g. NGC PyTorch containers): Mix-LN TE spec
# vs local spec on identical weights (fp32, bf16), torch_dist save/load of the TE model (and into a
# local-spec model), an fp8 smoke step where the GPU supports it, and the step-time / memory ratio
# with TE on the 7B-shaped slice.
#
#   benchmarks/te_check.sh                   # where TE is installed; prints `SKIP te_check: ...`, exit 0, elsewhere
#   benchmarks/te_check.sh --cpu-dry-run     # the same code with the local backend on a CPU (the suite runs this)
#   benchmarks/te_check.sh --layers 4 --seq 2048   # a smaller slice for GPUs with less memory
#
# megatron-core and the project are made importable as in gpu_check.sh (an importable 0.19.x, else
# the wheel in benchmarks/wheels/ installed offline into a temporary folder).
# Last line: RESULT te_step_ratio=.. te_mem_ratio=.. te_vs_local_max_abs=.. fp8=ok|skipped|failed postln_7b_pct=..
# (TE in deterministic mode: NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 unless already set)
set -uo pipefail
# shellcheck source=gpu_check.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/gpu_check.sh"
mixln_run_check te_check.py "$@"
exit $?
