#!/usr/bin/env bash
# A trainer that dies must make the parameter server fail with a clear error, not hang. Starts a server and
# two trainers by hand (the environment of torchrun/srun; distgrad-run would itself stop the job when a worker
# dies, hiding whether the server notices), kills trainer 2 with SIGKILL once the first epoch is done, and
# checks that the server exits 1 naming worker2, and that trainer 1 exits non-zero too, both within a bound.
#   check_parameter_server_fault.sh PARAMETER_SERVER MODE [ARGS...]
set -uo pipefail
binary=$1 mode=$2
shift 2
workdir=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null; done
  rm -rf "$workdir"
}
trap cleanup EXIT
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' \
       2>/dev/null || echo $((20000 + RANDOM % 20000)))
for rank in 0 1 2; do
  RANK=$rank WORLD_SIZE=3 LOCAL_RANK=$rank MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    "$binary" --mode "$mode" --epochs 100000 "$@" >"$workdir/out$rank.txt" 2>&1 </dev/null &
  pids+=($!)
done
# Wait (at most 60 s) until the server has finished an epoch: training is under way on both trainers.
for _ in $(seq 600); do
  grep -q '^epoch 1/' "$workdir/out0.txt" && break
  kill -0 "${pids[0]}" 2>/dev/null || break
  sleep 0.1
done
grep -q '^epoch 1/' "$workdir/out0.txt" || { echo "FAIL: no epoch finished"; cat "$workdir"/out*.txt; exit 1; }
kill -9 "${pids[2]}"
echo "killed trainer 2 (pid ${pids[2]})"
status=
# Waits at most 30 s for pid $1; sets status to its exit status, or "hung" (then kills it). Polls instead of
# running a watchdog subshell: a subshell killed before it gets going runs this script's EXIT trap, which
# deleted the output files under load (bash reaps exited children itself, so kill -0 fails once $1 is done).
wait_for() {
  for _ in $(seq 300); do
    kill -0 "$1" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$1" 2>/dev/null; then
    kill -9 "$1"
    wait "$1"
    status=hung
  else
    wait "$1"
    status=$?
  fi
}
wait_for "${pids[0]}"
server_status=$status
wait_for "${pids[1]}"
trainer_status=$status
echo "--- server"; tail -n 5 "$workdir/out0.txt"
echo "--- trainer 1"; tail -n 3 "$workdir/out1.txt"
[[ "$server_status" == 1 ]] || { echo "FAIL: server exit status $server_status, expected 1"; exit 1; }
grep -q 'error: .*trainer worker2 left the job' "$workdir/out0.txt" ||
  { echo "FAIL: the server's error does not name the dead trainer"; exit 1; }
[[ "$trainer_status" != hung && "$trainer_status" != 0 ]] ||
  { echo "FAIL: trainer 1 exit status $trainer_status, expected a failure"; exit 1; }
echo "OK: $mode: the server failed with a clear error and trainer 1 stopped (status $trainer_status)"
