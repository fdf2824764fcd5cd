"""sandq notebook runner, as a package (see ../README.md).

The entry point is ``sandq_runner.py`` next to this directory: ``python3 /sandq/sandq_runner.py
<script> [args...]`` (or ``--warm``) loads this package and calls ``sandq_nb.run.start()``.

Modules, in the order they depend on each other:

- ``common``: paths, fd-2 notes, safe repr/str;
- ``outputs``: the outputs file ($SANDQ_OUTPUTS, one JSON line an output, byte budget);
- ``bundles``: MIME bundles to their JSON form;
- ``formatters``: pandas / matplotlib formatters (markdown tables, table schema, figures);
- ``tracebacks``: plain tracebacks without the runner's and IPython's frames;
- ``imports``: the import hook (sandq_mpl, env overrides) and the lazy IPython package;
- ``shell``: the IPython shell (``make_shell``);
- ``state``: session state pickling;
- ``warm``: warm start (preload, handover);
- ``run``: ``main`` and the process exit.

Nothing here imports IPython, pandas or matplotlib at import time.
"""
