#!/usr/bin/env bash
# Runs every fuzz target for a short time (default 30 s each, as many at once as there
# are cores) from its seed corpus in
# fuzz/corpus/<target>/ and fails if any target crashes, leaks or times out.
#
#   fuzz/smoke.sh [SECONDS] [TARGET...]
#
# Needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`). New inputs
# found during the run go to a temporary directory, so the seed corpus in the repo stays
# small; a crashing input is kept under fuzz/artifacts/<target>/.
set -uo pipefail
cd "$(dirname "$0")"

secs="${1:-30}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(agent_frame virtqueue_chain blk_request vsock_packet worker_frame state_blob manifest layer_map mmio_transport http_api store_objects)
fi

if ! rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  echo "fuzz smoke: the nightly Rust toolchain is missing (rustup toolchain install nightly); cargo fuzz needs it" >&2
  exit 1
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  echo "fuzz smoke: cargo-fuzz is missing (cargo install cargo-fuzz)" >&2
  exit 1
fi

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
failed=()
# All targets in one build (they share every dependency), then run as many
# at once as there are cores: each libFuzzer run is one busy thread.
echo "== fuzz: building ${targets[*]}"
built=()
for t in "${targets[@]}"; do
  if cargo +nightly fuzz build --release "$t"; then
    built+=("$t")
  else
    echo "fuzz smoke: cannot build $t" >&2
    failed+=("$t (build)")
  fi
done
jobs=$(nproc 2>/dev/null || echo 1)
run_one() {
  local t=$1
  mkdir -p "$scratch/$t" "artifacts/$t"
  if cargo +nightly fuzz run --release "$t" "$scratch/$t" "corpus/$t" -- \
      -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
      -artifact_prefix="artifacts/$t/" -print_final_stats=1 2>"$scratch/$t.log"; then
    touch "$scratch/$t.ok"
  fi
}
running=0
for t in "${built[@]}"; do
  echo "== fuzz $t for ${secs}s"
  run_one "$t" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then
    wait -n || true
    running=$((running - 1))
  fi
done
wait
for t in "${built[@]}"; do
  if [ -e "$scratch/$t.ok" ]; then
    grep -E '^#[0-9]+' "$scratch/$t.log" | tail -n 1 | sed "s/^/  $t /"
    grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb)' "$scratch/$t.log" | sed "s/^/  $t /"
  else
    tail -n 60 "$scratch/$t.log" >&2
    echo "fuzz smoke: $t FAILED (input saved under fuzz/artifacts/$t/)" >&2
    failed+=("$t")
  fi
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz smoke: failures: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz smoke: all ${#targets[@]} targets ran ${secs}s without a crash"
