#!/bin/bash
# Short requests' system calls and CPU per request in the bridge and the worker.
# usage: docs/bench/issue70/syscalls.sh NAME   (run from a checkout; writes out/NAME.*)
set -e
out=${OUT:-bench-results}; mkdir -p "$out"
(timeout 600 .venv/bin/tokenbus bench --spawn --max-tokens 2 --upstream --concurrency 64 \
  --requests-per-client ${RPC:-250} --no-progress --out "$out/$1.json" > "$out/$1.log" 2>&1 &)
for _ in $(seq 120); do
  B=$(pgrep -f "serve bridge" || true); W=$(pgrep -f "serve worker" || true)
  [ -n "$B" ] && [ -n "$W" ] && break; sleep 0.5
done
sleep 6  # past the direct engine's phase: the tokenbus target runs first
s() { for p in $B $W; do awk '/syscr|syscw/{printf "%s ", $2}' /proc/$p/io; awk '{printf "%s ", $14+$15}' /proc/$p/stat; done; echo; }
a=$(s); sleep 10; b=$(s)
while pgrep -f "bench --spawn" >/dev/null; do sleep 1; done
python3 - "$out/$1.json" "$a" "$b" <<'PY'
import json, sys
lv = [x for x in json.load(open(sys.argv[1]))["levels"] if x["target"] == "tokenbus-http"][0]
d = [int(y) - int(x) for x, y in zip(sys.argv[2].split(), sys.argv[3].split())]
req = lv["requests_per_s"] * 10
print(f"rps {lv['requests_per_s']:.0f}; per request: bridge reads {d[0]/req:.1f} writes {d[1]/req:.1f} "
      f"cpu {d[2]*10/req:.2f} ms | worker reads {d[3]/req:.1f} writes {d[4]/req:.1f} cpu {d[5]*10/req:.2f} ms")
PY
