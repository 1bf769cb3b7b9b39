#!/bin/sh
# Runs inside the lab (tests/lab/run.sh restore-stress.sh inflight.py): the
# "restored VMs must never wedge" workload. Per iteration, on the default
# image: boot an original VM, start tests/lab/inflight.py in it (O_DIRECT
# writers with requests in flight, a memory checker, both verifying their
# data), take a full snapshot under that I/O, restore it twice at once (mmap
# and uffd) while the original runs on, check all three make progress with no
# error, then take a diff snapshot of the original and do the same again, and
# finally stop every workload and check every block once more.
#
# Each wait has a lab-time limit (STEP_TIMEOUT); past it the watchdog dumps
# every VM's vCPUs twice, 2 s apart (sprout vm ctl ... vcpus: in KVM_RUN or
# not, KVM_RUN entries, last exit, RIP, RFLAGS.IF, MP state, LAPIC IRR/ISR,
# pending events), the outer kernel's view of every sprout thread (state,
# wchan, CPU time), and says HANG. The host side (tests/lab/bench-restore.sh)
# symbolises the RIPs against the guest kernel.
#
# Environment: ITERATIONS (default 1), GUEST_CPUS (2), GUEST_MIB (256),
# DATA_MIB (4), WRITERS (8), MEM_MIB (16), PASSES (passes each VM must add
# after a restore, default 2), STEP_TIMEOUT (lab seconds, default 400),
# SELFTEST=1 (run the checker's negative control first), CONTROL=1 (the
# control: the same load with no snapshot and no restore, two freshly booted
# VMs, each with its own workload, in place of each pair of restores).
# Prints "result: iteration I ok|errors|hang|failed STEP" per iteration and
# exits 0 only if every iteration was ok.

ITERATIONS=${ITERATIONS:-1}
GUEST_CPUS=${GUEST_CPUS:-2}
GUEST_MIB=${GUEST_MIB:-256}
DATA_MIB=${DATA_MIB:-4}
WRITERS=${WRITERS:-8}
MEM_MIB=${MEM_MIB:-16}
PASSES=${PASSES:-2}
STEP_TIMEOUT=${STEP_TIMEOUT:-400}
W=/workspace/w

say() { echo "step: $(date +%T) $*"; }
# The outer VM's free memory and tmpfs use (the VMs, their disks and snapshots
# all live in its 2 GiB).
mem() { echo "memory: $(awk '/MemAvailable|Shmem:/ {printf "%s %d MiB ", $1, $2 / 1024}' /proc/meminfo)"; }

socks=""
pids=""

dump() {
  echo "=== HANG in iteration $it: $1 (after ${STEP_TIMEOUT} s lab time) ==="
  for round in 1 2; do
    for s in $socks; do
      echo "--- vcpus of $s (round $round)"
      timeout -s KILL 30 sprout vm ctl --api-sock "$s" vcpus 2>&1
    done
    echo "--- outer kernel: sprout threads (round $round)"
    for t in /proc/[0-9]*/task/[0-9]*; do
      case "$(cat "$t/comm" 2>/dev/null)" in
        sprout*)
          # state, utime+stime (ticks), last CPU
          st=$(cut -d' ' -f3,14,15,39 "$t/stat" 2>/dev/null)
          echo "$t $(cat "$t/comm") [$st] wchan=$(cat "$t/wchan" 2>/dev/null)"
          ;;
      esac
    done
    cat /proc/loadavg
    [ "$round" = 1 ] && sleep 2
  done
  for s in $socks; do
    c=${s%.sock}.console
    echo "--- console of ${s%.sock} (tail)"
    tail -n 15 "$c" 2>/dev/null
  done
}

# Runs "$@" (a program, not a function) under the step limit; on a timeout, dumps and returns 124.
# Status 1 is "data errors" only if the checker said so (errors=N, N > 0, in
# its status line): a VM that is gone (its sprout cannot connect) also makes
# sprout vm exec exit 1, and is a failure (3), not a data error.
step() {
  what=$1
  shift
  timeout -s KILL "$STEP_TIMEOUT" "$@" >/tmp/step.out 2>&1
  rc=$?
  cat /tmp/step.out
  # A running VM whose agent stopped answering (sprout gives up after 180 s)
  # is a hang too: dump it while it is still there.
  if [ "$rc" = 137 ] || [ "$rc" = 124 ] || grep -q 'agent did not answer' /tmp/step.out; then
    dump "$what"
    return 124
  fi
  if [ "$rc" = 1 ] && ! grep -q 'errors=[1-9]' /tmp/step.out; then
    return 3
  fi
  return "$rc"
}

