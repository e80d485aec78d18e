#!/usr/bin/env bash
# Builds distgrad (Release, build/) and runs its main job: a ResNet-18 (width 16) split into two pipeline
# stages on two worker processes, trained on Fashion-MNIST by a driver process over RPC (build/examples/
# rpc_pipeline under the local launcher build/tools/distgrad-run: 4 micro-batches, GPipe, one epoch, one
# thread per process; a few minutes on two cores). It prints throughput, test accuracy and the RPC-overhead
# summary. Extra arguments go to rpc_pipeline (e.g. --schedule 1f1b --micro-batches 8 --limit 5000); the
# number of processes follows --stage-workers (default 2: three processes).
#
#   ./scripts/demo.sh [ARG...]
#
# Environment: DG_JOBS (build jobs, default 2), DG_SKIP_DEPS=1 (do not check/install packages),
# DG_CPU_BIND=0 (leave the stage workers unbound; see below).
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "$0")/common.sh"

# The program this demo runs, and the launcher that starts its processes.
demo_target=rpc_pipeline
launcher_target=distgrad-run
demo_binary="$(dg_preset_dir default)/examples/$demo_target"
launcher_binary="$(dg_preset_dir default)/tools/$launcher_target"

# One process per stage worker plus the driver.
stage_workers=2
args=("$@")
for ((i = 0; i < ${#args[@]}; ++i)); do
  if [[ ${args[i]} == --stage-workers && $((i + 1)) -lt ${#args[@]} ]]; then
    stage_workers=${args[i + 1]}
  fi
done
[[ $stage_workers =~ ^[1-9][0-9]*$ ]] || dg_die "--stage-workers must be a positive integer, got '$stage_workers'"
nproc=$((stage_workers + 1))

dg_deps
dg_configure default
for target in "$demo_target" "$launcher_target"; do
  if ! dg_has_target default "$target"; then
    # Still build what exists, so a broken library shows up as a build error rather than hiding behind this.
    dg_build default
    dg_die "no '$target' target in this checkout, so there is nothing to run"
  fi
done
dg_build default "$demo_target" "$launcher_target"
[[ -x "$demo_binary" ]] || dg_die "the build did not produce $demo_binary"
[[ -x "$launcher_binary" ]] || dg_die "the build did not produce $launcher_binary"

# Note [CPU binding] (tools/distgrad_run.cpp, docs/pipeline.md): the stage workers (ranks 1..S) get equal,
# disjoint shares of the CPUs this script may use, so two stages' compute never shares a CPU while another
# idles; the driver (rank 0) stays unbound. With fewer CPUs than stage workers nothing is bound.
cpu_bind=()
if [[ ${DG_CPU_BIND:-1} != 0 ]]; then
  cpus=()
  IFS=, read -ra ranges <<<"$(awk '/^Cpus_allowed_list:/ {print $2}' /proc/self/status)"
  for range in "${ranges[@]}"; do
    for ((cpu = ${range%-*}; cpu <= ${range#*-}; ++cpu)); do cpus+=("$cpu"); done
  done
  share=$((${#cpus[@]} / stage_workers))
  if ((share >= 1)); then
    for ((rank = 1; rank <= stage_workers; ++rank)); do
      list=$(IFS=,; echo "${cpus[*]:$(((rank - 1) * share)):$share}")
      cpu_bind+=(--cpu-bind "$rank:$list")
    done
  fi
fi

dg_log "run: ${launcher_binary#"$DG_ROOT"/} --nproc $nproc ${cpu_bind[*]} -- ${demo_binary#"$DG_ROOT"/} $*"
cd "$DG_ROOT"
exec "$launcher_binary" --nproc "$nproc" "${cpu_bind[@]}" -- "$demo_binary" "$@"
