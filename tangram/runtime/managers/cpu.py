"""The CPU manager: stateful sandboxes per trajectory, compute granted per action.

Each trajectory gets a sandbox (tangram.runtime.sandbox.workers): a worker process with its own
directory that keeps files and Python state across the trajectory's actions. Each action
gets its grant of cores only while it runs. By default a grant is a guarantee, not a
ceiling (`cpu_limit="guarantee"`): the sandbox may run on every CPU of the manager and its
cgroup CPU weight is proportional to its grant, so an action uses whatever cores nobody
else needs and, when every core is busy, still gets at least its grant. With
`cpu_limit="ceiling"` the manager pins the sandbox to concrete CPU ids (exclusive whole
CPUs when it can; a fraction shares one CPU under a CFS quota). Either way it applies the
memory limit and tells the action its grant:

    TANGRAM_CORES   processes to run: the grant rounded up, at least 1 (1.25 cores -> 2);
                    use it for `pytest -n`, thread pools
    TANGRAM_GRANT   the grant in cores, exactly ("1.25")
    TANGRAM_CPUS    the CPU ids it may run on, "0-3,6" style
    TANGRAM_GRANT_FILE, TANGRAM_JOBSERVER
                    the live grant and a GNU make jobserver, both following resizes while
                    the action runs (tangram.runtime.sandbox.grant; commands get MAKEFLAGS for it)
    TANGRAM_LIMIT, TANGRAM_ACTION
                    where the action writes "<TANGRAM_ACTION> <cores>" when it can use at
                    most that many cores from now on (tangram.worker.limit_grant)
    OMP_NUM_THREADS, MKL_NUM_THREADS, OPENBLAS_NUM_THREADS = TANGRAM_CORES

A running action's grant may change (`resize`): the weight (or pinning and quota), the
grant file and the jobserver's tokens follow at once. The action may also bound its own
grant (its pool has fewer tasks left than cores): the manager tells the orchestrator, and
the cores it gives back go to what waits.

A function runs in the worker (os.environ carries those for the duration of the call); a
command runs as its child. Errors: a function that raises -> ActionFailed (error_type,
remote traceback); the worker dying -> ActionCrashed (exit_code or signal); memory past the
limit -> ResourceLimitExceeded("memory"). Cancellation (and so a timeout) kills everything
the sandbox runs; a crash or a kill makes the trajectory's next action start a fresh worker
in the same directory. A worker that dies between actions (killed from outside, out of
memory) is reaped when it exits and fails no action: the next one starts a fresh worker.
The CPUs go back to the pool on every exit path.

Isolation: by default every sandbox runs inside Linux namespaces set up by bubblewrap
(tangram.runtime.sandbox.namespaces: its own uid, PID, mount, IPC, UTS and network namespaces, the
host read-only, no network unless asked), or as a bare process under isolation="process".
Resources: tangram.runtime.sandbox.isolation (cgroup v2, cgroup v1, or affinity + rlimits).
`describe()` says which are in force; docs/sandbox.md has the threat model.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import shutil
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

import cloudpickle

from ..._arguments import int_ranges
from ..call import Call, CommandResult, Placement, require_fn_or_command
from ..sandbox.containers import ENGINES, ContainerError, ContainerJail, check_engine, engine_path, image_known, remove_orphans
from ..errors import ActionCrashed, ActionFailed, ManagerError, ResourceLimitExceeded
from ..sandbox.grant import whole_cores
from ..sandbox.images import ImageCache, ImageError
from ..sandbox.isolation import Isolation, ManagerCgroups, SandboxCgroup, descendants, detect, hierarchy_path
from .base import LiveAction, ResourceManager
from ..sandbox.namespaces import Boundary, disk_full, python_paths, unmount_orphans, unmount_under
from ..sandbox.namespaces import detect as detect_boundary
from .cpu_options import CPU_LIMITS, MILLI_PER_CORE, CpuPool, check_options
from ..sandbox.kills import kill_marked, marked_processes
from ..sandbox.replies import MAX_REPLY_BYTES, Malformed, load_reply
from ..sandbox.workers import Jail, Needs, Preload, ReplyTooLarge, Sandbox, WarmWorkers, WorkerDied

_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
DEFAULT_WARM_SANDBOXES = 4
POOLED_IDLE_LIMIT = 64  # idle pooled sandboxes kept (Call.pooled); one given back past it is ended
DEFAULT_PIDS_LIMIT = 1024
_ids = itertools.count(1)
_log = logging.getLogger("tangram.runtime.managers.cpu")


class CpuManager(ResourceManager):
    """Runs actions in per-trajectory sandboxes on this machine's CPUs.

    Options (the config's `[managers.cpu]` table):
      root          directory for the sandboxes' directories (a fresh temporary directory
                    inside it per manager; default: the system's temporary directory)
      isolation     "auto" (default: "namespaces" where bubblewrap works, else "process"
                    with a warning), "namespaces" (an error where they do not work) or
                    "process" (UNSAFE for untrusted code: a bare process as the orchestrator's
                    user). The environment variable TANGRAM_ISOLATION applies when "auto"
      network       whether namespaced sandboxes reach the network by default (default
                    False: loopback only, their own); Call.network overrides it per call
      visible_paths more host paths a namespaced sandbox sees read-only (beside the system
                    directories and the orchestrator's Python)
      pids_limit    processes and threads per sandbox (default 1024; None: no limit)
      disk_limit    MiB a namespaced sandbox may write to its directory and /tmp (default
                    None: no limit of its own); its storage is then a tmpfs of that size,
                    memory charged to the sandbox (root only)
      image_cache   directory where task images (Call.image) are unpacked, once for all
                    their sandboxes and every manager sharing it (default:
                    $XDG_CACHE_HOME/tangram/images, else ~/.cache/tangram/images)
      containers    "podman" or "docker" (or a path to either): a trajectory whose calls
                    name an image runs in a container of that engine, the image a name in
                    its store (tangram.runtime.sandbox.containers); default None: tangram's own
                    image sandboxes, the image unpacked into image_cache
      container_options  more options for the engine's `run` of each container (a runtime,
                    --cap-drop, device flags)
      resource_control  "auto" (default: cgroup-v2, else cgroup-v1, else affinity), or one
                    of those to force it; TANGRAM_RESOURCE_CONTROL applies when "auto"
      cpu_limit     "guarantee" (default: the grant is a CPU weight over all the manager's
                    CPUs; idle cores are used) or "ceiling" (pinned to the granted CPUs, a
                    CFS quota for fractions: never more than the grant, even when idle)
      warm_sandboxes  workers kept started ahead of new trajectories (default 4; 0: start
                    each sandbox's worker at its first action). They start at the lowest
                    CPU weight, and taken ones are replaced once no action has run here
                    for half a second (sandbox.REFILL_AFTER_IDLE).
      preload       modules every sandbox worker imports as it starts, from the
                    orchestrator's sys.path (default: tangram.worker); a warm worker imports
                    them before it is taken, so a trajectory's first action does not
                    pay for the imports
      output_limit  bytes kept of each of a command's stdout and stderr (default 1 MiB)
      cpus          the CPU ids this manager may use (default: this process's affinity)
      env           extra environment variables for every sandbox
      inherit_env   names of variables passed through from the orchestrator's environment
                    (nothing else is: PATH and LANG only, by default)
    """

    name = "cpu"

    def __init__(self, root: str | None = None, isolation: str = "auto", output_limit: int = 1 << 20,
                 cpus: Iterable[int] | None = None, env: Mapping[str, str] | None = None,
                 inherit_env: Sequence[str] = (), cpu_limit: str = "guarantee",
                 warm_sandboxes: int = DEFAULT_WARM_SANDBOXES,
                 preload: Sequence[str] = ("tangram.worker",), network: bool = False,
                 visible_paths: Sequence[str] = (), pids_limit: int | None = DEFAULT_PIDS_LIMIT,
                 resource_control: str = "auto", disk_limit: float | None = None,
                 image_cache: str | None = None, containers: str | None = None,
                 container_options: Sequence[str] = ()) -> None:
        chosen, env = check_options(
            root=root, isolation=isolation, output_limit=output_limit, cpus=cpus, env=env, inherit_env=inherit_env,
            cpu_limit=cpu_limit, warm_sandboxes=warm_sandboxes, preload=preload, network=network,
            visible_paths=visible_paths, pids_limit=pids_limit, resource_control=resource_control,
            disk_limit=disk_limit, image_cache=image_cache, containers=containers,
            container_options=container_options)
        self.root = None if root is None else os.fspath(root)
        self.isolation_option = isolation
        self.resource_option = resource_control
        self.network = network
        self.visible_paths = [os.path.realpath(p) for p in visible_paths]
        self.pids_limit = pids_limit
        self.disk_limit = disk_limit
        self.image_cache = os.fspath(image_cache) if image_cache is not None else os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tangram", "images")
        self._images: ImageCache | None = None
        self._image_roots: dict[str, str] = {}  # reference -> unpacked root, resolved once per manager
        self.containers = None if containers is None else os.fspath(containers)
        self.container_options = list(container_options)
        self._containers: ContainerJail | None = None
        self.cpu_limit = cpu_limit
        self.warm_sandboxes = warm_sandboxes
        self.preload = tuple(preload)
        self.output_limit = output_limit
        self.cpus = chosen
        self.extra_env = env
        self.inherit_env = list(inherit_env)
        self.id = f"{os.getpid()}.{next(_ids)}"
        self.pool = CpuPool(chosen)
        self.isolation: Isolation | None = None  # resource control (cgroups or affinity)
        self.boundary: Boundary | None = None  # namespaces or process
        self._jail: Jail | None = None
        self.inventory_cores: float | None = None
        self._cgroups: ManagerCgroups | None = None
        self._dir: str | None = None
        # Keyed by trajectory; pooled sandboxes (Call.pooled) by -1, -2, ...
        self._sandboxes: dict[int, Sandbox] = {}
        self._pooled_idle: dict[str | None, list[int]] = {}  # image -> keys of the pooled sandboxes no action holds
        self._pooled_image: dict[int, str | None] = {}  # a pooled sandbox's image
        self._pooled_made = 0
        self._running: dict[int, _Running] = {}  # action id -> what a resize changes
        self._warm: WarmWorkers | None = None
        self._warm_images: dict[str, WarmWorkers] = {}  # an image's own, made at its first call
        self._warm_place: Any = None  # puts a warm worker in the warm cgroup
        self._warm_cgroup: SandboxCgroup | None = None  # idle warm workers: the lowest weight
        self._reaping: set[asyncio.Task[None]] = set()
        self._state = "new"

    @property
    def ceiling(self) -> bool:
        """Grants are pinned ceilings (cpu_limit="ceiling"), not weights."""
        return self.cpu_limit == "ceiling"

    # ------------------------------------------------------------------ lifecycle
    def check_call(self, call: Call) -> None:
        require_fn_or_command(call)

    def attach(self, inventory: Any) -> None:
        super().attach(inventory)
        try:
            self.inventory_cores = sum(float(n.resources.get("cpu", 0.0)) for n in inventory.nodes)
        except (AttributeError, TypeError, ValueError):
            self.inventory_cores = None

    async def start(self) -> None:
        if self._state == "running":
            return
        if self._state == "closed":
            raise ManagerError("managers.cpu", "this manager is closed")
        self.boundary = detect_boundary(self.isolation_option, field="managers.cpu.isolation")
        if self.boundary.reason:
            _log.warning("tangram CPU manager: sandboxes run as bare processes (isolation='process', unsafe for "
                         "untrusted code): %s", self.boundary.reason)
        if self.disk_limit is not None and not (self.boundary.namespaces and self.boundary.own_uids):
            raise ManagerError("managers.cpu.disk_limit", "a disk limit needs isolation='namespaces' under root (each "
                               "sandbox's storage is a tmpfs mounted for it)")
        self.isolation = detect(self.resource_option, field="managers.cpu.resource_control")
        if self.boundary.namespaces and self.boundary.own_uids:
            for gone in unmount_orphans(self.root or tempfile.gettempdir()):
                _log.warning("tangram CPU manager: removed the mounts and files of a manager that was killed: %s", gone)
        self._dir = tempfile.mkdtemp(prefix=f"tangram-{self.id}-", dir=self.root)
        if self.isolation.cgroup:
            try:
                self._cgroups = ManagerCgroups(self.isolation, f"tangram-{self.id.replace('.', '-')}", self.cpus)
            except BaseException:
                shutil.rmtree(self._dir, ignore_errors=True)
                raise
        path = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
        self._hello = ("hello", path, self.output_limit, "", not self.isolation.cgroup)
        self._preload = Preload(tuple(path), self.preload)
        if self.boundary.namespaces:
            # sys.path as it is: its '' (the working directory) is not shown to sandboxes
            self._jail = Jail(self.boundary, self._dir, python_paths(sys.path, self.visible_paths), self.network,
                              self.pids_limit if self._cgroups is None or "pids" not in self._cgroups.dirs else None,
                              None if self.disk_limit is None else int(self.disk_limit * 2**20))
        chosen = {k: os.environ[k] for k in self.inherit_env if k in os.environ}
        chosen.update(self.extra_env)
        self._base_env = {"PATH": os.environ.get("PATH", os.defpath), "LANG": os.environ.get("LANG", "C.UTF-8"), **chosen}
        self._container_env = chosen  # a container has its image's PATH and LANG
        if self.containers is not None:
            try:  # the engine's `info`, `ps` and `rm` take a tenth of a second or more: off the loop
                self._containers = await asyncio.to_thread(self._start_containers)
            except BaseException:
                if self._cgroups is not None:
                    self._cgroups.remove()
                    self._cgroups = None
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None
                raise
        self._all_cpus = int_ranges(self.cpus)
        if self.warm_sandboxes:
            place = None
            if self._cgroups is not None:
                self._warm_cgroup = self._cgroups.sandbox("warm")
                self._warm_cgroup.set_weight(0)
                self._warm_cgroup.set_pids(self.pids_limit)
                place = self._warm_cgroup.add_tree
            self._warm_place = place
            self._warm = WarmWorkers(self._dir, f"{self.id}/", self._base_env, self.warm_sandboxes, place, self._preload,
                                     self._jail)
            self._warm.fill()
        self._state = "running"

    def _start_containers(self) -> ContainerJail:
        """The container engine, checked, its containers left by killed managers removed."""
        field = "managers.cpu.containers"
        engine = engine_path(self.containers, field)  # type: ignore[arg-type]
        driver = check_engine(engine, field)
        for gone in remove_orphans(engine):
            _log.warning("tangram CPU manager: removed the container of a manager that was killed: %s", gone)
        parent = None
        if driver == "cgroupfs" and self._cgroups is not None:  # beside the manager's own sandboxes
            roots = {hierarchy_path(d) for d in dict.fromkeys(self._cgroups.dirs.values())}
            parent = roots.pop() if len(roots) == 1 else None
        read_only = python_paths(sys.path, self.visible_paths)
        assert self._dir is not None
        return ContainerJail(engine, self._dir, read_only, self.network, self.pids_limit, self.container_options,
                             parent, self.id)

    async def close(self) -> None:
        if self._state == "closed":
            return
        self._state = "closed"
        self._pooled_idle.clear()
        self._pooled_image.clear()
        errors: list[Any] = []
        try:
            errors = await asyncio.gather(*(self._end(t) for t in list(self._sandboxes)), return_exceptions=True)
            for pool in self._warm_pools():
                await pool.close()
            if self._warm_cgroup is not None:
                self._warm_cgroup.remove()
                self._warm_cgroup = None
            if self._reaping:
                await asyncio.gather(*self._reaping, return_exceptions=True)
        finally:
            kill_marked(self.id + "/")  # anything orphaned by a crashed worker that left its session
            if self._dir is not None:
                unmount_under(self._dir)  # a disk limit's tmpfs whose sandbox failed to close
            if self._cgroups is not None:
                self._cgroups.remove()
                self._cgroups = None
            if self._dir is not None:
                await asyncio.to_thread(shutil.rmtree, self._dir, True)
                self._dir = None
        for e in errors:
            if isinstance(e, BaseException):
                raise e

    async def end_trajectory(self, trajectory: int) -> None:
        await self._end(trajectory)

    async def _end(self, trajectory: int) -> None:
        sb = self._sandboxes.pop(trajectory, None)
        if sb is not None:
            await sb.close()

    def describe(self) -> Mapping[str, Any]:
        iso = self.isolation if self.isolation is not None else detect(self.resource_option,
                                                                       field="managers.cpu.resource_control")
        boundary = self.boundary if self.boundary is not None else detect_boundary(self.isolation_option,
                                                                                  field="managers.cpu.isolation")
        out: dict[str, Any] = {
            "isolation": boundary.isolation,
            "isolation_detail": boundary.description,
            "network": "open by default" if self.network else "none by default (Call.network=True opens it)",
            "pids_limit": self.pids_limit,
            "disk_limit": ("none of its own" if self.disk_limit is None else
                           f"{self.disk_limit:g} MiB (a tmpfs per sandbox, counted in its memory)"),
            "images": (f"Call.image: a container of {self.containers} per trajectory, the image from its store"
                       if self.containers is not None else
                       f"Call.image: unpacked once into {self.image_cache}, each sandbox an overlay of its own"
                       if boundary.namespaces and boundary.own_uids else
                       "none here (task images need isolation='namespaces' under root, or containers)"),
            "resource_control": iso.mechanism,
            "resource_control_detail": iso.description,
            "cpus": int_ranges(self.cpus),
            "output_limit": self.output_limit,
            "memory_limit": "cgroup memory limit of the sandbox" if iso.cgroup else "RLIMIT_AS (functions: growth of "
                            "the worker's address space; commands: each child's address space)",
            "cpu_limit": self.cpu_limit,
            "cpu_grant": (("a pinned ceiling: cpuset of the granted CPUs, a CFS quota for fractions" if self.ceiling else
                           "a guarantee: cgroup CPU weight proportional to the grant over all the manager's CPUs")
                          if iso.cgroup else "CPU affinity only (no weights or quotas without cgroups)"),
            "warm_sandboxes": self.warm_sandboxes,
            "preload": list(self.preload),
            "environment": sorted(["PATH", "LANG", "HOME", "TMPDIR", "TANGRAM_SANDBOX", "TANGRAM_GRANT_FILE",
                                   "TANGRAM_JOBSERVER", "TANGRAM_LIMIT", *self.inherit_env, *self.extra_env]),
            "sandboxes": len(self._sandboxes),
        }
        if self.inventory_cores is not None and self.inventory_cores > len(self.cpus):
            out["oversubscribed"] = f"the inventory declares {self.inventory_cores:g} cores for {len(self.cpus)} CPUs"
        return out

    # ------------------------------------------------------------------ state for tests and logs
    @property
    def usage(self) -> dict[int, float]:
        """Cores in use per CPU id (0.0 everywhere when no action runs)."""
        return {c: m / MILLI_PER_CORE for c, m in self.pool.used.items()}

    @property
    def sandbox_count(self) -> int:
        """Trajectories that hold a sandbox now."""
        return len(self._sandboxes)

    def processes(self) -> list[int]:
        """Live processes of this manager's sandboxes (a /proc scan by marker), not counting
        the idle warm workers (`warm_processes`)."""
        warm = {p for w in self.warm_processes() for p in (w, *descendants(w))}  # namespaced: bwrap's grandchild
        return [p for p in marked_processes(self.id + "/") if p not in warm]

    def warm_processes(self) -> list[int]:
        """The warm workers waiting for a new trajectory."""
        return [w.proc.pid for pool in self._warm_pools() for w in pool.idle]

    def _warm_pools(self) -> list[WarmWorkers]:
        return ([] if self._warm is None else [self._warm]) + list(self._warm_images.values())

    @property
    def pooled_sandbox_count(self) -> int:
        """Pooled sandboxes (Call.pooled) there are now, idle or running an action."""
        return sum(1 for key in self._sandboxes if key < 0)

    def sandbox_dir(self, trajectory: int) -> str:
        """The directory of `trajectory`'s sandbox on the host (a negative key: a pooled
        sandbox's). Namespaced, it is made at the sandbox's first start (its slot's home):
        before that a ManagerError."""
        assert self._dir is not None, "start() first"
        if self._jail is None:
            return self._process_dir(trajectory)
        sb = self._sandboxes.get(trajectory)
        if sb is None or sb.directory is None:
            raise ManagerError("managers.cpu", f"trajectory {trajectory} has no sandbox yet: a namespaced sandbox's "
                               "directory is made when its first action starts")
        return sb.directory

    def _process_dir(self, trajectory: int) -> str:
        assert self._dir is not None
        return os.path.join(self._dir, f"t{trajectory}" if trajectory >= 0 else f"pool{-trajectory}")

    # ------------------------------------------------------------------ actions
    def _sandbox(self, trajectory: int, image: str | None = None) -> Sandbox:
        """The trajectory's sandbox, made for `image` when it has none yet (a container's,
        with the option containers: its cgroup is the one its engine makes)."""
        sb = self._sandboxes.get(trajectory)
        if sb is None:
            if self._state != "running":
                raise ManagerError("managers.cpu", "start() the manager first" if self._state == "new" else "the manager is closed")
            name = f"sb-{trajectory}" if trajectory >= 0 else f"sb-pool{-trajectory}"
            container = image is not None and self._containers is not None
            cg = None if self._cgroups is None or container else self._cgroups.sandbox(name)
            if cg is not None:
                cg.set_pids(self.pids_limit)
            sb = Sandbox(trajectory, self._process_dir(trajectory), f"{self.id}/{trajectory}",
                         self._container_env if container else self._base_env, cg, self._hello,
                         None if container else self._warm, self._preload,
                         jail=self._containers if container else self._jail, on_limit=self._limit_from_action)
            if container:
                sb.image = image
            self._sandboxes[trajectory] = sb
        return sb

    async def execute(self, action: LiveAction, placement: Placement) -> Any:
        call = action.call
        if (call.fn is None) == (call.command is None):
            raise ActionFailed(action.id, "a CPU call needs exactly one of fn and command", "ValueError")
        image = None if call.image is None else await self._image_root(action.id, call.image)
        for pool in self._warm_pools():
            pool.hold_refill()  # busy again: no interpreter starts beside this action
        while True:
            key = self._take_pooled(image) if call.pooled else call.trajectory
            sb = self._sandbox(key, image)
            async with sb.lock:  # a trajectory's actions are sequential; never interleave two
                if sb.closed:  # its trajectory ended while this one waited: a fresh sandbox
                    continue
                if image is not None and sb.image != image:
                    if sb.slot is not None or sb.image is not None or self._containers is not None:
                        raise ActionFailed(action.id, f"call.image: trajectory {call.trajectory}'s sandbox runs "
                                           f"{self._image_name(sb.image)}; a trajectory keeps the image of its first "
                                           "call (end the trajectory to change it)", "ImageError")
                    sb.image = image
                    sb.warm = self._warm_for(image)
                running = self._running[action.id] = _Running(sb, self.pool.take(placement.cores), placement.cores)
                answered = False
                try:
                    result = await self._run(action, placement, running)
                    answered = True
                    return result
                finally:
                    del self._running[action.id]
                    if sb.grant is not None:
                        sb.grant.stop()
                    if sb.cgroup is not None:
                        sb.cgroup.idle(self.ceiling, sb.base_processes)
                    self.pool.release(running.charge)
                    if call.pooled:
                        self._give_back_pooled(key, answered, image)
                    if not self._running:
                        for pool in self._warm_pools():
                            pool.refill_soon()  # the node is idle: replace the taken ones

    def _take_pooled(self, image: str | None) -> int:
        """An idle pooled sandbox's key (of the same image), or a new one's: pooled
        sandboxes are as many as pooled actions have run at once."""
        idle = self._pooled_idle.get(image)
        if idle:
            return idle.pop()
        self._pooled_made += 1
        self._pooled_image[-self._pooled_made] = image
        return -self._pooled_made

    def _give_back_pooled(self, key: int, answered: bool, image: str | None) -> None:
        """Keeps a pooled sandbox for the next pooled action when its action answered (the
        call left it as it found it) and it still runs; else (a failure, a crash, a kill, a
        timeout, more idle than POOLED_IDLE_LIMIT) ends it, in the background."""
        sb = self._sandboxes.get(key)
        idle = self._pooled_idle.setdefault(image, [])
        if (answered and sb is not None and sb.alive and self._state == "running"
                and sum(len(keys) for keys in self._pooled_idle.values()) < POOLED_IDLE_LIMIT):
            idle.append(key)
            return
        self._pooled_image.pop(key, None)
        task = asyncio.get_running_loop().create_task(self._end(key))
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    async def _image_root(self, action_id: int, reference: str) -> str:
        """The unpacked root of a call's image (tangram.runtime.sandbox.images), resolved once per
        manager (an archive is hashed and unpacked once, off the loop). What cannot be
        used fails the action with error_type "ImageError", naming the cause."""
        root = self._image_roots.get(reference)
        if root is not None:
            return root
        if self._containers is not None:
            return await self._container_image(action_id, reference)
        boundary = self.boundary
        if boundary is None or not boundary.namespaces or not boundary.own_uids:
            why = ("sandboxes here are bare processes (isolation='process')" if boundary is None or not boundary.namespaces
                   else "the orchestrator is not root: an image sandbox's overlay and idmapped mounts need it")
            raise ActionFailed(action_id, f"call.image: {reference!r} cannot be used: {why}", "ImageError")
        if self._images is None:
            self._images = ImageCache(self.image_cache)
        try:
            root = await asyncio.to_thread(self._images.rootfs, reference)
        except ImageError as e:
            raise ActionFailed(action_id, str(e), "ImageError") from None
        self._image_roots[reference] = root
        return root

    async def _container_image(self, action_id: int, reference: str) -> str:
        """A call's image with the option containers: a name in the engine's store (a
        "podman:" or "docker:" prefix allowed, naming the same engine)."""
        engine = os.path.basename(self.containers)  # type: ignore[arg-type]
        scheme, _, rest = reference.partition(":")
        name = reference
        if scheme in ENGINES and rest:
            if scheme != engine:
                raise ActionFailed(action_id, f"call.image: {reference!r} names {scheme}'s store, and this manager "
                                   f"runs containers of {engine}", "ImageError")
            name = rest
        if os.path.isabs(name) or os.path.exists(name):
            raise ActionFailed(action_id, f"call.image: {reference!r} is a file or directory; containers run images "
                               f"of {engine}'s store (`{engine} load` or `{engine} import` it there first)", "ImageError")
        why = await asyncio.to_thread(image_known, self._containers.engine, name)  # type: ignore[union-attr]
        if why is not None:
            raise ActionFailed(action_id, f"call.image: {name!r} is not in {engine}'s image store: {why}", "ImageError")
        self._image_roots[reference] = name
        return name

    def _warm_for(self, image: str) -> WarmWorkers | None:
        """The warm workers of an image, started at its first call: warm_sandboxes of them
        per image in use (each with its slot and overlay made)."""
        if not self.warm_sandboxes or self._jail is None or self._containers is not None:
            return None
        pool = self._warm_images.get(image)
        if pool is None:
            assert self._dir is not None
            pool = self._warm_images[image] = WarmWorkers(self._dir, f"{self.id}/i{len(self._warm_images)}", self._base_env,
                                                          self.warm_sandboxes, self._warm_place, self._preload,
                                                          self._jail, image=image)
        return pool

    def _image_name(self, root: str | None) -> str:
        if root is None:
            return "on the host's root (no image)"
        names = [ref for ref, r in self._image_roots.items() if r == root]
        return f"image {names[0]!r}" if names else f"the image at {root}"

    def resize(self, action: LiveAction, placement: Placement) -> None:
        """The core changed a running action's grant to `placement.cores`: its weight (or,
        under ceilings, its CPUs and quota), its grant file and its jobserver tokens follow
        now. A resize of an action that already ended is ignored."""
        running = self._running.get(action.id)
        if running is None:
            return
        cores = placement.cores
        running.cores = cores
        cg = running.sandbox.cgroup
        if self.ceiling:
            self.pool.release(running.charge)
            running.charge = self.pool.take(cores)
            if cg is not None:
                self._apply_ceiling(cg, running.charge, cores)
        if cg is not None:
            cg.set_weight(cores)
        grant = running.sandbox.grant
        if grant is not None:  # None: its first worker is still starting, and starts at this grant
            grant.resize(cores)

    def _limit_from_action(self, action_id: int, cores: float) -> None:
        """A running action wrote a limit on its own grant (its GrantedExecutor has fewer
        tasks left than cores): the orchestrator bounds the grant, and the cores it gives
        back go to what waits. A word from an action that has ended is dropped."""
        if action_id in self._running and self.orchestrator is not None:
            self.orchestrator.limit_grant(action_id, cores)

    @staticmethod
    def _apply_ceiling(cg: Any, charge: Mapping[int, int], cores: float) -> None:
        cg.set_cpus(int_ranges(charge))
        whole = sum(1 for m in charge.values() if m >= MILLI_PER_CORE) == len(charge) and cores == len(charge)
        cg.set_quota(None if whole or cores <= 0 else cores)

    async def _run(self, action: LiveAction, placement: Placement, running: _Running) -> Any:
        call = action.call
        sb = running.sandbox
        ids = sorted(running.charge) if self.ceiling else self.cpus
        cpus = int_ranges(ids)
        env = _action_environment(action, placement, cpus)
        memory = int(placement.memory * 2**20) if placement.memory > 0 else 0
        gpu = "CUDA_VISIBLE_DEVICES" in placement.env
        mps = placement.env.get("CUDA_MPS_PIPE_DIRECTORY")
        needs = Needs(network=self.network if call.network is None else call.network, gpu=gpu,
                      writable=(mps,) if gpu and mps and os.path.isdir(mps) else ())
        try:
            await sb.ready(needs)  # a worker that died since the last action is replaced here
        except ContainerError as e:
            raise ActionFailed(action.id, str(e), "ContainerError") from None
        except ImageError as e:  # its root cannot be mounted (a directory that cannot be idmapped)
            raise ActionFailed(action.id, str(e), "ImageError") from None
        except asyncio.CancelledError:
            self._kill(sb)
            raise
        cg = sb.cgroup  # (a container's is known once it started)
        pin, rlimit = (tuple(ids), memory) if cg is None else (None, 0)
        payload = _request_payload(action, env, pin, rlimit)
        oom_before = pids_before = -1
        try:
            sb.grant.start(running.cores, action.id)  # type: ignore[union-attr]  # the latest grant: a resize may have come meanwhile
            if cg is not None:
                self._limit_cgroup(action, cg, running, cpus, memory, placement.memory)
            oom_before = cg.oom_kills() if cg is not None and memory > 0 else -1
            pids_before = cg.pids_refused() if cg is not None and cg.has_pids else -1
            data = await sb.request(payload)
        except asyncio.CancelledError:
            self._kill(sb)
            raise
        except WorkerDied as e:
            await self._worker_died(action, sb, e, cg, oom_before, pids_before, placement.memory)
        except ReplyTooLarge as e:  # not read: the worker was killed, its next action gets a new one
            raise ActionFailed(action.id, f"the reply is {e.size} bytes, more than the {MAX_REPLY_BYTES} a sandbox may "
                               "send back (return less: write large outputs to the sandbox's files)",
                               "ResultTooLarge") from None
        if oom_before >= 0 and cg.oom_kills() > oom_before:  # type: ignore[union-attr]
            raise ResourceLimitExceeded(action.id, f"a process of the action exceeded its {placement.memory:g} MiB "
                                        "memory limit and was killed", "memory")
        self._pids_exceeded(action, sb, pids_before)
        await self._disk_exceeded(action, sb)
        try:
            if len(data) <= _DECODE_ON_THE_LOOP:
                reply = load_reply(data)
            else:  # seconds for the largest replies: in a thread, the loop keeps its turns
                reply = await asyncio.get_running_loop().run_in_executor(None, load_reply, data)
        except Exception as e:  # Malformed, or anything else a hostile frame could raise
            self._kill(sb)  # a frame the worker did not write as it should: the channel is out of step
            why = str(e) if isinstance(e, Malformed) else type(e).__name__
            raise ActionFailed(action.id, f"the sandbox's reply is malformed: {why}", "ProtocolError") from None
        return _answer(action.id, reply)

    def _limit_cgroup(self, action: LiveAction, cg: Any, running: _Running, cpus: str, memory: int,
                      memory_mib: float) -> None:
        """The sandbox's cgroup set to the action's grant: its CPUs (or a ceiling), weight
        and memory."""
        if self.ceiling:
            self._apply_ceiling(cg, running.charge, running.cores)
        else:
            cg.set_cpus(cpus)
            cg.set_quota(None)
        cg.set_weight(running.cores)
        try:
            cg.set_memory(memory)
        except OSError as e:
            raise ResourceLimitExceeded(action.id, f"cannot limit the sandbox to {memory_mib:g} MiB: it "
                                        f"already uses more ({e.strerror})", "memory") from None

    async def _worker_died(self, action: LiveAction, sb: Sandbox, e: WorkerDied, cg: Any, oom_before: int,
                           pids_before: int, memory_mib: float) -> NoReturn:
        """Why the worker died under the action, as the error the action ends with: its
        memory, process or disk limit, else a crash with the worker log's tail."""
        if oom_before >= 0 and cg.oom_kills() > oom_before:
            raise ResourceLimitExceeded(action.id, f"the sandbox ran out of its {memory_mib:g} MiB memory "
                                        "limit and was killed", "memory") from None
        self._pids_exceeded(action, sb, pids_before)
        await self._disk_exceeded(action, sb)
        code = e.returncode
        tail = f"; worker log: {e.log_tail[-500:]}" if e.log_tail else ""
        if code is not None and code < 0:
            raise ActionCrashed(action.id, f"the sandbox worker was killed by signal {-code}{tail}",
                                signal=-code) from None
        raise ActionCrashed(action.id, f"the sandbox worker exited with status {code}{tail}", exit_code=code) from None

    def _pids_exceeded(self, action: LiveAction, sb: Sandbox, before: int) -> None:
        """The sandbox hit its PIDs limit during the action (a fork bomb, a runaway pool):
        the whole sandbox is killed (what it forked would hold the limit) and the action
        fails with ResourceLimitExceeded("pids"). Its files stay for the next action."""
        if before < 0 or sb.cgroup is None or sb.cgroup.pids_refused() <= before:
            return
        self._kill(sb)
        raise ResourceLimitExceeded(action.id, f"the sandbox reached its limit of {self.pids_limit} processes and "
                                    "threads and was killed", "pids")

    async def _disk_exceeded(self, action: LiveAction, sb: Sandbox) -> None:
        """The sandbox filled its disk limit during the action: it is killed, its directory
        and /tmp emptied (a full sandbox could do nothing more), and the action fails with
        ResourceLimitExceeded("disk")."""
        slot, jail = sb.slot, self._jail
        if jail is None or slot is None or not slot.mounted or not disk_full(slot.root):
            return
        sb.kill()
        await sb.reap()
        await asyncio.to_thread(jail.wipe, slot)
        raise ResourceLimitExceeded(action.id, f"the sandbox filled its disk limit of {self.disk_limit:g} MiB: it was "
                                    "killed and its files removed", "disk")

    def _kill(self, sb: Sandbox) -> None:
        """A cancel or timeout: kill the sandbox now, reap it in the background (close()
        waits for that); the next action of the trajectory starts a new worker."""
        sb.kill()
        task = asyncio.get_running_loop().create_task(sb.reap())
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)


def _action_environment(action: LiveAction, placement: Placement, cpus: str) -> dict[str, str]:
    """The environment an action runs with: its grant (cores, CPUs, thread counts), then
    the placement's (a GPU's) and the call's own variables."""
    cores = placement.cores
    n = str(whole_cores(cores))
    env = dict.fromkeys(_THREAD_VARS, n)
    env.update(placement.env)
    env.update(action.call.env)
    env["TANGRAM_CORES"] = n
    env["TANGRAM_GRANT"] = f"{cores:g}"
    env["TANGRAM_CPUS"] = cpus
    env["TANGRAM_ACTION"] = str(action.id)
    return env


_DECODE_ON_THE_LOOP = 1 << 20  # bytes of a reply decoded on the event loop; longer ones in a thread


def _request_payload(action: LiveAction, env: dict[str, str], pin: tuple[int, ...] | None, rlimit: int) -> bytes:
    """The request frame for the sandbox's worker: a function (cloudpickled) or a command."""
    call = action.call
    try:
        if call.fn is not None:
            return cloudpickle.dumps(("fn", call.fn, tuple(call.args), dict(call.kwargs), env, pin, rlimit),
                                     protocol=pickle.HIGHEST_PROTOCOL)
        command = call.command if isinstance(call.command, str) else [os.fspath(a) for a in call.command]  # type: ignore[union-attr]
        return pickle.dumps(("cmd", command, env, pin, rlimit), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise ActionFailed(action.id, f"the call cannot be sent to the sandbox: {type(e).__name__}: {e}",
                           type(e).__name__) from None


def _answer(action_id: int, reply: tuple[Any, ...]) -> Any:
    """The worker's reply (decoded and checked by tangram.runtime.sandbox.replies: plain data
    only, as what made it ran in the sandbox) as the action's result, or the error it ends
    with."""
    kind = reply[0]
    if kind == "ok":
        return reply[1]
    if kind == "result":
        return CommandResult(reply[1], reply[2], reply[3], reply[4])
    if kind == "memory":
        raise ResourceLimitExceeded(action_id, reply[1], "memory")
    raise ActionFailed(action_id, reply[2], reply[1], reply[3])  # "error": load_reply let no other kind through


class _Running:
    """A running action of the CPU manager: what a resize changes."""

    __slots__ = ("sandbox", "charge", "cores")

    def __init__(self, sandbox: Sandbox, charge: dict[int, int], cores: float) -> None:
        self.sandbox = sandbox
        self.charge = charge
        self.cores = cores


__all__ = ["CPU_LIMITS", "CpuManager", "CpuPool"]
