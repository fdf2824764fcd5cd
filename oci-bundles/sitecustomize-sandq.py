
# sandq (oci-bundles/sitecustomize-sandq.py, appended to Debian's sitecustomize.py at image
# build): start matplotlib's font cache from the one built with the image. A job's
# MPLCONFIGDIR is on its own fresh tmpfs, where matplotlib would otherwise scan every font of
# the image on first import (0.2-0.3 s more with the CJK fonts; docs/sandbox-image.md).
def _sandq_seed_matplotlib_cache():
    import os
    config = os.environ.get("MPLCONFIGDIR")
    seed = "/usr/share/sandq/matplotlib"
    if not config:
        return
    try:
        names = [n for n in os.listdir(seed) if n.startswith("fontlist-") and n.endswith(".json")]
        for name in names:
            target = os.path.join(config, name)
            if os.path.exists(target):
                continue
            with open(os.path.join(seed, name), "rb") as f:
                data = f.read()
            os.makedirs(config, mode=0o700, exist_ok=True)
            partial = "%s.%d.partial" % (target, os.getpid())
            with open(partial, "wb") as f:
                f.write(data)
            os.replace(partial, target)
    except OSError:
        pass


_sandq_seed_matplotlib_cache()
del _sandq_seed_matplotlib_cache


# sandq: whole lines from every process but the job's own. The worker runs Python with
# PYTHONUNBUFFERED=1, so nothing a program printed waits in a buffer when it is killed; but
# unbuffered text streams write each print() argument on its own, and the lines of processes
# printing side by side (a process pool's workers) then split each other mid-line. So every
# Python process of the sandbox except the job's own (pid 1: the program, or the notebook
# runner) is line-buffered above the unbuffered byte stream: it writes each line whole, at its
# newline, and only its unfinished line is lost at a kill. The job's own process keeps
# everything it printed, a partial line included. Forked children switch at the fork.
def _sandq_whole_lines():
    import os
    import sys

    def whole_lines():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.reconfigure(line_buffering=True, write_through=False)
            except (AttributeError, ValueError, OSError):
                pass

    if os.getpid() != 1:
        whole_lines()
    os.register_at_fork(after_in_child=whole_lines)


_sandq_whole_lines()
del _sandq_whole_lines
