#!/usr/bin/env bash
# Usage: scripts/compat_env.sh RELEASE   (RELEASE: 0.17, 0.18 or main)
#
# Lays an older megatron-core wheel over the main venv without a second torch: the wheel alone
# (pip --no-deps) goes into .compat/RELEASE, which goes first on PYTHONPATH; torch, numpy and the
# rest come from .venv. Prints the overlay directory on stdout (diagnostics go to stderr) after
# checking that `import megatron.core` resolves to the overlay with the pinned version and that
# every requirement of the wheel is met by the venv (an unmet one is installed into the overlay).
# Idempotent: an overlay that already holds the pinned version is reused.
#
# main (megatron-core 0.20.0, not on any registry yet): the Megatron-LM main snapshot
# (../shared/upstream/megatron-lm-main-*.tar.gz, or $MEGATRON_MAIN_TARBALL) is unpacked into
# .compat/main (megatron/ and the license; pretrain_gpt.py and the other scripts beside it in
# .compat/main-scripts), checked against its SHA256SUMS when one is beside it, and gets the wheel's
# prebuilt dataset helpers (helpers.cpp is byte-identical; the Makefile is left out, as in the
# wheels). Its imports need nothing the venv lacks. Without a snapshot an overlay unpacked before
# is reused; with neither, one line says what to set.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
release=${1:?usage: scripts/compat_env.sh RELEASE (0.17, 0.18 or main)}
case "$release" in
  0.17) pin=0.17.1 ;;
  0.18) pin=0.18.2 ;;
  main) pin=0.20.0 ;;
  *) echo "compat_env.sh: unknown release '$release' (known: 0.17, 0.18, main)" >&2; exit 2 ;;
esac
overlay=.compat/$release
[ -x "$PY" ] || { echo "compat_env.sh: $PY not found; run 'make setup' first" >&2; exit 1; }

if [ "$release" = main ]; then
  shared_upstream="$(cd .. && pwd)/shared/upstream"
  tarball=${MEGATRON_MAIN_TARBALL:-}
  if [ -z "$tarball" ]; then  # the first snapshot there, if any (a glob, not `ls | head`: nothing found is no error)
    for candidate in "$shared_upstream"/megatron-lm-main-*.tar.gz; do
      [ -f "$candidate" ] && { tarball=$candidate; break; }
    done
  fi
  stamp="$overlay/.snapshot"
  snapshot_is="a megatron-lm-main-<commit>.tar.gz: Megatron-LM's main branch with megatron/ and LICENSE at its top"
  if [ -n "${MEGATRON_MAIN_TARBALL:-}" ] && [ ! -f "$tarball" ]; then
    echo "compat_env.sh: MEGATRON_MAIN_TARBALL=$tarball is not a file; set it to $snapshot_is" >&2; exit 1
  fi
  if [ -z "$tarball" ] && [ -f "$stamp" ]; then
    tarball=$(cat "$stamp")  # no snapshot at hand: the one already unpacked serves
  fi
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$(basename "$tarball")" ]; then
    [ -n "$tarball" ] || {
      echo "compat_env.sh: no Megatron-LM main snapshot in $shared_upstream/ and MEGATRON_MAIN_TARBALL is not set; set it to $snapshot_is" >&2; exit 1; }
    sums="$(dirname "$tarball")/SHA256SUMS"
    if [ -f "$sums" ]; then
      (cd "$(dirname "$tarball")" && grep " $(basename "$tarball")\$" SHA256SUMS | sha256sum -c --quiet -) >&2 || {
        echo "compat_env.sh: $tarball does not match its SHA256SUMS" >&2; exit 1; }
    fi
    echo "compat_env.sh: unpacking $(basename "$tarball") into $overlay" >&2
    rm -rf "$overlay" "$overlay-scripts"
    mkdir -p "$overlay" "$overlay-scripts"
    tar -xzf "$tarball" -C "$overlay" megatron LICENSE
    tar -xzf "$tarball" -C "$overlay-scripts" --exclude 'megatron/*' --exclude megatron
    cp "$overlay/LICENSE" "$overlay-scripts/LICENSE"
    helpers=$("$PY" -c 'import glob, os, megatron.core.datasets as d; print(*glob.glob(os.path.join(os.path.dirname(d.__file__), "helpers_cpp*.so")))')
    [ -n "$helpers" ] && cp $helpers "$overlay/megatron/core/datasets/"
    # Laid out like a wheel: no Makefile beside helpers.cpp, so the prebuilt helpers are used
    # (mixln_megatron.training.pretrain.use_prebuilt_dataset_helpers) instead of a `make` that needs pybind11.
    rm -f "$overlay/megatron/core/datasets/Makefile"
    basename "$tarball" > "$stamp"
  fi
fi


if [ "$release" != main ] && [ ! -d "$overlay/megatron_core-$pin.dist-info" ]; then
  echo "compat_env.sh: installing megatron-core==$pin into $overlay (no dependencies)" >&2
  rm -rf "$overlay"
  "$PY" -m pip install -q --no-deps --no-compile --target "$overlay" "megatron-core==$pin" >&2
fi

# The overlay's own requirements (without extras) must be satisfied by overlay + venv.
missing=
[ "$release" = main ] || missing=$(PYTHONPATH="$overlay" "$PY" - "$pin" <<'EOF'
import importlib.metadata as md, sys
from packaging.requirements import Requirement
dist = md.distribution("megatron-core")
assert dist.version == sys.argv[1], (dist.version, sys.argv[1])
for text in dist.requires or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        print(text); continue
    if not req.specifier.contains(have, prereleases=True):
        print(text)
EOF
)
if [ -n "$missing" ]; then
  echo "compat_env.sh: installing into $overlay what the venv lacks: $missing" >&2
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-deps --target "$overlay" $missing >&2
fi

PYTHONPATH="$overlay" "$PY" - "$pin" "$overlay" <<'EOF' >&2
import os, sys, warnings
warnings.simplefilter("ignore")
import megatron.core, megatron.training, torch
pin, overlay = sys.argv[1], os.path.realpath(sys.argv[2])
version = megatron.core.__version__
assert version.split("+")[0] == pin, f"megatron.core reports {version}, expected {pin}"
for mod in (megatron.core, megatron.training):
    assert os.path.realpath(mod.__file__).startswith(overlay + os.sep), mod.__file__
assert not os.path.realpath(torch.__file__).startswith(overlay + os.sep), "a second torch"
print(f"compat_env.sh: megatron-core {version} from {overlay}, torch {torch.__version__} from the venv")
EOF
echo "$overlay"
