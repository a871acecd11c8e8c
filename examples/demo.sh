#!/usr/bin/env bash
# The tpupod demo (make demo): a local pod of 2 workers with 2 devices each,
# the worker list, a command on every worker, a failure and its summary, a
# lockstep JAX program across the workers, a serving fleet (fanout, a streamed
# chat with the openai client), teardown; then, as root, an SSH pod
# of simulated hosts.
# It uses a state directory of its own, so it never touches your pods; with
# TPUPOD_HOME set it uses that one and leaves it as it found it: its pods get
# names none of yours has, and its scratch files go to a folder of its own.
set -euo pipefail

scratch=$(mktemp -d)
if [ -z "${TPUPOD_HOME:-}" ]; then
  export TPUPOD_HOME="$scratch/tpupod"
fi
home_was_there=$([ -d "$TPUPOD_HOME" ] && echo 1 || true)
home_had=$(ls -A "$TPUPOD_HOME" 2>/dev/null || true)  # what a tpupod command may add: pods/
unused_name() {  # $1, or $1-2, $1-3, ...: a pod name not in use in this state directory
  local name=$1 n=1
  while tpupod hosts --pod "$name" >/dev/null 2>&1; do n=$((n + 1)); name="$1-$n"; done
  echo "$name"
}
POD=$(unused_name demo)
LAB=$(unused_name lab)
made=()  # the pods this demo brought up: the only ones it takes down

