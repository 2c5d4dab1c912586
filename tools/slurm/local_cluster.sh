#!/usr/bin/env bash
# A real SLURM on this machine, from Debian's packages: one controller, one or two compute nodes.
#
#   tools/slurm/local_cluster.sh install          # apt-get install slurmctld slurmd slurm-client munge
#   tools/slurm/local_cluster.sh start [--nodes N] # write slurm.conf, start munged, slurmctld, N slurmd
#   tools/slurm/local_cluster.sh status           # daemons and nodes
#   tools/slurm/local_cluster.sh stop             # stop the daemons this script started
#   tools/slurm/local_cluster.sh up [--nodes N]    # install if needed, then start (what the tests call)
#
# Needs root (daemons, the config file) and, for `install`, apt-get. The configuration is the
# smallest that runs batch jobs on a machine without cgroup support: proctrack/linuxproc, task/none, no
# accounting. `--nodes 2` declares two nodes on this host, each with its own slurmd (`slurmd -N`), which
# emulates a two-node allocation for scripts like ray.sub (see docs/cluster.md for what this can and
# cannot show).
#
# Environment (the defaults make the machine's SLURM: plain `sbatch` finds it):
#   SLURM_CONF              the config file the daemons and every client read (default /etc/slurm/slurm.conf)
#   SLURM_LOCAL_DIR         state, spool, pid files and logs of the daemons (default /var/lib/nemo_rl_slurm)
#   SLURM_LOCAL_CPUS        CPUs each node declares (default: nproc)
#   SLURM_LOCAL_PORT        first slurmd port; node i listens on PORT+i (default 6818)
#   SLURM_LOCAL_CTLD_PORT   slurmctld's port (default 6817)
#   SLURM_LOCAL_MUNGE_DIR   when set, a munged of this cluster's own (key, socket, pid file and log there),
#                           which `stop` stops too; unset, the machine's munged (started if needed, left running)
#   SLURM_LOCAL_WAIT_S      how long `start` waits for the nodes to be idle (default 120)
#   SLURM_LOCAL_FIRST_JOB_ID  the first job id (default 1); another cluster's jobs may use the same ids
# With its own SLURM_CONF, SLURM_LOCAL_DIR, ports and munge directory, a cluster runs beside any other SLURM
# on the machine (tests/functional/test_slurm.py starts one so; its clients need SLURM_CONF in their
# environment).
set -euo pipefail

STATE_DIR=${SLURM_LOCAL_DIR:-/var/lib/nemo_rl_slurm}
export SLURM_CONF=${SLURM_CONF:-/etc/slurm/slurm.conf}
CONF=$SLURM_CONF
MUNGE_DIR=${SLURM_LOCAL_MUNGE_DIR:-}
MARKER="# Written by nemo_rl tools/slurm/local_cluster.sh"
PACKAGES=(slurmctld slurmd slurm-client munge)
CLUSTER_NAME=nemorl
PARTITION=local

die() {
  echo "local_cluster.sh: $*" >&2
  exit 2
}

need_root() {
  [[ $(id -u) -eq 0 ]] || die "must run as root (it starts daemons and writes $CONF)"
}

installed() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null &&
    command -v munged >/dev/null
}

cmd_install() {
  need_root
  if installed; then
    echo "SLURM and munge are already installed: $(slurmd -V)"
    return
  fi
  command -v apt-get >/dev/null || die "apt-get not found: install ${PACKAGES[*]} with this system's package manager"
  # The package scripts try to start the daemons through systemd, which is absent in containers.
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${PACKAGES[@]}" >/dev/null 2>&1 || {
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${PACKAGES[@]}" >/dev/null
  }
  installed || die "apt-get finished but slurmctld/slurmd/sbatch/munged are not on PATH"
  echo "installed: $(slurmd -V)"
}

# Node names: the host's short name for one node (slurmd finds itself by hostname); nrl-node1..N otherwise.
node_names() {
  local n=$1
  if [[ $n -eq 1 ]]; then
    hostname -s
  else
    for ((i = 1; i <= n; i++)); do echo "nrl-node$i"; done
  fi
}

