#!/usr/bin/env bash
# zero beside PyTorch 2.x (eager, torch.compile), FSDP2 and DeepSpeed ZeRO-3 on the
# same CPU jobs, in one command (bench/peers/peers.py says what it runs and how):
#
#   bench/peers/run.sh                 # the full run: under 30 minutes on 2 cores
#   bench/peers/run.sh --quick         # a smoke run of a few minutes
#   bench/peers/run.sh --help          # every option
#
# The first run makes bench/peers/.venv (ignored by git) from requirements.txt with
# /usr/bin/python3 (Debian 12's Python 3.11) and PyPI: about 5.4 GB, a few minutes to
# download; then builds DeepSpeed's CPU ops (CPU Adam, its shared-memory collectives)
# into .venv/torch_extensions, a few minutes more. Later runs reuse it; a changed
# requirements.txt makes it again. PEERS_VENV=DIR puts it elsewhere.
# Needs zero's trainers built (ninja -C build
# examples/gpt_train examples/train_fashion_mnist), mpirun (openmpi-bin), g++ and
# python3-venv/python3-dev (for the CPU ops and torch.compile), dict-devil and
# dataset-fashion-mnist (the data).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${PEERS_VENV:-$here/.venv}
python=${PEERS_PYTHON:-/usr/bin/python3}
stamp="$venv/.installed-$(sha256sum "$here/requirements.txt" | cut -c1-16)"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$venv/torch_extensions}
export DS_ACCELERATOR=cpu

if [[ ! -e $stamp ]]; then
  echo "bench/peers: making $venv from requirements.txt (once; about 5.4 GB from PyPI)"
  if ! "$python" -c 'import ensurepip, sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
    echo "bench/peers: $python needs venv and its headers (DeepSpeed's CPU ops and torch.compile compile" \
         "C++ against them): apt-get install python3-venv python3-dev" >&2
    exit 1
  fi
  [[ -x $venv/bin/python ]] || "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  # Everything but deepspeed, whose build imports torch.
  grep -v '^deepspeed==' "$here/requirements.txt" >"$venv/requirements-first.txt"
  "$venv/bin/python" -m pip install --quiet -r "$venv/requirements-first.txt"
  DS_BUILD_OPS=0 "$venv/bin/python" -m pip install --quiet --no-build-isolation --no-deps \
    "$(grep '^deepspeed==' "$here/requirements.txt")"
  echo "bench/peers: building DeepSpeed's CPU ops into $TORCH_EXTENSIONS_DIR (once)"
  "$venv/bin/python" - <<'PY'
from deepspeed.accelerator import get_accelerator
for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
    get_accelerator().create_op_builder(name).load()
    print("built", name, flush=True)
PY
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi
exec "$venv/bin/python" "$here/peers.py" "$@"
