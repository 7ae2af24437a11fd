#!/usr/bin/env bash
# Usage: scripts/newest_torch_env.sh        (make test-newest-torch runs it)
#
# A second venv, .venv-newest-torch (or $NEWEST_TORCH_VENV), holding what `pip install -e '.[dev]'`
# resolves today: the newest torch setup.py admits, megatron-core and the rest. The checkpoint
# tests run on it, so a torch release that changes what they load is seen the day it lands; the
# main .venv keeps its own torch.
#
# A machine-wide pip constraint on torch (pip.conf's `constraint`, as on the CI machines, or
# PIP_CONSTRAINT) is lifted for this venv's pip only: PIP_CONSTRAINT=/dev/null replaces it, and
# pip's other settings (indexes, certificates) stay.
# Kept between runs: each run re-resolves with --upgrade --upgrade-strategy eager, which fetches
# only what changed on the registry (a fresh venv downloads torch and its CUDA libraries, GBs).
#
# stdout: the venv's python. stderr: one line naming the torch, megatron-core and Python it holds,
# and the registry's newest torch where that is another one (setup.py's bound). A failed install: pip's
# output and one line, exit 1.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${NEWEST_TORCH_VENV:-.venv-newest-torch}
PY=$VENV/bin/python
export PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1

fail() { echo "newest_torch_env.sh: $*" >&2; exit 1; }

if [ ! -x "$PY" ]; then
  base=$(scripts/find_python.sh) || exit 1
  echo "newest_torch_env.sh: creating $VENV with $base (a fresh venv downloads torch: minutes)" >&2
  "$base" -m venv "$VENV" || fail "could not create $VENV with $base"
fi
"$PY" -m pip install -qq --upgrade pip >&2 || fail "pip could not upgrade itself in $VENV (network?)"
"$PY" -m pip install -qq --upgrade --upgrade-strategy eager -e '.[dev]' >&2 \
  || fail "pip install -e '.[dev]' failed in $VENV (output above)"

have=$("$PY" -c 'import sys, importlib.metadata as m
print(m.version("torch"), m.version("megatron-core"), "%d.%d.%d" % sys.version_info[:3])') \
  || fail "torch or megatron-core does not import in $VENV"
read -r torch_v mcore_v py_v <<<"$have"
# The registry's newest torch (pip's own answer, same indexes): named when setup.py's bound leaves it out.
newest=$("$PY" -m pip index versions torch 2>/dev/null | sed -n 's/^torch (\(.*\))$/\1/p' || true)
bound=$(sed -n 's/^ *"\(torch[<>=!~][^"]*\)",.*/\1/p' setup.py | head -1)
note=""
if [ -n "$newest" ] && [ "$newest" != "${torch_v%%+*}" ]; then
  note="; the registry's newest torch is $newest (setup.py asks $bound)"
fi
echo "newest_torch_env.sh: $VENV has torch $torch_v, megatron-core $mcore_v, Python $py_v$note" >&2
echo "$PY"
