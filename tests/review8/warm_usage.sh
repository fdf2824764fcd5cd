#!/bin/bash
# Eighth review W1 (informational): a warm start's `usage` counts the warm-up. The same notebook
# cell, once in a warm sandbox and once forced cold (TZ is read at start-up, so a job setting it
# starts cold: warm::read_at_startup). Expected: about the same cpu_ms and peak memory (or the
# warm-up's share documented). Seen: warm cpu_ms ~0.9 s and peak ~95 MiB (numpy, pandas and
# matplotlib preloaded before the job existed), cold ~0.35 s and ~19 MiB.
# Needs a worker with warm.per_sku >= 1 serving S, idle long enough to have warmed up.
SANDQ=${SANDQ:-sandq}
for how in warm cold; do
  extra=(); [ "$how" = cold ] && extra=(--env TZ=UTC)
  $SANDQ --json run --sku S "${extra[@]}" -c '1' | python3 -c "import json,sys; r=json.load(sys.stdin); print('$how', 'sandbox', r.get('sandbox'), 'usage', r.get('usage'))"
  sleep 3
done
