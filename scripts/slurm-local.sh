#!/usr/bin/env bash
# A one-node SLURM on localhost for the tests and for trying the kit's batch scripts (docs/cluster.md):
# munged, then slurmctld, then slurmd, all as root, from Debian's slurm-wlm and munge packages
# (`apt-get install -y slurm-wlm munge`). The node's CPUs and memory come from `slurmd -C`.
#
#   scripts/slurm-local.sh up             start it (a no-op when a cluster of ours already runs) and wait until idle
#   scripts/slurm-local.sh up --nodes N   N nodes n1..nN on this one host: one slurmd each (`slurmd -N nI`, port
#                                         17000+I), each with this machine's CPUs; a running cluster of another
#                                         size is restarted as N nodes when its queue is empty
#   scripts/slurm-local.sh down           stop the daemons this script started, drop the job state
#   scripts/slurm-local.sh status         exit 0 when every node answers, 1 otherwise
#
# With N nodes, /etc/hosts gets `127.0.0.1 n1 ... nN` (once): Lightning's SLURMEnvironment makes the first node's
# name the MASTER_ADDR of a multi-node job, so the names must resolve.
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
  local nodes_lines partition slurmd_files
  if [ "$NODES" = 1 ]; then
    nodes_lines="NodeName=localhost CPUs=$cpus RealMemory=$mem State=UNKNOWN"
    partition=localhost
    slurmd_files="SlurmdSpoolDir=$STATE/d
SlurmdPidFile=$STATE/slurmd.pid
SlurmdLogFile=$LOGS/slurmd.log"
  else
    # Every node is this host, reached on its own port; each advertises the whole machine (jobs share its cores).
    nodes_lines=""
    for i in $(seq 1 "$NODES"); do
      nodes_lines+="NodeName=n$i NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((17000 + i)) CPUs=$cpus RealMemory=$mem State=UNKNOWN"$'\n'
      mkdir -p "$STATE/d/n$i"
    done
    nodes_lines=${nodes_lines%$'\n'}
    partition="n[1-$NODES]"
    slurmd_files="SlurmdSpoolDir=$STATE/d/%n
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmdLogFile=$LOGS/slurmd-%n.log"
  fi
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
SlurmctldPidFile=$STATE/slurmctld.pid
$slurmd_files
SlurmctldLogFile=$LOGS/slurmctld.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
KillWait=5
MinJobAge=600
SchedulerParameters=sched_interval=2
DefMemPerCPU=$((mem / cpus))
$nodes_lines
PartitionName=debug Nodes=$partition Default=YES MaxTime=INFINITE State=UP
CONF
}

# The nodes our configuration names (localhost, or n1..nN), one a line.
conf_nodes() {
  [ -f "$CONF" ] && [ "$(head -n1 "$CONF")" = "$MARK" ] || return 0
  sed -n 's/^NodeName=\([^ ]*\) .*/\1/p' "$CONF"
}

# How many of our nodes sinfo reports ready (idle, mixed or allocated).
nodes_ready() {
  local names
  names=$(conf_nodes | paste -sd, -)
  [ -n "$names" ] || { echo 0; return; }
  sinfo -h -N -n "$names" -o "%N %T" 2>/dev/null | awk '$2 ~ /^(idle|mixed|allocated)$/ {print $1}' | sort -u | wc -l
}

# 127.0.0.1 n1 ... nN in /etc/hosts, once (root only; a line naming n1 already there is left alone).
add_hosts() {
  [ "$NODES" -gt 1 ] || return 0
  grep -qE '(^|[[:space:]])n1([[:space:]]|$)' /etc/hosts 2>/dev/null && return 0
  echo "127.0.0.1 $(seq -f 'n%g' -s ' ' 1 "$NODES")" >>/etc/hosts
}

start_slurmds() {
  if [ "$NODES" = 1 ]; then
    pid_alive "$STATE/slurmd.pid" || slurmd -N localhost
    return
  fi
  for i in $(seq 1 "$NODES"); do
    pid_alive "$STATE/slurmd-n$i.pid" || slurmd -N "n$i"
  done
}

up() {
  need
  local running
  running=$(conf_nodes | wc -l)
  if [ "$running" -gt 0 ] && [ "$(nodes_ready)" = "$running" ]; then
    # Ours runs: any size will do for a plain `up`; `--nodes N` wants N.
    if [ -z "$WANT" ] || [ "$running" = "$NODES" ]; then
      return 0
    fi
    if [ -n "$(squeue -h -o %i 2>/dev/null)" ]; then
      die "a $running-node cluster of ours runs with jobs in its queue; not restarting it as $NODES nodes (scancel them, or run down first)"
    fi
    down
  fi
  write_conf
  add_hosts
  mkdir -p /run/munge
  if ! pid_alive /run/munge/munged.pid; then
    munged --force --pid-file=/run/munge/munged.pid
  fi
  pid_alive "$STATE/slurmctld.pid" || slurmctld -i   # -i: ignore state left by an earlier run
  start_slurmds
  for _ in $(seq 1 120); do
    [ "$(nodes_ready)" = "$NODES" ] && return 0
    sleep 0.5
  done
  die "$NODES node(s) did not come up within 60 s; see $LOGS/slurmctld.log and $LOGS/slurmd*.log"
}

down() {
  need
  local pidfile alive
  for pidfile in "$STATE"/slurmd*.pid "$STATE/slurmctld.pid"; do
    if pid_alive "$pidfile"; then
      kill "$(cat "$pidfile")"
    fi
  done
  for _ in $(seq 1 40); do
    alive=""
    for pidfile in "$STATE"/slurmd*.pid "$STATE/slurmctld.pid"; do
      pid_alive "$pidfile" && alive=1
    done
    [ -z "$alive" ] && break
    sleep 0.25
  done
  if pid_alive /run/munge/munged.pid; then kill "$(cat /run/munge/munged.pid)"; fi
  rm -rf "$STATE/ctld" "$STATE/d"
}

status() {
  local names total
  names=$(conf_nodes | paste -sd, -)
  total=$(conf_nodes | wc -l)
  if [ "$total" -gt 0 ] && [ "$(nodes_ready)" = "$total" ]; then
    sinfo -h -N -n "$names" -o "%N: %T" | sort -u
    return 0
  fi
  echo "slurm-local: not running" >&2
  return 1
}

command=${1:-}
shift || true
NODES=1
WANT=""
if [ "${1:-}" = --nodes ]; then
  [[ "${2:-}" =~ ^[1-9][0-9]?$ ]] || { echo "slurm-local: --nodes takes a node count from 1 to 99" >&2; exit 2; }
  NODES=$2 WANT=$2
  shift 2
fi
[ $# = 0 ] || { echo "usage: $0 up [--nodes N]|down|status" >&2; exit 2; }
case "$command" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up [--nodes N]|down|status" >&2; exit 2 ;;
esac
