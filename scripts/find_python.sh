#!/usr/bin/env bash
# Print the path of a Python >= 3.12 (megatron-core 0.19 requires it): PATH first, then the
# interpreters pyenv has installed. Exit 1 with a message naming what was tried otherwise.
set -u
tried=()
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }
for name in ${PYTHON:-} python3.12 python3.13 python3.14 python3 python; do
  [ -n "$name" ] || continue
  if path=$(command -v "$name" 2>/dev/null); then
    tried+=("$path")
    if ok "$path"; then echo "$path"; exit 0; fi
  else
    tried+=("$name (not on PATH)")
  fi
done
roots=()
command -v pyenv >/dev/null 2>&1 && roots+=("$(pyenv root)")
roots+=("${PYENV_ROOT:-$HOME/.pyenv}")
for root in "${roots[@]}"; do
  for path in $(ls -d "$root"/versions/3.12*/bin/python3 2>/dev/null | sort -rV) $(ls -d "$root"/versions/3.1[3-9]*/bin/python3 2>/dev/null | sort -V); do
    tried+=("$path")
    if ok "$path"; then echo "$path"; exit 0; fi
  done
done
{
  echo "error: no Python >= 3.12 found (megatron-core 0.19 needs it)."
  echo "looked for: ${tried[*]:-nothing}"
  echo "install one (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12"
} >&2
exit 1