wait_ctl() {
  i=0
  until sprout vm ctl --api-sock "$1" status >/dev/null 2>&1; do
    i=$((i + 1))
    [ "$i" -gt 3000 ] && return 1
    sleep 0.1
  done
}

ex() {
  sock=$1
  shift
  sprout vm exec --api-sock "$sock" --exec "$*"
}

stop_all() {
  for s in $socks; do
    timeout -s KILL 60 sprout vm ctl --api-sock "$s" stop >/dev/null 2>&1
  done
  for p in $pids; do
    kill -9 "$p" 2>/dev/null
  done
  wait 2>/dev/null
  socks=""
  pids=""
}

# boot_vm NAME: boots a VM of the default image with a data disk of its own.
boot_vm() {
  sprout vm run --image default --cpus "$GUEST_CPUS" --memory-mib "$GUEST_MIB" \
    --disk "/tmp/$1.ext4" --api-sock "/tmp/$1.sock" >"/tmp/$1.console" 2>&1 &
  pids="$pids $!"
  socks="$socks /tmp/$1.sock"
}

# ctl_up NAME: the VM's control socket answers (else its console's tail).
ctl_up() {
  wait_ctl "/tmp/$1.sock" || { echo "no control socket for $1"; tail -n 30 "/tmp/$1.console"; return 3; }
}

# vm_up NAME: a booted VM's control socket is there, its agent answers, and it
# has the checker (inflight.py).
vm_up() {
  ctl_up "$1" || return $?
  step "$1: the agent answers" sprout vm exec --api-sock "/tmp/$1.sock" \
    --put /lab/inflight.py:inflight.py --exec 'echo agent: up'
}

# start_workload NAME: starts inflight.py's writers and memory checker.
start_workload() {
  step "$1: start the workload" sprout vm exec --api-sock "/tmp/$1.sock" --exec \
    "python3 /workspace/inflight.py start $W --mib $DATA_MIB --threads $WRITERS --mem-mib $MEM_MIB"
}

# restore NAME SNAPSHOT BACKEND
restore() {
  sprout vm restore "$2" --memory-backend "$3" --api-sock "/tmp/$1.sock" >"/tmp/$1.console" 2>&1 &
  pids="$pids $!"
  socks="$socks /tmp/$1.sock"
}

# entries NAME VCPU FILE: that vCPU's KVM_RUN entries in a saved "vcpus" dump.
entries() {
  sed -n "s/^vcpu$2 in_kvm_run=[a-z]* entries=\([0-9]*\) .*/\1/p" "$3"
}

# check NAME: the restored (or original) VM's workload adds PASSES passes,
# error-free, and every one of its vCPUs entered KVM_RUN again meanwhile.
check() {
  say "$1: check"
  timeout -s KILL 60 sprout vm ctl --api-sock "/tmp/$1.sock" vcpus >"/tmp/$1.vcpus-a" ||
    { echo "cannot inspect $1"; return 3; }
  step "$1: the workload progresses" sprout vm exec --api-sock "/tmp/$1.sock" --exec \
    "python3 /workspace/inflight.py wait $W --more $PASSES --timeout $STEP_TIMEOUT" || return $?
  timeout -s KILL 60 sprout vm ctl --api-sock "/tmp/$1.sock" vcpus >"/tmp/$1.vcpus-b" ||
    { echo "cannot inspect $1"; return 3; }
  ran=""
  for i in $(seq 0 $((GUEST_CPUS - 1))); do
    ea=$(entries "$1" "$i" "/tmp/$1.vcpus-a")
    eb=$(entries "$1" "$i" "/tmp/$1.vcpus-b")
    if [ -z "$ea" ] || [ -z "$eb" ] || [ "$eb" -le "$ea" ]; then
      echo "vCPU $i of $1 did not run between two inspections ($ea -> $eb):"
      cat "/tmp/$1.vcpus-a" "/tmp/$1.vcpus-b"
      return 4
    fi
    ran="$ran vcpu$i:$ea->$eb"
  done
  echo "vcpus-ran: $1$ran"
}

