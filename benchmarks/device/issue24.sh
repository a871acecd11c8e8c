#!/usr/bin/env bash
# Issue 24's device rows in one device call (each step bounded; about 6 minutes on an H100):
#   1. stacked_layers.py: does the device's XLA read a stacked weight's layer in place (§3);
#   2. decode_dispatch.py: the host time per decode call, 2 against 24 layers (§3);
#   3. serve_builtin.py: Qwen2.5-0.5B, 24 layers, bfloat16, 64 clients of 128 tokens
#      against generate, with the baseline commit's server in the same run (target 0.8x).
# Here first: bash benchmarks/device/prepare.sh. Then the device tool's run with
#   command "bash benchmarks/device/issue24.sh", carry [".device"], timeout_s 600.
# The outputs land in $OUT (the device tool's folder; /tmp/issue24 elsewhere).
# PY: the Python to use (the device image's python3 by default).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/issue24}
PY=${PY:-python3}
mkdir -p "$OUT"
if compgen -G ".device/whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/issue24-site .device/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/issue24-site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
baseline=()
[ -d .device/baseline/src ] && baseline=(--baseline-src .device/baseline/src)
layers=${LAYERS:-24}
step() {  # step NAME SECONDS COMMAND...: its output in $OUT/NAME.txt and here
  local name=$1 seconds=$2
  shift 2
  echo "== $name: $*"
  timeout "$seconds" "$@" 2>&1 | tee "$OUT/$name.txt"
  echo "== $name: exit ${PIPESTATUS[0]}"
}
{ nvidia-smi -L 2>/dev/null; "$PY" -c 'import jax, flax, sys
print(sys.version.split()[0], "jax", jax.__version__, "flax", flax.__version__, jax.devices())'
} | tee "$OUT/device.txt"
step stacked 150 "$PY" benchmarks/stacked_layers.py --layers "$layers" --dtype bfloat16
step dispatch 120 "$PY" benchmarks/decode_dispatch.py --calls 100
# three processes hold the device (generate here, this server's engine, the baseline's)
XLA_PYTHON_CLIENT_MEM_FRACTION=0.25 step serve 330 "$PY" benchmarks/serve_builtin.py \
  --layers "$layers" --clients 64 --dtype bfloat16 --new-tokens 128 --max-length 256 \
  --rounds 3 "${baseline[@]}" --json "$OUT/serve.json"
