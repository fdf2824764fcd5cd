"""A warm sandbox's waiter for a script job (`python3 -I -S -c <this file>`, its init): says it
is ready, waits for the handover, then becomes the job's program with `execvpe`, so that the
program is the sandbox's pid 1 with the argv, environment and signal dispositions a cold
start's has. Nothing of the job is read before the handover."""

import json
import os
import signal

open("/sandq/out/.ready", "w").close()
with open("/sandq/out/.go", "rb") as go:
    go.read(1)
try:
    os.remove("/sandq/out/.ready")
except OSError:
    pass
with open("/sandq/handover.json", "rb") as handover:
    job = json.load(handover)
# Python ignores these two; an ignored signal stays ignored across exec, a cold start's
# program gets them at their defaults.
for name in ("SIGPIPE", "SIGXFSZ"):
    signal.signal(getattr(signal, name), signal.SIG_DFL)
os.execvpe(job["argv"][0], job["argv"], job["env"])