iteration() {
  rm -rf /tmp/*.ext4 /tmp/snap-* /tmp/*.sock /tmp/*.console
  say "boot the original ($GUEST_CPUS vCPUs)"
  boot_vm orig
  vm_up orig || return $?
  if [ "$it" = 1 ]; then
    # Whether the guest kernel uses paravirtual spinlocks (it needs
    # KVM_FEATURE_PV_UNHALT from the lab's KVM).
    ex /tmp/orig.sock 'dmesg | grep -i spinlock' || true
  fi
  if [ "${SELFTEST:-0}" = 1 ] && [ "$it" = 1 ]; then
    # The checker's negative control: it must find the two bad blocks.
    step "selftest" sprout vm exec --api-sock /tmp/orig.sock --exec \
      "python3 /workspace/inflight.py selftest /workspace/selftest" || return $?
  fi
  say "start the workload"
  start_workload orig || return $?
  for kind in full diff; do
    if [ "${CONTROL:-0}" = 1 ]; then
      a=c-$kind-1 b=c-$kind-2
      say "control: boot two VMs beside the original (no snapshot, no restore)"
      boot_vm "$a"
      boot_vm "$b"
      for n in "$a" "$b"; do
        vm_up "$n" || return $?
        start_workload "$n" || return $?
      done
    else
      a=r-$kind-mmap b=r-$kind-uffd
      ex /tmp/orig.sock 'echo "inflight requests at snapshot: $(cat /sys/block/vdb/inflight)"'
      say "$kind snapshot of the running original under I/O"
      flag=
      [ "$kind" = diff ] && flag=--diff
      step "$kind snapshot" sprout vm snapshot --api-sock /tmp/orig.sock $flag --out "/tmp/snap-$kind" || return $?
      say "restore it twice at once (mmap, uffd) beside the original"
      restore "$a" "/tmp/snap-$kind" mmap
      restore "$b" "/tmp/snap-$kind" uffd
      for n in "$a" "$b"; do
        ctl_up "$n" || return $?
      done
    fi
    for n in orig "$a" "$b"; do
      check "$n" || return $?
    done
    mem
    if [ "$kind" = full ]; then
      # The diff restores' memory comes from the full layer too.
      for n in "$a" "$b"; do
        say "stop the workload in $n and check every block"
        step "$n: stop and final check" sprout vm exec --api-sock "/tmp/$n.sock" --exec "python3 /workspace/inflight.py stop $W" || return $?
        timeout -s KILL 60 sprout vm ctl --api-sock "/tmp/$n.sock" stop >/dev/null 2>&1
        socks=$(echo "$socks" | sed "s| /tmp/$n.sock||")
      done
    fi
  done
  for n in orig "$a" "$b"; do
    say "stop the workload in $n and check every block"
    step "$n: stop and final check" sprout vm exec --api-sock "/tmp/$n.sock" --exec "python3 /workspace/inflight.py stop $W" || return $?
  done
  return 0
}

failed=0
it=1
while [ "$it" -le "$ITERATIONS" ]; do
  echo "=== iteration $it of $ITERATIONS ==="
  start=$(date +%s)
  iteration
  rc=$?
  case "$rc" in
    0) r=ok ;;
    124) r=hang ;;
    1) r=errors ;;
    *) r="failed $rc" ;;
  esac
  if [ "$rc" != 0 ] && [ "$rc" != 124 ]; then
    # What each VM's sprout said (a VM that ended tells why here).
    for c in /tmp/*.console; do
      echo "--- $c (tail)"
      # (the guest kernel's last words too: a panic, an oops)
      tail -n 40 "$c"
    done
    # The outer kernel's word (an OOM kill, a KVM warning) and its memory.
    echo "--- outer kernel log (tail)"
    dmesg | tail -n 25
  fi
  mem
  echo "result: iteration $it $r $(( $(date +%s) - start )) s"
  [ "$rc" = 0 ] || failed=$((failed + 1))
  stop_all
  it=$((it + 1))
done
echo "iterations: $ITERATIONS failed: $failed"
[ "$failed" = 0 ]
