#!/usr/bin/env bash
# Prepares a device call (issue24.sh) here, where pip reaches the package index:
#   - .device/whl: the wheels the device image lacks (its Python is 3.12; the versions
#     are this checkout's .venv's, the ones the tests ran with);
#   - .device/baseline/src: the src folder of an earlier commit (default 46ce2ee, the
#     code of BENCHMARKS.md's H100 rows), served beside this checkout's in the same run.
# .device/ is kept out of git (.git/info/exclude); the device call carries it.
#
#   bash benchmarks/device/prepare.sh [BASELINE_COMMIT]
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
baseline=${1:-46ce2ee}
python=${PYTHON:-.venv/bin/python}
# the serving stack's packages that the device image (KINDS.md's list) does not hold
packages=(fastapi starlette uvicorn httptools pydantic pydantic-core annotated-types
  typing-inspection opentelemetry-api)
pins=()
for name in "${packages[@]}"; do
  pins+=("$name==$("$python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
done
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qsx '/.device/' "$exclude" || echo '/.device/' >>"$exclude"
rm -rf .device
mkdir -p .device/whl .device/baseline
platforms=()
for n in 28 27 24 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
if ! "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 \
  -d .device/whl "${pins[@]}" >.device/pip.log 2>&1; then
  cat .device/pip.log
  exit 1
fi
git archive "$baseline" src | tar -x -C .device/baseline
echo "baseline $(git rev-parse --short "$baseline") in .device/baseline/src"
ls .device/whl
du -sh .device
