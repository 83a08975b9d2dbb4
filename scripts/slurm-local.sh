#!/usr/bin/env bash
# A one-node SLURM on localhost for the tests and for trying the kit's batch scripts (docs/cluster.md):
# munged, then slurmctld, then slurmd, all as root, from Debian's slurm-wlm and munge packages
# (`apt-get install -y slurm-wlm munge`). The node's CPUs and memory come from `slurmd -C`.
#
#   scripts/slurm-local.sh up       start it (a no-op when it already runs) and wait until sinfo says idle
#   scripts/slurm-local.sh down     stop the three daemons this script started, drop the job state
#   scripts/slurm-local.sh status   exit 0 when the node answers, 1 otherwise
#
# It writes /etc/slurm/slurm.conf only when that file is absent or is one it wrote itself (first line
# below): a real cluster's configuration is never touched.
set -euo pipefail

MARK="# written by lmledger scripts/slurm-local.sh"
CONF=/etc/slurm/slurm.conf
STATE=/var/spool/lmledger-slurm
LOGS=/var/log/lmledger-slurm

die() { echo "slurm-local: $*" >&2; exit 1; }

need() {
  [ "$(id -u)" = 0 ] || die "needs root (munged, slurmctld and slurmd run as root here)"
  for tool in munged slurmctld slurmd sinfo; do
    command -v "$tool" >/dev/null || die "$tool not found: apt-get install -y slurm-wlm munge"
  done
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_conf() {
  if [ -f "$CONF" ] && [ "$(head -n1 "$CONF")" != "$MARK" ]; then
    die "$CONF exists and was not written by this script; not touching a real cluster's configuration"
  fi
  # e.g. "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105"
  local probe cpus mem
  probe=$(slurmd -C | head -n1)
  cpus=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$probe")
  mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$probe")
  mkdir -p "$(dirname "$CONF")" "$STATE/ctld" "$STATE/d" "$LOGS"
  # DefMemPerCPU: without it a job that asks no --mem is given the whole node, and array tasks run one at a time.
  # KillWait 5 s: a preempted job's SIGTERM is followed by SIGKILL that much later (SLURM's default is 30 s).
  cat >"$CONF" <<CONF
$MARK
ClusterName=ci
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
ReturnToService=2
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
KillWait=5
MinJobAge=600
SchedulerParameters=sched_interval=2
DefMemPerCPU=$((mem / cpus))
NodeName=localhost CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONF
}

node_state() { sinfo -h -N -n localhost -o %T 2>/dev/null | head -n1; }

up() {
  need
  if [ "$(node_state)" = idle ] || [ "$(node_state)" = mixed ] || [ "$(node_state)" = allocated ]; then
    return 0
  fi
  write_conf
  mkdir -p /run/munge
  if ! pid_alive /run/munge/munged.pid; then
    munged --force --pid-file=/run/munge/munged.pid
  fi
  pid_alive "$STATE/slurmctld.pid" || slurmctld -i   # -i: ignore state left by an earlier run
  pid_alive "$STATE/slurmd.pid" || slurmd -N localhost
  for _ in $(seq 1 120); do
    case "$(node_state)" in
      idle | mixed | allocated) return 0 ;;
    esac
    sleep 0.5
  done
  die "the node did not come up within 60 s; see $LOGS/slurmctld.log and $LOGS/slurmd.log"
}

down() {
  need
  for name in slurmd slurmctld; do
    if pid_alive "$STATE/$name.pid"; then
      kill "$(cat "$STATE/$name.pid")"
    fi
  done
  for _ in $(seq 1 40); do
    pid_alive "$STATE/slurmd.pid" || pid_alive "$STATE/slurmctld.pid" || break
    sleep 0.25
  done
  if pid_alive /run/munge/munged.pid; then kill "$(cat /run/munge/munged.pid)"; fi
  rm -rf "$STATE/ctld" "$STATE/d"
}

status() {
  local state
  state=$(node_state)
  if [ -n "$state" ]; then
    echo "localhost: $state"
    return 0
  fi
  echo "slurm-local: not running" >&2
  return 1
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
