#!/bin/bash
# run a short-request bench; sample syscalls of bridge and worker during the tokenbus phase
cd ${TREE:-/work/main}
(timeout 600 /work/main/.venv/bin/python -c "import sys; from tokenbus.cli import main; sys.argv[0]='tokenbus'; sys.exit(main())" bench --spawn --max-tokens 2 --upstream --concurrency 64 --requests-per-client ${RPC:-250} --no-progress --out /tmp/b67/sysc-$1.json > /tmp/b67/sysc-$1.log 2>&1 &)
for i in $(seq 120); do B=$(pgrep -f "serve bridge"); W=$(pgrep -f "serve worker"); N=$(pgrep -f "nats-server -c /tmp/tokenbus-bench"); [ -n "$B" ] && [ -n "$W" ] && break; sleep 0.5; done
sleep 6
s() { for p in $B $W; do awk '/syscr|syscw/{printf "%s ", $2}' /proc/$p/io; awk '{printf "%s ", $14+$15}' /proc/$p/stat; done; echo; }
a=$(s); sleep 10; b=$(s)
echo "$a" > /tmp/b67/sysc-$1.a; echo "$b" > /tmp/b67/sysc-$1.b
while pgrep -f "bench --spawn" >/dev/null; do sleep 1; done
python3 - $1 <<'PY'
import sys, json
n = sys.argv[1]
a = list(map(int, open(f"/tmp/b67/sysc-{n}.a").read().split())); b = list(map(int, open(f"/tmp/b67/sysc-{n}.b").read().split()))
d = [y - x for x, y in zip(a, b)]
d2 = json.load(open(f"/tmp/b67/sysc-{n}.json"))
lv = [l for l in d2["levels"] if l["target"] == "tokenbus-http"][0]
rps = lv["requests_per_s"]
req = rps * 10
print(f"{n}: rps {rps:.0f}; per request: bridge reads {d[0]/req:.1f} writes {d[1]/req:.1f} cpu {d[2]*10/req:.2f} ms | worker reads {d[3]/req:.1f} writes {d[4]/req:.1f} cpu {d[5]*10/req:.2f} ms")
PY