write_conf() {
  local nodes=$1 cpus=$2 port=$3 ctld_port=$4 host
  host=$(hostname -s)
  if [[ -f $CONF ]] && ! grep -qF "$MARKER" "$CONF"; then
    die "$CONF exists and was not written by this script; move it away first (this script never overwrites it)"
  fi
  mkdir -p "$STATE_DIR"/{ctld,log,run} "$(dirname "$CONF")"
  local memory_mb
  memory_mb=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / nodes / 2))
  {
    echo "$MARKER"
    echo "ClusterName=$CLUSTER_NAME"
    echo "SlurmctldHost=$host"
    echo "SlurmctldPort=$ctld_port"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    [[ -z $MUNGE_DIR ]] || echo "AuthInfo=socket=$MUNGE_DIR/munge.socket"
    echo "PlugStackConfig=$(dirname "$CONF")/plugstack.conf"
    echo "StateSaveLocation=$STATE_DIR/ctld"
    echo "SlurmdSpoolDir=$STATE_DIR/spool-%n"
    echo "SlurmctldPidFile=$STATE_DIR/run/slurmctld.pid"
    echo "SlurmdPidFile=$STATE_DIR/run/slurmd-%n.pid"
    echo "SlurmctldLogFile=$STATE_DIR/log/slurmctld.log"
    echo "SlurmdLogFile=$STATE_DIR/log/slurmd-%n.log"
    # No cgroups here: track a step's processes through their parent ids, bind nothing.
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "JobCompType=jobcomp/none"
    echo "MpiDefault=none"
    echo "SwitchType=switch/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_CPU"
    # The declared CPUs and memory are what counts, whatever slurmd measures.
    echo "SlurmdParameters=config_overrides"
    echo "ReturnToService=2"
    # Seconds between a job's SIGTERM and SIGKILL (scancel, time limit).
    echo "KillWait=30"
    echo "MinJobAge=600"
    echo "FirstJobId=${SLURM_LOCAL_FIRST_JOB_ID:-1}"
    echo "SlurmctldTimeout=30"
    echo "SlurmdTimeout=60"
    local i=0
    for name in $(node_names "$nodes"); do
      echo "NodeName=$name NodeHostname=$host NodeAddr=$host Port=$((port + i)) CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN"
      i=$((i + 1))
    done
    echo "PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
  } >"$CONF"
  # srun and sbatch read the plugin stack; the package ships one that includes an empty directory.
  [[ -f $(dirname "$CONF")/plugstack.conf ]] || : >"$(dirname "$CONF")/plugstack.conf"
}

pid_alive() {
  local file=$1
  [[ -f $file ]] && kill -0 "$(cat "$file")" 2>/dev/null
}

start_own_munge() {
  local pidfile=$MUNGE_DIR/munged.pid
  if pid_alive "$pidfile"; then return; fi
  mkdir -p "$MUNGE_DIR"
  [[ -s $MUNGE_DIR/munge.key ]] || dd if=/dev/urandom bs=1 count=1024 of="$MUNGE_DIR/munge.key" status=none
  chown -R munge:munge "$MUNGE_DIR"
  chmod 0755 "$MUNGE_DIR" # clients need to reach the socket; the key stays readable by munge only
  chmod 0400 "$MUNGE_DIR/munge.key"
  runuser -u munge -- /usr/sbin/munged --socket="$MUNGE_DIR/munge.socket" --key-file="$MUNGE_DIR/munge.key" \
    --pid-file="$pidfile" --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed"
  munge -n --socket="$MUNGE_DIR/munge.socket" | unmunge --socket="$MUNGE_DIR/munge.socket" >/dev/null ||
    die "munged started but a credential does not round-trip"
}

start_munge() {
  if [[ -n $MUNGE_DIR ]]; then
    start_own_munge
    return
  fi
  local pidfile=/run/munge/munged.pid
  if pid_alive "$pidfile"; then return; fi
  mkdir -p /run/munge /var/lib/munge /var/log/munge /etc/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge
  chmod 0755 /run/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  fi
  chown munge:munge /etc/munge /etc/munge/munge.key
  chmod 0700 /etc/munge
  chmod 0400 /etc/munge/munge.key
  runuser -u munge -- /usr/sbin/munged
  munge -n | unmunge >/dev/null || die "munged started but a credential does not round-trip"
}

