#!/bin/bash
# Idle CPU of a whole `tokenbus up` (2 sim workers, every stage, its nats-server) over 30 s,
# with every connection pinging its server every $1 seconds (1: the default; 120: nats-py's).
#   docs/bench/stalls/idle_cpu.sh 1; docs/bench/stalls/idle_cpu.sh 120
set -u
data=$(mktemp -d)
TOKENBUS_NATS_PING_INTERVAL_S=$1 .venv/bin/python -m tokenbus.cli up --port 18133 \
  --nats-port 18134 --data-dir "$data" --workers 2 > "$data.log" 2>&1 &
up=$!
for _ in $(seq 300); do grep -q ready "$data.log" && break; sleep 0.2; done
sleep 10
ticks() {
  local t=0 s
  for p in $(pgrep -f "tokenbus.cli|nats-server.*$data"); do
    s=$(awk '{print $14+$15}' "/proc/$p/stat" 2>/dev/null)
    t=$((t + ${s:-0}))
  done
  echo "$t"
}
a=$(ticks); sleep 30; b=$(ticks)
echo "ping every $1 s: $((b - a)) ticks (1/100 s) of CPU in 30 s idle, every process"
kill -INT $up; wait $up
rm -rf "$data" "$data.log"
