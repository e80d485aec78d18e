#!/usr/bin/env bash
# The issue's target for the synchronous parameter server: with 2 trainers it reaches the single worker's final
# test accuracy within MAX_GAP (1 point = 0.01) after the same number of samples, with the same model, seed,
# learning rate and samples per step (trainer batch = GLOBAL_BATCH / 2). Both runs must also really train
# (test accuracy >= MIN_ACCURACY).
#   check_parameter_server_target.sh DISTGRAD_RUN PARAMETER_SERVER GLOBAL_BATCH MAX_GAP MIN_ACCURACY [ARGS...]
# ARGS (e.g. --epochs 3 --lr 2e-3) go to both runs.
set -euo pipefail
launcher=$1 binary=$2 batch=$3 max_gap=$4 min_accuracy=$5
shift 5
(( batch % 2 == 0 )) || { echo "GLOBAL_BATCH must be even"; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT
field() { grep -o "\"$2\":[0-9.eE+-]*" "$1" | tail -n 1 | cut -d: -f2; }

echo "== single worker, batch $batch"
"$here/check_example.sh" --expect mode=local parameter_server "$min_accuracy" -- \
  "$binary" --mode local --batch-size "$batch" "$@" |
  tee "$workdir/local.txt"
echo "== synchronous parameter server, 2 trainers, batch $((batch / 2)) each"
"$here/check_example.sh" --expect mode=ps_ssgd --expect trainers=2 parameter_server "$min_accuracy" -- \
  "$launcher" --nproc 3 -- "$binary" --mode ssgd --batch-size $((batch / 2)) "$@" | tee "$workdir/ssgd.txt"

for key in steps train_images epochs; do  # the same optimizer steps over the same samples
  [[ "$(field "$workdir/local.txt" $key)" == "$(field "$workdir/ssgd.txt" $key)" ]] ||
    { echo "FAIL: $key differs: $(field "$workdir/local.txt" $key) vs $(field "$workdir/ssgd.txt" $key)"; exit 1; }
done
local_acc=$(field "$workdir/local.txt" test_accuracy)
ssgd_acc=$(field "$workdir/ssgd.txt" test_accuracy)
awk -v a="$local_acc" -v b="$ssgd_acc" -v g="$max_gap" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= g) }' ||
  { echo "FAIL: ssgd test accuracy $ssgd_acc vs single worker $local_acc: gap above $max_gap"; exit 1; }
echo "OK: ssgd (2 trainers) test accuracy $ssgd_acc, single worker $local_acc: gap within $max_gap"
