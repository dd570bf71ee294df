"""Sandboxes: the processes a trajectory's CPU actions run in, and everything that runs
inside one.

Runs inside a sandbox (the standard library and cloudpickle only, so that a sandbox starts
fast and its files cannot shadow an import): inside_worker.py, the worker process's main
(started as a file: `python -I inside_worker.py FD`), inside_run_code.py, a Sandbox
Fusion request's run (compile, run, limits), and inside_values.py, the plain-data format
of the worker's replies (the orchestrator imports it too, to decode them). tangram.worker, the API a sandboxed function
imports (grant(), limit_grant, GrantedExecutor), stays with the public face.

Runs in the orchestrator's process: workers.py (a trajectory's worker: start, warm pool,
kill), replies.py (a worker's reply read as untrusted data), run_code.py (a Sandbox Fusion request turned into a call), grant.py (the grant file
a worker reads its cores from), and the boundaries: isolation.py (cgroups, CPU affinity),
namespaces.py (bubblewrap namespaces, seccomp), rootfs.py and images.py (a task's own
image as the sandbox's root), containers.py (a container engine's container per
trajectory). A module that runs inside a sandbox is named inside_*.py.
"""
