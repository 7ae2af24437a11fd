#!/usr/bin/env bash
# The GPU check: Mix-LN (local backend) against the CPU reference, and its step-time / memory
# overhead on a 7B-shaped slice, on one GPU. Needs only Python >= 3.12 with a CUDA torch and triton
# (plus numpy and packaging, which megatron-core imports); no network, no TransformerEngine.
#
#   benchmarks/gpu_check.sh                  # on the GPU machine, from anywhere
#   benchmarks/gpu_check.sh --cpu-dry-run    # same code, tiny shapes, on a CPU (the test suite runs this)
#   benchmarks/gpu_check.sh --help           # the Python script's options
#
# megatron-core: an importable 0.19.x is used as is; otherwise the wheel carried in
# benchmarks/wheels/ (checked against SHA256SUMS) is installed offline into a temporary folder
# put on PYTHONPATH (set MIXLN_MCORE_WHEEL=/path/to/wheel to use another, MIXLN_FORCE_WHEEL=1 to
# prefer the wheel over an installed megatron-core). The project itself goes on PYTHONPATH.
# The interpreter is $PYTHON, else python3. Output: progress lines with timestamps, a JSON in
# benchmarks/results/ (or --out-dir), and `RESULT step_ratio=.. mem_ratio=.. gpu_vs_cpu_max_abs=..`.
#
# benchmarks/te_check.sh sources this file for mixln_check_env; nothing runs when sourced.

MIXLN_BENCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MIXLN_REPO_DIR="$(dirname "$MIXLN_BENCH_DIR")"
MIXLN_MCORE_SERIES="0.19"

mixln_log() { printf '[%s %s] %s\n' "$(date +%H:%M:%S)" "$(basename "$0")" "$*"; }

# Prints "<version> <folder>" of the megatron.core that $PY would import, or "none".
mixln_probe_mcore() {
  "$PY" - <<'EOF'
import importlib.util, os, re, sys
try:
    spec = importlib.util.find_spec("megatron.core")
except Exception:
    spec = None
if spec is None or not spec.origin:
    print("none"); sys.exit(0)
folder = os.path.dirname(spec.origin)
try:
    text = open(os.path.join(folder, "package_info.py")).read()
    version = ".".join(re.search(r"^%s = (\d+)" % k, text, re.M).group(1) for k in ("MAJOR", "MINOR", "PATCH"))
except (OSError, AttributeError):
    version = "unknown"
print(version, folder)
EOF
}

# Sets PY and PYTHONPATH so that megatron-core 0.19 and this project import. Returns non-zero
# (with a message) when that cannot be arranged.
mixln_check_env() {
  PY="${PYTHON:-$(command -v python3 || command -v python || true)}"
  if [ -z "$PY" ]; then echo "error: no python3 on PATH (set PYTHON=/path/to/python3.12)" >&2; return 2; fi
  case "$PY" in  # absolute, without resolving links (a venv's python is a link)
    /*) ;;
    */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;;
    *) PY="$(command -v "$PY")" ;;
  esac
  if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)'; then
    echo "error: $PY is Python $("$PY" -c 'import platform; print(platform.python_version())'); megatron-core 0.19 needs >= 3.12 (set PYTHON=...)" >&2
    return 2
  fi
  export PYTHONPATH="$MIXLN_REPO_DIR${PYTHONPATH:+:$PYTHONPATH}"
  local found version
  found="$(mixln_probe_mcore)"
  version="${found%% *}"
  if [ "${MIXLN_FORCE_WHEEL:-0}" != "1" ] && [[ "$version" == "$MIXLN_MCORE_SERIES".* ]]; then
    mixln_log "megatron-core $version already importable (${found#* }); using it"
    return 0
  fi
  local wheel="${MIXLN_MCORE_WHEEL:-}"
  if [ -z "$wheel" ]; then
    wheel="$(ls "$MIXLN_BENCH_DIR"/wheels/megatron_core-"$MIXLN_MCORE_SERIES".*.whl 2>/dev/null | sort -V | tail -n 1)"
  fi
  if [ -n "${MIXLN_MCORE_WHEEL:-}" ] && [ ! -f "$wheel" ]; then
    echo "error: MIXLN_MCORE_WHEEL=$wheel does not exist" >&2
    return 3
  fi
  if [ -z "$wheel" ] || [ ! -f "$wheel" ]; then
    echo "error: megatron-core $MIXLN_MCORE_SERIES.x is not importable (found: $found) and no wheel was found in $MIXLN_BENCH_DIR/wheels/." >&2
    echo "       get it with: pip download megatron-core==0.19.2 --no-deps -d $MIXLN_BENCH_DIR/wheels" >&2
    return 3
  fi
  if [ -f "$MIXLN_BENCH_DIR/wheels/SHA256SUMS" ] && [ -z "${MIXLN_MCORE_WHEEL:-}" ]; then
    if ! (cd "$MIXLN_BENCH_DIR/wheels" && "$PY" - "$(basename "$wheel")" <<'EOF'
import hashlib, sys
name = sys.argv[1]
want = {line.split()[1]: line.split()[0] for line in open("SHA256SUMS") if line.strip()}
got = hashlib.sha256(open(name, "rb").read()).hexdigest()
if want.get(name) != got:
    sys.exit(f"error: {name}: sha256 {got} does not match SHA256SUMS ({want.get(name)})")
EOF
    ); then return 3; fi
  fi
  local t0=$SECONDS
  MIXLN_SITE_DIR="$(mktemp -d "${TMPDIR:-/tmp}/mixln_mcore.XXXXXX")"
  local why="megatron-core $MIXLN_MCORE_SERIES.x is not importable (found: $version)"
  if [ "${MIXLN_FORCE_WHEEL:-0}" = "1" ]; then why="MIXLN_FORCE_WHEEL=1"; fi
  mixln_log "$why: installing $(basename "$wheel") offline into $MIXLN_SITE_DIR"
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --target "$MIXLN_SITE_DIR" "$wheel" >/dev/null 2>&1; then
    mixln_log "pip unavailable or failed; unpacking the wheel with zipfile instead"
    "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$wheel" "$MIXLN_SITE_DIR" || return 3
  fi
  export PYTHONPATH="$MIXLN_REPO_DIR:$MIXLN_SITE_DIR${PYTHONPATH#"$MIXLN_REPO_DIR"}"
  found="$(mixln_probe_mcore)"
  if [[ "${found#* }" != "$MIXLN_SITE_DIR"* ]]; then
    echo "error: after installing the wheel, megatron.core still resolves to ${found#* } (a regular 'megatron' package elsewhere on the path shadows it); remove it from PYTHONPATH" >&2
    return 3
  fi
  mixln_log "megatron-core ${found%% *} ready in $((SECONDS - t0))s"
}

mixln_cleanup() { if [ -n "${MIXLN_SITE_DIR:-}" ]; then rm -rf "$MIXLN_SITE_DIR"; fi; }

mixln_run_check() {  # <script.py> [args...]
  local script="$1"; shift
  mixln_check_env || return $?
  trap mixln_cleanup EXIT
  local rc=0
  PYTHONUNBUFFERED=1 "$PY" -u "$MIXLN_BENCH_DIR/$script" "$@" || rc=$?
  return $rc
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -uo pipefail
  mixln_run_check gpu_check.py "$@"
  exit $?
fi
