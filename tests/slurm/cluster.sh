#!/usr/bin/env bash
# make test-slurm: a real two-node Slurm cluster on this machine, then the Slurm tests against it.
#
# Installs what is missing from Debian (slurmctld, slurmd, slurm-client, munge), then starts, all
# on 127.0.0.1 with free ports and one temporary state folder: a munged of its own (its own key and
# socket), one slurmctld and two slurmd (n1 at 127.0.0.1, n2 at 127.0.0.2: `slurmd -N`; two
# addresses, as two hosts have, which torchrun's rendezvous tells nodes apart by when the sandbox
# gives every node's torchrun the same pid). Every Slurm command the tests run
# (sbatch, squeue, scancel, scontrol) finds this cluster through SLURM_CONF. Runs
# `pytest -m slurm tests/slurm` (extra arguments are passed on to pytest) and stops every process
# it started, whatever happened; KEEP_SLURM_STATE=1 keeps the state folder (logs) afterwards.
#
# `tests/slurm/cluster.sh --up` only starts the cluster and prints the SLURM_CONF to export (the
# processes then stay up; `kill` the pids in <state>/pids to stop them).
set -euo pipefail
cd "$(dirname "$0")/../.."

SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
need=()
command -v slurmctld >/dev/null || need+=(slurmctld)
command -v slurmd >/dev/null || need+=(slurmd)
command -v sbatch >/dev/null || need+=(slurm-client)
command -v munged >/dev/null || need+=(munge)
if [ ${#need[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
if [ "$(id -u)" != 0 ]; then
  # slurmd starts each job's processes as the submitting user: only root may do that
  echo "make test-slurm runs slurmd, which needs root (this is uid $(id -u))" >&2
  exit 1
fi

state=$(mktemp -d /tmp/shardyard-slurm.XXXXXX)
chmod 755 "$state"
pids=()
up_only=""; [ "${1:-}" = "--up" ] && up_only=1 && shift

stop_all() {
  # in the reverse order of their start, each by its own pid: those this script started and any a
  # test appended to <state>/pids (a slurmd it started again after killing one)
  mapfile -t pids <"$state/pids" 2>/dev/null || true
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill -TERM "${pids[$i]}" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  if [ -z "${KEEP_SLURM_STATE:-}" ]; then rm -rf "$state"; else echo "slurm state kept in $state"; fi
}
[ -n "$up_only" ] || trap stop_all EXIT

read -r p_ctld p_n1 p_n2 < <(python3 - <<'EOF'
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
EOF
)

# ---- munge: a key and a daemon of our own ----
mkdir -p "$state/munge"
chmod 700 "$state/munge"
dd if=/dev/urandom of="$state/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$state/munge/munge.key"
munged --foreground --force --socket="$state/munge/munge.sock" --key-file="$state/munge/munge.key" \
  --pid-file="$state/munge/munged.pid" --log-file="$state/munge/munged.log" \
  --seed-file="$state/munge/munged.seed" >"$state/munge/munged.out" 2>&1 &
pids+=($!)
for _ in $(seq 50); do [ -S "$state/munge/munge.sock" ] && break; sleep 0.1; done

# ---- slurm.conf: one controller, two nodes on loopback addresses ----
mkdir -p "$state/ctld" "$state/spool"
conf="$state/slurm.conf"
cat >"$conf" <<EOF
ClusterName=shardyard
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$p_ctld
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$state/munge/munge.sock
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool/%n
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd-%n.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdLogFile=$state/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=20
SlurmdTimeout=10
InactiveLimit=0
MinJobAge=300
NodeName=n1 NodeAddr=127.0.0.1 NodeHostname=$(hostname) Port=$p_n1 CPUs=4 RealMemory=4000 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.2 NodeHostname=$(hostname) Port=$p_n2 CPUs=4 RealMemory=4000 State=UNKNOWN
PartitionName=main Nodes=n1,n2 Default=YES MaxTime=30 State=UP
EOF
export SLURM_CONF="$conf"

slurmctld -D -i -f "$conf" >"$state/slurmctld.out" 2>&1 &
pids+=($!)
for n in n1 n2; do
  slurmd -D -N "$n" -f "$conf" >"$state/slurmd-$n.out" 2>&1 &
  pids+=($!)
done
printf '%s\n' "${pids[@]}" >"$state/pids"
disown -a # stop_all stops them by pid; a test may kill one (no "Killed" line from this shell)

# both nodes idle, or the logs and a failure
ok=""
for _ in $(seq 120); do
  if [ "$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle$')" = 2 ]; then ok=1; break; fi
  sleep 0.5
done
if [ -z "$ok" ]; then
  sinfo -N -l || true
  for f in "$state"/*.log "$state"/*.out; do echo "---- $f"; tail -n 20 "$f"; done
  echo "FAILED: the Slurm cluster did not come up" >&2
  exit 1
fi
sinfo -N -o '%N %t %c %m'

if [ -n "$up_only" ]; then
  echo "export SLURM_CONF=$conf"
  exit 0
fi
SHARDYARD_TEST_SLURM=1 .venv/bin/python -m pytest -q -n 0 -m slurm --durations=10 tests/slurm "$@"
