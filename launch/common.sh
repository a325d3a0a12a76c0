# shellcheck shell=bash disable=SC2034  # (variables here are for the scripts sourcing this)
# Sourced by train.sbatch and ppo.sbatch: the settings users override, the per-job log
# directory, and how srun runs a step (bare metal, or inside a Pyxis/Enroot container).
#
# Every setting is an environment variable; set it when submitting
# (`NCCL_SOCKET_IFNAME=ib0 sbatch ...`: sbatch exports the submitting environment). An empty
# network setting is left unset, so NCCL / gloo pick for themselves.
#
# Network
#   NCCL_SOCKET_IFNAME  interface NCCL bootstraps over (and uses without InfiniBand), e.g. ib0,
#                       eth0, or ^lo,docker0 to exclude some
#   NCCL_IB_HCA         InfiniBand adapters NCCL may use, e.g. mlx5_0,mlx5_1 (empty: all)
#   NCCL_DEBUG          WARN by default; INFO prints the transport chosen for each connection
#   GLOO_SOCKET_IFNAME  interface for gloo (CPU ranks and CPU-side collectives)
#   MASTER_ADDR         torch.distributed rendezvous host (train.sbatch; default: first node)
#   MASTER_PORT         its port (default: 12000 + job id % 20000, so jobs sharing a node differ)
# Software
#   MEGARLHF            the megarlhf command (default: `megarlhf` from PATH: activate the
#                       environment before sbatch, or use a container)
#   PYTHON              the Python that has megarlhf and ray (default: python3 from PATH)
#   CONTAINER_IMAGE     run every step in this image through Pyxis (srun --container-image);
#                       empty: bare metal
#   CONTAINER_MOUNTS    Pyxis mounts, comma-separated SRC[:DST[:FLAGS]] (default: the submit
#                       directory, this launch directory, LOG_ROOT and, for PPO, RAY_TEMP_ROOT,
#                       each at the same path; add your data and checkpoint directories)
# Logs
#   LOG_ROOT            per-job log directories go in LOG_ROOT/<job name>-<job id>
#                       (default: logs/ in the submit directory); a requeued job keeps its id
#                       and so appends to the same directory

NCCL_DEBUG=${NCCL_DEBUG:-WARN}
LOG_ROOT=${LOG_ROOT:-$SLURM_SUBMIT_DIR/logs}
PYTHON=${PYTHON:-python3}
read -ra MEGARLHF_CMD <<<"${MEGARLHF:-megarlhf}"

say() { echo "[$(date +%T)] $*"; }

export_if_set() {
    local name
    for name in "$@"; do
        if [[ -n ${!name:-} ]]; then export "${name?}"; else unset "$name"; fi
    done
}
export_if_set NCCL_SOCKET_IFNAME NCCL_IB_HCA NCCL_DEBUG GLOO_SOCKET_IFNAME

# Node names of the allocation, expanded (n[1-3] -> n1 n2 n3) by Slurm itself.
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD_NODE=${NODES[0]}

LOG_DIR=$LOG_ROOT/$SLURM_JOB_NAME-$SLURM_JOB_ID
mkdir -p "$LOG_DIR"
# Everything the script prints also lands in the job's log directory (appended: a requeued
# run adds to it). tee ignores TERM, which scancel sends to every process of the batch step,
# so the script's last words on the way out still get written.
exec > >(trap '' TERM INT; exec tee -a "$LOG_DIR/job.log") 2>&1
echo "=== $(date -Is) job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on ${NODES[*]};" \
    "logs in $LOG_DIR"

# srun options every step gets: the container, when one is asked for.
SRUN_CONTAINER=()
if [[ -n ${CONTAINER_IMAGE:-} ]]; then
    # One named container per job: a node's steps share its filesystem instead of each
    # unpacking the image again. The sourcing script may name more paths to mount
    # (MOUNT_ALSO).
    mounts=$SLURM_SUBMIT_DIR,$LAUNCH_DIR,$LOG_ROOT${MOUNT_ALSO:+,$MOUNT_ALSO}
    SRUN_CONTAINER=(--container-image="$CONTAINER_IMAGE"
                    --container-name="megarlhf-$SLURM_JOB_ID"
                    --container-mounts="${CONTAINER_MOUNTS:-$mounts}"
                    --container-workdir="$SLURM_SUBMIT_DIR")
    say "container: $CONTAINER_IMAGE"
    # Unpack it on every node first: steps starting together on a node would race to.
    srun --nodes="${#NODES[@]}" --ntasks="${#NODES[@]}" --ntasks-per-node=1 \
        "${SRUN_CONTAINER[@]}" true || { say "cannot start $CONTAINER_IMAGE (srun's error is above: check the image name and that Pyxis is installed on the nodes)"; exit 1; }
fi

# The job's checks (the command's --dry-run: config, paths, checkpoints' metadata, layout,
# prompts) on the first node, before any rank or Ray node starts: a mistake fails the job in
# seconds with its one-line message here, not as a rank's traceback after start-up.
preflight() {  # preflight MEGARLHF_COMMAND...
    say "preflight: $* --dry-run"
    srun --overlap --nodes=1 --ntasks=1 --nodelist="$HEAD_NODE" "${SRUN_CONTAINER[@]}" \
        "$@" --dry-run
    local rc=$?
    if ((rc != 0)); then
        say "preflight failed (exit code $rc): nothing was started"
        exit "$rc"
    fi
}