if [ -t 1 ]; then B=$'\033[1m' D=$'\033[2m' N=$'\033[0m'; else B= D= N=; fi
say() { printf '\n%s# %s%s\n' "$B" "$*" "$N"; }
show() { printf '%s$ %s%s\n' "$D" "$*" "$N"; }
run() { show "$*"; "$@"; }
cleanup() {
  for pod in ${made[@]+"${made[@]}"}; do tpupod down --pod "$pod" >/dev/null 2>&1 || true; done
  if [ -n "${sim_pid:-}" ]; then kill "$sim_pid" 2>/dev/null || true; wait "$sim_pid" 2>/dev/null || true; fi
  # folders tpupod made in a state directory that had none (pods/): empty again, removed
  for entry in "$TPUPOD_HOME"/* "$TPUPOD_HOME"/.[!.]*; do
    if [ -d "$entry" ] && ! grep -qxF "$(basename "$entry")" <<<"$home_had"; then
      rmdir "$entry" 2>/dev/null || true
    fi
  done
  [ -n "$home_was_there" ] || rmdir "$TPUPOD_HOME" 2>/dev/null || true
  rm -rf "$scratch"
}
trap cleanup EXIT

say "Bring up a local pod: 2 simulated hosts, 2 CPU devices each"
made+=("$POD")
run tpupod up --name "$POD" --local 2 --devices-per-worker 2

say "Which workers does it have? (nothing is contacted)"
run tpupod hosts --pod "$POD"

say "Every worker prints who it is; output streams with a [wN] prefix"
run tpupod exec --pod "$POD" -- \
  'echo "worker $TPUPOD_WORKER_ID of $TPUPOD_NUM_WORKERS, peers $TPUPOD_WORKER_HOSTNAMES, JAX_NUM_CPU_DEVICES=$JAX_NUM_CPU_DEVICES, in $PWD"'

say "Worker 1 fails; --on-fail kill stops worker 0 at once and the summary names w1"
cmd='if [ "$TPUPOD_WORKER_ID" = 1 ]; then echo "disk full" >&2; exit 3; fi; echo working; sleep 30'
show "tpupod exec --pod $POD --on-fail kill --grace 1 -- '$cmd'"
rc=0
tpupod exec --pod "$POD" --on-fail kill --grace 1 -- "$cmd" || rc=$?
if [ "$rc" -ne 3 ]; then
  echo "demo: expected exit code 3 from the failing worker, got $rc" >&2
  exit 1
fi
echo "(exit code $rc: worker 1's)"

say "A lockstep JAX program: every worker calls tpupod.init_jax(), then a cross-host sum"
run tpupod run --pod "$POD" -- python "$PWD/examples/lockstep_sum.py"
run tpupod logs --pod "$POD" --worker 1

say "Serve a model: 2 servers per worker, an agent on each worker, one router in front"
tiny="$(cd "$(dirname "$0")/.." && pwd)/tests/fixtures/qwen2-tiny"
# serve up's default ports (31000 on) may be another user's fleet on a shared machine: the
# demo takes the first free range of 10 from there
base=$(python -c '
import socket
for base in range(31000, 40000, 10):
    try:
        for port in range(base, base + 10):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
    except OSError:
        continue
    print(base)
    break
')
if python -c 'import tpupod.serve.builtin.server' 2>/dev/null; then
  run tpupod serve up --pod "$POD" --model "$tiny" --servers-per-worker 2 --dtype float32 \
    --base-port "$base" --startup-timeout 300 -- --max-batch 4 --max-length 128
else  # the builtin server is not in this tree yet: a stub OpenAI server stands in
  stub="$(cd "$(dirname "$0")/.." && pwd)/tests/serve_stub.py"
  run tpupod serve up --pod "$POD" --model qwen2-tiny --servers-per-worker 2 --backend command \
    --base-port "$base" --command "{python} $stub --host {host} --port {port} --model {model}"
fi
run tpupod serve status --pod "$POD"

say "Fan one prompt out to every server at once (seed 000's check: a status=200 line each; the tiny checkpoint's weights are random, so its words are noise)"
run tpupod fanout --pod "$POD" --prompt '你是谁' --max-tokens 8

say "Point the OpenAI client at the fleet and stream one chat through the router"
show 'eval "$(tpupod serve endpoint)"'
eval "$(tpupod serve endpoint --pod "$POD")"
show "python -c 'openai.OpenAI().chat.completions.create(..., stream=True)'"
python - <<'PY'
import openai

client = openai.OpenAI()
model = client.models.list().data[0].id
stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "你是谁"}], max_tokens=16, stream=True
)
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
PY
run tpupod serve down --pod "$POD"

say "Tear the pod down"
run tpupod down --pod "$POD"

if [ "$(id -u)" != 0 ]; then
  say "Skipping the SSH part: simulated hosts are network namespaces running sshd, which needs root"
  exit 0
fi
# openssh-server, iproute2, util-linux, git: installed when missing (as make test does)
bash "$(dirname "$0")/../scripts/test-prereqs.sh"
if [ ! -x /usr/sbin/sshd ] || ! command -v ip >/dev/null || ! command -v unshare >/dev/null; then
  say "Skipping the SSH part: it needs openssh-server, iproute2 and util-linux"
  exit 0
fi

say "An SSH pod: 2 simulated hosts, each a network namespace running real sshd"
sim_out="$scratch/sim.json"
python -m tpupod.sim --hosts 2 >"$sim_out" &
sim_pid=$!
for _ in $(seq 100); do [ -s "$sim_out" ] && break; sleep 0.1; done
hosts=$(python -c 'import json,sys; print(",".join("root@" + h["address"] for h in json.load(open(sys.argv[1]))["hosts"]))' "$sim_out")
key=$(python -c 'import json,sys; print(json.load(open(sys.argv[1]))["key"])' "$sim_out")
made+=("$LAB")
run tpupod up --name "$LAB" --ssh "$hosts" --key "$key"
run tpupod hosts --pod "$LAB"

say "The same commands work over SSH; connections stay open between calls"
run tpupod exec --pod "$LAB" -- 'echo "$(hostname) is worker $TPUPOD_WORKER_ID of $TPUPOD_NUM_WORKERS"'

say "Ship this repository's HEAD to every host (no git server needed) and check they agree"
run tpupod sync --pod "$LAB" --from-local --dir tpupod-code
run tpupod exec --pod "$LAB" -- 'git -C tpupod-code log -1 --format="%h %s"'

say "Collect a file from every host"
run tpupod get --pod "$LAB" tpupod-code/README.md "$scratch/collected"
ls "$scratch/collected"/*

run tpupod down --pod "$LAB"

say "Done."
