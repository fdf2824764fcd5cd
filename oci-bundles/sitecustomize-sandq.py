
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
