#!/usr/bin/env bash
# Writes the Prometheus targets of a training job: targets/finetune.json (every rank's metrics
# endpoint: each node serves METRICS_PORT .. METRICS_PORT + GPUS_PER_NODE - 1, one port per local
# rank) and targets/dcgm.json (the DCGM exporter of each node). A target's `node` label is the node's
# position in NODES, the machine rank the trainer reports: list the main node (NODE_RANK=0) first.
#
#   docker/monitoring/targets.sh NODES="node0 node1" GPUS_PER_NODE=4 [METRICS_PORT=9450] [DCGM_PORT=9400]
#       [TARGETS_DIR=docker/monitoring/prometheus/targets]
#
# Settings come as NAME=value arguments or from the environment.
set -euo pipefail

for arg in "$@"; do
  case "$arg" in
    NODES=*|GPUS_PER_NODE=*|METRICS_PORT=*|DCGM_PORT=*|TARGETS_DIR=*) export "${arg?}" ;;
    *) echo "targets.sh: unknown argument '$arg'; expected NODES=, GPUS_PER_NODE=, METRICS_PORT=, DCGM_PORT=," \
         "TARGETS_DIR=" >&2; exit 2 ;;
  esac
done
NODES=${NODES:-localhost}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
METRICS_PORT=${METRICS_PORT:-9450}
DCGM_PORT=${DCGM_PORT:-9400}
TARGETS_DIR=${TARGETS_DIR:-$(dirname "$0")/prometheus/targets}

fail() { echo "targets.sh: $*" >&2; exit 2; }
[[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]] || fail "GPUS_PER_NODE='$GPUS_PER_NODE' must be a whole number >= 1 (ranks per node)"
for name in METRICS_PORT DCGM_PORT; do
  if ! [[ "${!name}" =~ ^[1-9][0-9]{0,4}$ ]] || (( ${!name} > 65535 )); then
    fail "$name='${!name}' is not a port (1-65535)"
  fi
done
(( METRICS_PORT + GPUS_PER_NODE - 1 <= 65535 )) || fail "METRICS_PORT=$METRICS_PORT + GPUS_PER_NODE=$GPUS_PER_NODE runs past port 65535"
read -r -a hosts <<< "$NODES"
(( ${#hosts[@]} )) || fail "NODES is empty; set NODES=\"<node0> <node1> ...\" (main node first)"
for host in "${hosts[@]}"; do
  [[ "$host" =~ ^[A-Za-z0-9._:-]+$|^\[[0-9A-Fa-f:.]+\]$ ]] || fail "node '$host' is not a host name or address (IPv6: [addr])"
done

# One JSON group per node: {"targets": [...], "labels": {"node": "<machine rank>"}}.
group() {  # node index, then host:port targets
  local node=$1 sep="" out
  shift
  out="  {\"labels\": {\"node\": \"$node\"}, \"targets\": ["
  for target in "$@"; do out+="$sep\"$target\""; sep=", "; done
  printf '%s]}' "$out"
}
finetune="[" dcgm="[" sep=""
for i in "${!hosts[@]}"; do
  ports=()
  for ((k = 0; k < GPUS_PER_NODE; k++)); do ports+=("${hosts[$i]}:$((METRICS_PORT + k))"); done
  finetune+="$sep"$'\n'"$(group "$i" "${ports[@]}")"
  dcgm+="$sep"$'\n'"$(group "$i" "${hosts[$i]}:$DCGM_PORT")"
  sep=","
done

mkdir -p "$TARGETS_DIR"
# Written next to the final name and renamed: Prometheus never reads a half-written file.
printf '%s\n]\n' "$finetune" > "$TARGETS_DIR/.finetune.json.tmp" && mv "$TARGETS_DIR/.finetune.json.tmp" "$TARGETS_DIR/finetune.json"
printf '%s\n]\n' "$dcgm" > "$TARGETS_DIR/.dcgm.json.tmp" && mv "$TARGETS_DIR/.dcgm.json.tmp" "$TARGETS_DIR/dcgm.json"
echo "targets: ${#hosts[@]} node(s) x $GPUS_PER_NODE ranks on ports $METRICS_PORT-$((METRICS_PORT + GPUS_PER_NODE - 1))," \
  "DCGM on $DCGM_PORT -> $TARGETS_DIR/{finetune,dcgm}.json"
