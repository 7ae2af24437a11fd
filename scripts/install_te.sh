#!/usr/bin/env bash
# Usage: scripts/install_te.sh        (make test-te runs it)
#
# Lays TransformerEngine 2.20.2 over the venv for the tests marked `te`: the registry wheels
# transformer-engine and transformer-engine-cu13 (the prebuilt core), the PyTorch extension
# transformer_engine_torch built for torch 2.14.1+cu130 / cp312 (the registry has only its
# source: $TE_WHEEL_DIR, default ../shared/wheels/ next to the checkout, checked against the
# SHA256SUMS there) and TE's Python requirements, all with pip --no-deps into .venv/te-2.20.2.
#
# An overlay, not the venv itself: with TE importable megatron-core's optimizer and grad clipping
# take TE's CUDA-only kernels (FusedAdam, multi_tensor_applier), so the CPU suite (`make test`,
# `make test-compat`) would stop training. Only `make test-te` puts the overlay on PYTHONPATH; TE
# finds the CUDA runtime, cuDNN and NCCL of torch's nvidia/ packages in the venv.
#
# stdout: the overlay directory, once `import transformer_engine.pytorch` works from it.
# Another torch or Python, or no wheel: nothing on stdout, one line on stderr saying why, exit 0
# (the te tests are skipped); with TE_TESTS_REQUIRED=1 in the environment the same line says the
# tests were required, exit 1. A wheel whose checksum differs, or a failed install: exit 1.
# Idempotent: a stamp (.venv/te-2.20.2/.installed: wheel sha256 + torch version) skips the install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TE_VERSION=2.20.2
TORCH_WANTED=2.14.1+cu130
WHEEL=transformer_engine_torch-$TE_VERSION-cp312-cp312-linux_x86_64.whl
WHEEL_DIR=${TE_WHEEL_DIR:-../shared/wheels}
overlay=.venv/te-$TE_VERSION
stamp=$overlay/.installed
# TE's requirements (and theirs), pinned: pip --no-deps must not pull a second torch.
REQS="einops==0.8.2 onnx==1.23.2 onnxscript==0.7.2 onnx-ir==1.1.0 ml_dtypes==0.6.0 protobuf==7.36.2
  nvdlfw-inspect==0.2.2 nvidia-cudnn-frontend==1.32.0 importlib_metadata==10.2.0 lazy-importer==0.1.0"

# The te tests cannot run here: skip them, or fail when TE_TESTS_REQUIRED=1 says they must run.
skip() {
  if [ "${TE_TESTS_REQUIRED:-}" = 1 ]; then
    echo "install_te.sh: TE_TESTS_REQUIRED=1, but the TE overlay cannot be laid out: $*" >&2; exit 1
  fi
  echo "install_te.sh: TE tests skipped: $*" >&2; exit 0
}

[ -x "$PY" ] || { echo "install_te.sh: $PY not found; run 'make setup' first" >&2; exit 1; }
have=$("$PY" -c 'import sys, torch; print(f"{torch.__version__} cp{sys.version_info[0]}{sys.version_info[1]}")' 2>/dev/null) \
  || skip "torch does not import with $PY"
[ "$have" = "$TORCH_WANTED cp312" ] \
  || skip "the TE extension wheel is built for torch $TORCH_WANTED (cp312), the venv has torch ${have% *} (${have#* }); rebuild it (../shared/wheels/README.md)"
[ -f "$WHEEL_DIR/$WHEEL" ] || skip "no $WHEEL in $WHEEL_DIR (set TE_WHEEL_DIR)"
[ -f "$WHEEL_DIR/SHA256SUMS" ] || { echo "install_te.sh: $WHEEL_DIR/SHA256SUMS is missing; cannot check $WHEEL" >&2; exit 1; }
want=$(awk -v w="$WHEEL" '$2 == w {print $1}' "$WHEEL_DIR/SHA256SUMS")
got=$(sha256sum "$WHEEL_DIR/$WHEEL" | cut -d' ' -f1)
if [ -z "$want" ] || [ "$want" != "$got" ]; then
  echo "install_te.sh: $WHEEL_DIR/$WHEEL has sha256 $got, SHA256SUMS says '${want:-nothing}'" >&2; exit 1
fi

if [ "$(cat "$stamp" 2>/dev/null)" != "$got $TORCH_WANTED" ]; then
  echo "install_te.sh: installing TransformerEngine $TE_VERSION into $overlay (registry wheels + $WHEEL)" >&2
  rm -rf "$overlay"
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-deps --no-compile --target "$overlay" \
    "transformer-engine==$TE_VERSION" "transformer-engine-cu13==$TE_VERSION" "$WHEEL_DIR/$WHEEL" $REQS >&2
  PYTHONPATH="$overlay" "$PY" - "$overlay" "$TE_VERSION" <<'EOF' >&2
import os, sys, warnings
warnings.simplefilter("ignore")
import torch  # before TE: it finds torch's libnccl then
import transformer_engine, transformer_engine.pytorch
overlay = os.path.realpath(sys.argv[1])
assert os.path.realpath(transformer_engine.__file__).startswith(overlay + os.sep), transformer_engine.__file__
assert not os.path.realpath(torch.__file__).startswith(overlay + os.sep), "a second torch"
assert transformer_engine.__version__.split("+")[0] == sys.argv[2], transformer_engine.__version__
print(f"install_te.sh: TransformerEngine {transformer_engine.__version__} from {overlay}, torch {torch.__version__} from the venv")
EOF
  echo "$got $TORCH_WANTED" > "$stamp"
fi
echo "$overlay"
