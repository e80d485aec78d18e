#!/usr/bin/env bash
# Builds distgrad (Release, build/) and runs its main demo: Fashion-MNIST training of LeNet on this machine
# (build/examples/train_local with its default settings). Extra arguments go to the demo program.
#
#   ./scripts/demo.sh [ARG...]
#
# Environment: DG_JOBS (build jobs, default 2), DG_SKIP_DEPS=1 (do not check/install packages).
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "$0")/common.sh"

# The program this demo runs; later issues replace it with the distributed jobs.
demo_target=train_local
demo_binary="$(dg_preset_dir default)/examples/$demo_target"

dg_deps
dg_configure default
if ! dg_has_target default "$demo_target"; then
  # Still build what exists, so a broken library shows up as a build error rather than hiding behind this.
  dg_build default
  dg_die "no '$demo_target' target: examples/$demo_target.cpp (the Fashion-MNIST LeNet training example)" \
    "is not in this checkout yet, so there is nothing to run"
fi
dg_build default "$demo_target"
[[ -x "$demo_binary" ]] || dg_die "the build did not produce $demo_binary"

dg_log "run: ${demo_binary#"$DG_ROOT"/} $*"
cd "$DG_ROOT"
exec "$demo_binary" "$@"
