#!/usr/bin/env bash
# Runs parameter_server (directly or through distgrad-run) and checks its contract: exit 0, a final JSON line
# from the server (the launcher's "[0] " prefix is allowed) with every field the example promises, sane
# values, and test_accuracy >= MIN_ACCURACY.
#   check_parameter_server.sh MIN_ACCURACY COMMAND [ARGS...]
set -euo pipefail
min_accuracy=$1
shift
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$@" | tee "$out"
json=$(grep -E '^(\[0\] )?\{"example":"parameter_server"' "$out" | tail -n 1 | sed 's/^\[0\] //')
[[ -n "$json" ]] || { echo "FAIL: no parameter_server JSON line"; exit 1; }
last=$(tail -n 1 "$out" | sed 's/^\[[0-9]*\] //')
[[ "$last" == "$json" ]] || echo "note: the JSON line is not the last line (other ranks printed after it)"
field() { sed -n "s/.*\"$1\":\([^,}]*\).*/\1/p" <<<"$json"; }
for key in mode workers trainers model epochs batch_size train_images images_per_s test_accuracy peak_rss_mib \
           peak_rss_mib_max rpc_overhead_share staleness_mean staleness_max; do
  [[ -n "$(field "$key")" ]] || { echo "FAIL: JSON lacks \"$key\": $json"; exit 1; }
done
mode=$(field mode | tr -d '"')
check() {  # check DESCRIPTION AWK-CONDITION (fields as variables)
  awk -v acc="$(field test_accuracy)" -v ips="$(field images_per_s)" -v rss="$(field peak_rss_mib)" \
      -v rssmax="$(field peak_rss_mib_max)" -v share="$(field rpc_overhead_share)" \
      -v smean="$(field staleness_mean)" -v smax="$(field staleness_max)" -v min="$min_accuracy" \
      -v workers="$(field workers)" -v trainers="$(field trainers)" "BEGIN { exit !($2) }" ||
    { echo "FAIL: $1: $json"; exit 1; }
}
check "test accuracy below $min_accuracy" 'acc >= min && acc <= 1'
check "images/s not positive" 'ips > 0'
check "peak RSS figures inconsistent" 'rss > 0 && rssmax >= rss'
check "rpc_overhead_share outside [0, 1)" 'share >= 0 && share < 1'
case "$mode" in
  ps_ssgd)
    check "ssgd: workers != trainers + 1 or staleness != 0" 'workers == trainers + 1 && smean == 0 && smax == 0'
    check "ssgd: no RPC time measured" 'share > 0' ;;
  ps_asgd)
    check "asgd: workers != trainers + 1 or staleness inconsistent" 'workers == trainers + 1 && smean >= 0 && smax >= smean'
    check "asgd: no RPC time measured" 'share > 0'
    # With several trainers, someone's gradients must have been applied after another trainer's step.
    check "asgd: several trainers but no staleness measured" 'trainers == 1 || smax >= 1' ;;
  local) check "local: not one worker" 'workers == 1 && trainers == 1 && share == 0' ;;
  *) echo "FAIL: unknown mode $mode"; exit 1 ;;
esac
echo "OK: $mode test accuracy $(field test_accuracy) >= $min_accuracy, $(field images_per_s) images/s"
