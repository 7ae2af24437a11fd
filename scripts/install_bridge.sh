#!/usr/bin/env bash
# Usage: scripts/install_bridge.sh        (make test-bridge runs it)
#
# Lays Megatron-Bridge 0.6.2 over the venv for the tests marked `bridge`, as a separate directory
# (.venv/bridge-0.6.2) that only `make test-bridge` puts on PYTHONPATH, in front of the TE overlay
# (scripts/install_te.sh: `import megatron.bridge` imports TransformerEngine unconditionally).
#
# Not the venv itself: Bridge 0.6.2 needs transformers >=5.8,<=5.12.1 (the venv has a newer one,
# which the rest of the suite tests) and brings TE, whose kernels megatron-core's optimizer would
# then pick on the CPU. Everything is installed with pip --no-deps from the pinned list below,
# so no second torch or megatron-core comes in: Bridge runs on the venv's torch and megatron-core.
# The list is what Bridge's conversion path imports (AutoBridge, the Llama bridge, provider,
# weight loading/export, save_hf_pretrained, which imports nvidia-modelopt), not Bridge's whole
# requirement set (~200 packages, ~9 GB: training recipes, loggers, VLM and diffusion models),
# which a CPU cannot exercise anyway. `pip install 'mixln-megatron[bridge]'` installs the real thing.
#
# stdout: the PYTHONPATH for the tests (bridge overlay:TE overlay), once the pinned versions are
# checked and `import megatron.bridge` works from it. Whenever the overlay cannot be laid out
# (another torch or Python, no TE overlay, no network, a missing version, a failed check): nothing on
# stdout, one line on stderr saying why, exit 0 (the bridge tests are skipped); with
# BRIDGE_TESTS_REQUIRED=1 in the environment the same line says the tests were required, exit 1.
# Exit 1 also without the venv. Idempotent: a stamp (the pin list + torch version) skips the install.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PY:-.venv/bin/python}
BRIDGE_VERSION=0.6.2
TORCH_WANTED=2.14.1+cu130
overlay=${BRIDGE_OVERLAY:-.venv/bridge-$BRIDGE_VERSION}  # BRIDGE_OVERLAY: another place (tests of this script)
stamp=$overlay/.installed
# Pinned, each checked after the install. transformers/tokenizers/huggingface-hub: the newest
# Bridge 0.6.2 accepts (they shadow the venv's newer ones in these tests only); kernels: the range
# that transformers 5.12.1 imports at start-up (>=0.12,<0.13; the venv's newer one breaks its import).
PINS="megatron-bridge==$BRIDGE_VERSION
transformers==5.12.1
tokenizers==0.22.2
huggingface-hub==1.33.0
kernels==0.12.3
omegaconf==2.3.0
antlr4-python3-runtime==4.9.3
hydra-core==1.3.2
nvidia-modelopt==0.47.0
pulp==3.3.2
scipy==1.18.1
nvidia-ml-py==13.615.71
ninja==1.13.2"

# The bridge tests cannot run here: skip them, or fail when BRIDGE_TESTS_REQUIRED=1 says they must run.
skip() {
  if [ "${BRIDGE_TESTS_REQUIRED:-}" = 1 ]; then
    echo "install_bridge.sh: BRIDGE_TESTS_REQUIRED=1, but the Bridge overlay cannot be laid out: $*" >&2; exit 1
  fi
  echo "install_bridge.sh: Bridge tests skipped: $*" >&2; exit 0
}

[ -x "$PY" ] || { echo "install_bridge.sh: $PY not found; run 'make setup' first" >&2; exit 1; }
have=$("$PY" -c 'import sys, torch; print(f"{torch.__version__} cp{sys.version_info[0]}{sys.version_info[1]}")' 2>/dev/null) \
  || skip "torch does not import with $PY"