start_daemons() {
  local nodes=$1
  if ! pid_alive "$STATE_DIR/run/slurmctld.pid"; then
    # -i: ignore state files from an earlier configuration; setsid: no tie to the caller's session.
    setsid slurmctld -i </dev/null >>"$STATE_DIR/log/slurmctld.out" 2>&1
  fi
  for name in $(node_names "$nodes"); do
    if ! pid_alive "$STATE_DIR/run/slurmd-$name.pid"; then
      mkdir -p "$STATE_DIR/spool-$name"
      setsid slurmd -N "$name" </dev/null >>"$STATE_DIR/log/slurmd-$name.out" 2>&1
    fi
  done
}

wait_idle() {
  local nodes=$1 wait_s=${SLURM_LOCAL_WAIT_S:-120} states
  local deadline=$((SECONDS + wait_s))
  while ((SECONDS < deadline)); do
    states=$(sinfo -h -N -p "$PARTITION" -o "%t" 2>/dev/null | sort | uniq -c | awk '{print $2 "=" $1}' | tr '\n' ' ')
    if [[ $(sinfo -h -N -p "$PARTITION" -t idle,mix,alloc -o "%N" 2>/dev/null | wc -l) -eq $nodes ]]; then
      echo "SLURM is up: $nodes node(s) in partition '$PARTITION' ($states)"
      return
    fi
    sleep 0.5
  done
  sinfo -N -l >&2 || true
  die "nodes not idle within $wait_s s (states: ${states:-none}); see $STATE_DIR/log/"
}

cmd_start() {
  need_root
  installed || die "SLURM is not installed: run '$0 install' first"
  local nodes=1 cpus=${SLURM_LOCAL_CPUS:-$(nproc)} port=${SLURM_LOCAL_PORT:-6818}
  local ctld_port=${SLURM_LOCAL_CTLD_PORT:-6817}
  while [[ $# -gt 0 ]]; do
    case $1 in
      --nodes) nodes=$2; shift 2 ;;
      *) die "unknown argument '$1' (expected --nodes N)" ;;
    esac
  done
  [[ $nodes =~ ^[12]$ ]] || die "--nodes must be 1 or 2, got '$nodes'"
  local wanted
  wanted=$(node_names "$nodes" | tr '\n' ' ')
  if pid_alive "$STATE_DIR/run/slurmctld.pid"; then
    local have
    have=$(sinfo -h -N -o "%N" 2>/dev/null | sort -u | tr '\n' ' ')
    if [[ $have != "$wanted" ]]; then
      echo "restarting SLURM: it runs nodes '$have', asked for '$wanted'"
      cmd_stop
    fi
  fi
  write_conf "$nodes" "$cpus" "$port" "$ctld_port"
  start_munge
  start_daemons "$nodes"
  wait_idle "$nodes"
}

stop_pidfile() {
  local file=$1
  pid_alive "$file" || { rm -f "$file"; return 0; }
  local pid
  pid=$(cat "$file")
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$file"
}

cmd_stop() {
  need_root
  for file in "$STATE_DIR"/run/slurmd-*.pid; do
    [[ -e $file ]] && stop_pidfile "$file"
  done
  stop_pidfile "$STATE_DIR/run/slurmctld.pid"
  if [[ -n $MUNGE_DIR ]]; then
    stop_pidfile "$MUNGE_DIR/munged.pid"
    echo "SLURM daemons and this cluster's munged stopped"
  else
    echo "SLURM daemons stopped (the machine's munged left running)"
  fi
}

cmd_status() {
  local ok=0
  pid_alive "$STATE_DIR/run/slurmctld.pid" && echo "slurmctld: running" || { echo "slurmctld: stopped"; ok=1; }
  for file in "$STATE_DIR"/run/slurmd-*.pid; do
    [[ -e $file ]] || continue
    local name=${file##*/slurmd-}
    pid_alive "$file" && echo "slurmd ${name%.pid}: running" || echo "slurmd ${name%.pid}: stopped"
  done
  [[ $ok -eq 0 ]] && sinfo -N -l
  return $ok
}

case ${1:-} in
  install) cmd_install ;;
  start) shift; cmd_start "$@" ;;
  up) shift; cmd_install; cmd_start "$@" ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) die "usage: $0 install | start [--nodes N] | up [--nodes N] | stop | status" ;;
esac
