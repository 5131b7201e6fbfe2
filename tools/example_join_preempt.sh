#!/usr/bin/env bash
# The README's worked example as an elastic job on this host, as a user would run it: node A starts, node B joins
# (1 -> 2), B is preempted with notice (SIGTERM to its agent, 2 -> 1), A finishes; then the events and the loss.
#   tools/example_join_preempt.sh [OUT_DIR]      (after `make install`; 1-4 minutes on 2 cores)
set -u
cd "$(dirname "$0")/.."
OUT=${1:-outputs/example-join-preempt}; rm -rf "$OUT"; mkdir -p "$OUT"
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=1
RUN=".venv/bin/lightning-emig-run --nnodes=1:2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29477 --rdzv-conf=last_call_timeout=2"
setsid $RUN,is_host=true --local-addr=127.0.0.2 -m lightning_emig.examples.gpt --max-steps 3000 --out "$OUT" > "$OUT"/a.log 2>&1 &
A=$!
for i in $(seq 1 120); do [ -e "$OUT"/checkpoints/step000010.ckpt ] && break; sleep 1; done  # A trains
setsid $RUN,is_host=false --local-addr=127.0.0.3 -m lightning_emig.examples.gpt --max-steps 3000 --out "$OUT" > "$OUT"/b.log 2>&1 &
B=$!
for i in $(seq 1 120); do grep -q '"kind": "join"' "$OUT"/events.jsonl 2>/dev/null && break; sleep 1; done
sleep 8
kill -TERM $B
wait $B; echo "B exit $?"
wait $A; echo "A exit $?"
.venv/bin/python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for line in open(f"{out}/events.jsonl"):
    e = json.loads(line)
    print(e["kind"], "step", e["step"], f"world {e['old_world']}->{e['new_world']}", f"downtime {e.get('downtime_seconds', 0):.2f}s",
          {k: round(v, 3) for k, v in e["seconds"].items()})
s = json.load(open(f"{out}/summary.json"))
print("steps", len(s["step_losses"]), "loss", s["step_losses"]["0"], "->", s["step_losses"][str(len(s["step_losses"]) - 1)], "tokens_seen", s["tokens_seen"])
PY
