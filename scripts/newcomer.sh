#!/usr/bin/env bash
# What a newcomer meets first, checked where the test suite cannot see it (its venv holds
# every extra): a fresh clone of this commit, a fresh .venv, `make demo`; then, in that
# venv (the demo's extras only), commands whose extra it lacks must name the extra and the
# pip line, never an internal error. .ci/run runs this before `make test`.
#
#   bash scripts/newcomer.sh            # clones HEAD into a temporary folder, removed after
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git clone --quiet "$root" "$work/tpupod"
cd "$work/tpupod"
# No venv of the caller's may leak in: the demo's .venv is made from nothing.
unset VIRTUAL_ENV PYTHONPATH
export TPUPOD_HOME="$work/home"

echo "newcomer: make demo in a fresh clone ($(git log -1 --format=%h))"
make demo

# The README's first install line: the core alone, in a venv of its own.
python3 -m venv "$work/core"
"$work/core/bin/pip" install -q -e .

expect_extra() { # VENV EXTRA ARGS...: tpupod ARGS fails at once, naming EXTRA and its pip line
  local venv=$1 extra=$2
  shift 2
  local out rc=0
  out=$(timeout 60 "$venv/bin/tpupod" "$@" 2>&1) || rc=$?
  if [ "$rc" -ne 1 ] || ! grep -q "needs the $extra extra" <<<"$out" ||
    ! grep -q "hint: pip install 'tpupod\[$extra\]'" <<<"$out"; then
    echo "newcomer: 'tpupod $*' (exit $rc) did not name the $extra extra:" >&2
    echo "$out" >&2
    exit 1
  fi
  echo "newcomer: tpupod $*: $(head -1 <<<"$out")"
}
# the demo's venv: jax, model, serve
expect_extra .venv jobs jobs ls
expect_extra .venv jobs jobs submit -- echo hi
expect_extra .venv dashboard dashboard --port 0
expect_extra .venv checkpoint-bench bench checkpoint -c examples/bench_checkpoint.yaml
# the core alone: a local pod works; what needs an extra says which
"$work/core/bin/tpupod" up --name core --local 2
"$work/core/bin/tpupod" exec --pod core -- true
expect_extra "$work/core" serve serve up --pod core --model tests/fixtures/qwen2-tiny
expect_extra "$work/core" model extract --pod core --model tests/fixtures/qwen2-tiny \
  --data examples/arc_tasks.json --layers 1 --out "$work/acts"
"$work/core/bin/tpupod" down --pod core
echo "newcomer: done"