[ "${have#* }" = "cp312" ] || skip "megatron-bridge $BRIDGE_VERSION needs Python 3.12, the venv has ${have#* }"
[ "${have% *}" = "$TORCH_WANTED" ] \
  || skip "the overlay is pinned for torch $TORCH_WANTED (the TE overlay's build), the venv has torch ${have% *}"
te_err=$(mktemp)
te=$(scripts/install_te.sh 2>"$te_err"); te_rc=$?
te_why=$(grep -v "^install_te.sh: installing" "$te_err" | tail -n 1)
if [ "$te_rc" != 0 ] || [ -z "$te" ]; then
  rm -f "$te_err"; skip "no TE overlay, which megatron.bridge imports (${te_why:-scripts/install_te.sh failed})"
fi
cat "$te_err" >&2; rm -f "$te_err"  # what install_te.sh did, when it installed

want_stamp="$(printf '%s\n' "$PINS" | sha256sum | cut -d' ' -f1) $TORCH_WANTED"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want_stamp" ]; then
  echo "install_bridge.sh: installing megatron-bridge $BRIDGE_VERSION into $overlay (pip --no-deps, $(printf '%s\n' "$PINS" | wc -l) pinned packages)" >&2
  rm -rf "$overlay"
  log=$(mktemp)
  # shellcheck disable=SC2086
  if ! "$PY" -m pip install -q --no-deps --no-compile --disable-pip-version-check --target "$overlay" $PINS >"$log" 2>&1; then
    why=$(grep -E "ERROR|Error" "$log" | grep -v "Location .* is ignored" | tail -n 1)
    rm -rf "$overlay" "$log"
    skip "pip could not install the pinned packages: ${why:-see the output of pip}"
  fi
  rm -f "$log"
fi

# Check on every run: the pinned versions are the overlay's. After an install also: megatron.bridge
# imports from the overlay, torch and megatron-core from the venv (importing Bridge takes ~45 s of
# CPU: it imports every model it knows, so a cached run does not repeat it; the tests import it).
check_py=$(mktemp)
cat >"$check_py" <<'EOF'
import importlib.metadata as md, os, sys, warnings, logging
warnings.simplefilter("ignore")
logging.disable(logging.WARNING)
overlay, pins = os.path.realpath(sys.argv[1]), sys.argv[2].split()
found = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in md.distributions(path=[overlay])}
for pin in pins:
    name, version = pin.split("==")
    got = found.get(name.lower().replace("_", "-"))
    if got != version:
        sys.exit(f"{name} in the overlay is {got}, pinned {version}")
if sys.argv[3] == "versions":
    sys.exit(0)
import torch  # before TE, which then finds the NCCL library of torch
import megatron.core, megatron.bridge, transformers
from megatron.bridge import AutoBridge  # noqa: F401
for mod in (torch, megatron.core):
    if os.path.realpath(mod.__file__).startswith(overlay + os.sep):
        sys.exit(f"{mod.__name__} comes from the overlay, not the venv")
if not os.path.realpath(megatron.bridge.__file__).startswith(overlay + os.sep):
    sys.exit(f"megatron.bridge comes from {megatron.bridge.__file__}, not the overlay")
print(f"megatron-bridge {found['megatron-bridge']}, transformers {transformers.__version__} from the overlay; "
      f"torch {torch.__version__}, megatron-core {md.version('megatron-core')} from the venv")
EOF
what=versions; [ -f "$stamp" ] || what=imports
check=$(PYTHONPATH="$overlay:$te" "$PY" "$check_py" "$overlay" "$PINS" "$what" 2>&1); check_rc=$?
rm -f "$check_py"
[ "$check_rc" = 0 ] || { rm -f "$stamp"; skip "the overlay does not work: $(printf '%s\n' "$check" | tail -n 1)"; }
[ -f "$stamp" ] || { echo "$want_stamp" > "$stamp"; echo "install_bridge.sh: $(printf '%s\n' "$check" | tail -n 1) ($(du -sh "$overlay" | cut -f1))" >&2; }
echo "$overlay:$te"

