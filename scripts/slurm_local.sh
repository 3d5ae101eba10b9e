#!/bin/bash
# A one-node Slurm cluster on this machine, for the tests behind `pytest -m slurm` (tests/integration/test_slurm.py):
# installs Debian's slurm-wlm and munge when they are missing, writes a configuration under SLURM_LOCAL_DIR and
# starts munged, slurmctld and slurmd by hand (no systemd). The node declares SLURM_LOCAL_GPUS fake GPUs as GRES (device
# files with /dev/null's numbers), so `sbatch --gpus-per-node N` works, and sets SLURM_GPUS_ON_NODE, on a CPU machine.
# Needs root (packages, munge's key and the daemons).
#
#   scripts/slurm_local.sh start    # then: export SLURM_CONF=$SLURM_LOCAL_DIR/slurm.conf (printed) for sbatch & co.
#   scripts/slurm_local.sh stop     # ends the three daemons this script started
#
# Variables: SLURM_LOCAL_DIR (default /tmp/slurm-local: configuration, state, logs), SLURM_LOCAL_GPUS (default 2),
# SLURM_LOCAL_KILL_WAIT (seconds between SIGTERM and SIGKILL when a job ends early; default 30, Slurm's default).
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/slurm-local}
GPUS=${SLURM_LOCAL_GPUS:-2}
KILL_WAIT=${SLURM_LOCAL_KILL_WAIT:-30}
NODE=$(hostname -s)

install() {
    if ! command -v slurmctld > /dev/null || ! command -v munged > /dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge
    fi
}

configure() {
    mkdir -p "$DIR/state" "$DIR/spool"
    # CPUs, sockets, cores and memory as slurmd sees them: a node that claims more than it has is drained.
    local hardware
    hardware=$(slurmd -C | head -n1 | cut -d' ' -f2-)
    cat > "$DIR/slurm.conf" <<EOF
ClusterName=torchpre-local
SlurmctldHost=$NODE
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
# No cgroups here: track a job's processes through /proc, and bind none to cores.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
# Finished jobs stay visible to scontrol for an hour: without accounting, that is where their state is read.
MinJobAge=3600
KillWait=$KILL_WAIT
GresTypes=gpu
NodeName=$NODE $hardware Gres=gpu:$GPUS State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
    # slurmd drops a GPU without a device file; these are character devices with /dev/null's numbers.
    local gpu
    for gpu in $(seq 0 $((GPUS - 1))); do
        [[ -e $DIR/gpu$gpu ]] || mknod "$DIR/gpu$gpu" c 1 3
    done
    echo "NodeName=$NODE Name=gpu File=$DIR/gpu[0-$((GPUS - 1))]" > "$DIR/gres.conf"
}

start() {
    install
    configure
    mkdir -p /run/munge
    chown munge:munge /run/munge
    runuser -u munge -- /usr/sbin/munged
    export SLURM_CONF=$DIR/slurm.conf
    slurmctld
    slurmd
    for _ in $(seq 60); do
        if sinfo --noheader --states=idle --format=%N 2> /dev/null | grep -q .; then
            echo "Slurm is up: node $NODE idle. export SLURM_CONF=$SLURM_CONF"
            return
        fi
        sleep 1
    done
    echo "error: the node did not become idle within 60 s; see $DIR/slurmctld.log and $DIR/slurmd.log" >&2
    exit 1
}

stop() {
    local daemon
    for daemon in slurmd slurmctld; do
        if [[ -f $DIR/$daemon.pid ]]; then
            kill "$(cat "$DIR/$daemon.pid")" 2> /dev/null || true
        fi
    done
    munged --stop 2> /dev/null || true
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
