#!/bin/bash
# A warm start's `usage` must not count the warm-up. The same notebook cell, once in a warm
# sandbox and once forced cold (TZ is read at start-up, so a job setting it starts cold:
# warm::read_at_startup). Expected: about the same cpu_ms, and on cgroup v1 the same peak memory
# (v2's memory.peak is not reset at handover: it includes the preload of numpy, pandas and
# matplotlib, ~95 MiB). Counted, a warm job's cpu_ms was ~0.9 s against ~0.35 s cold.
# Needs a worker with warm.per_sku >= 1 serving S, idle long enough to have warmed up.
SANDQ=${SANDQ:-sandq}
for how in warm cold; do
  extra=(); [ "$how" = cold ] && extra=(--env TZ=UTC)
  $SANDQ --json run --sku S "${extra[@]}" -c '1' | python3 -c "import json,sys; r=json.load(sys.stdin); print('$how', 'sandbox', r.get('sandbox'), 'usage', r.get('usage'))"
  sleep 3
done
