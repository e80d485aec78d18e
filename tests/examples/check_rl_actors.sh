#!/usr/bin/env bash
# Runs rl_actors and checks what a reinforcement-learning run can promise: exit status 0, the final JSON
# line {"example":"rl_actors",...} (directly or as rank 0's "[0] {...}" line under distgrad-run), and that
# the policy learned: the mean reward of the last 10 episodes is at least FACTOR times that of the first 10.
# With --solved the run must also have reached its reward threshold (the JSON's "solved":true).
#
#   check_rl_actors.sh [--solved] FACTOR -- COMMAND [ARGS...]
#
#   check_rl_actors.sh 1.5 -- build/tools/distgrad-run --nproc 3 -- build/examples/rl_actors --episodes 50
set -euo pipefail

usage() {
  sed -n '2,10p' "$0" >&2
  exit 2
}
solved=0
if [[ ${1-} == --solved ]]; then
  solved=1
  shift
fi
[[ $# -ge 3 && $2 == -- ]] || usage
factor=$1
shift 2

workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT
set +e
"$@" | tee "$workdir/out.txt"
status=${PIPESTATUS[0]}
set -e
[[ $status -eq 0 ]] || { echo "FAIL: rl_actors exited with status $status"; exit 1; }
json=$(grep -E '^(\[0\] )?\{"example":"rl_actors"' "$workdir/out.txt" | tail -n 1 | sed -E 's/^\[0\] //') || true
[[ -n "$json" ]] || { echo 'FAIL: no JSON line {"example":"rl_actors",...} in the output'; exit 1; }

field() { sed -nE 's/.*[{,]"'"$1"'":("[^"]*"|[^,}]*).*/\1/p' <<<"$json" | tr -d '"'; }
for key in mode observers episodes running_reward solved steps_per_s peak_rss_mib peak_rss_mib_max \
           rpc_overhead_share first10_reward last10_reward; do
  [[ -n "$(field "$key")" ]] || { echo "FAIL: the JSON line has no $key: $json"; exit 1; }
done
[[ "$(field mode)" == rl_actors ]] || { echo "FAIL: mode is '$(field mode)', expected rl_actors"; exit 1; }
first=$(field first10_reward)
last=$(field last10_reward)
awk -v f="$first" -v l="$last" -v k="$factor" 'BEGIN { exit !(l + 0 >= k * f) }' ||
  { echo "FAIL: the last 10 episodes' mean reward $last is not >= $factor x the first 10's ($first)"; exit 1; }
if [[ $solved -eq 1 && "$(field solved)" != true ]]; then
  echo "FAIL: not solved: running reward $(field running_reward) < $(field reward_threshold)"
  exit 1
fi
echo "OK: rl_actors mean reward $first (first 10 episodes) -> $last (last 10), solved: $(field solved)"
