#!/bin/bash
# The bridge's and the worker's system calls and CPU per request and per token.
# usage: docs/bench/issue70/syscalls.sh NAME   (run from a checkout; writes out/NAME.*)
# TOKENS: max_tokens (default 2, short requests); STAGES=1: the locked bus and every stage;
# RPC: requests per client at c=64. A/B settings go in the environment, e.g.
# TOKENBUS_WORKER__STREAM_COALESCE_READS=1 STAGES=1 TOKENS=64 RPC=60 (docs/benchmarks.md).
set -e
out=${OUT:-bench-results}; mkdir -p "$out"
stages=(); [ -n "$STAGES" ] && stages=(--pipeline auth,ratelimit,filter,route --locked)
(timeout 600 .venv/bin/tokenbus bench --spawn "${stages[@]}" --max-tokens ${TOKENS:-2} --upstream \
  --concurrency 64 --requests-per-client ${RPC:-250} --no-progress --out "$out/$1.json" > "$out/$1.log" 2>&1 &)
for _ in $(seq 120); do
  B=$(pgrep -f "serve bridge" || true); W=$(pgrep -f "serve worker" || true)
  [ -n "$B" ] && [ -n "$W" ] && break; sleep 0.5
done
sleep ${SETTLE:-6}  # past the stack's start: the tokenbus target runs first
s() { for p in $B $W; do awk '/syscr|syscw/{printf "%s ", $2}' /proc/$p/io; awk '{printf "%s ", $14+$15}' /proc/$p/stat; done; echo; }
a=$(s); sleep 10; b=$(s)
while pgrep -f "bench --spawn" >/dev/null; do sleep 1; done
python3 - "$out/$1.json" "$a" "$b" <<'PY'
import json, sys
lv = [x for x in json.load(open(sys.argv[1]))["levels"] if x["target"] == "tokenbus-http"][0]
d = [int(y) - int(x) for x, y in zip(sys.argv[2].split(), sys.argv[3].split())]
for unit, n in (("request", lv["requests_per_s"] * 10), ("token", lv["output_tokens_per_s"] * 10)):
    print(f"per {unit}: bridge reads {d[0]/n:.2f} writes {d[1]/n:.2f} cpu {d[2]*1e4/n:.1f} us | "
          f"worker reads {d[3]/n:.2f} writes {d[4]/n:.2f} cpu {d[5]*1e4/n:.1f} us")
print(f"requests/s {lv['requests_per_s']:.0f}, tokens/s {lv['output_tokens_per_s']:.0f}")
PY
