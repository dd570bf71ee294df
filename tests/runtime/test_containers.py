"""Trajectory sandboxes as podman containers (CpuManager option containers; tangram.runtime.sandbox.containers).

A busybox image is imported into this machine's podman store offline (`podman import`, the
root the image-sandbox tests build), with an ENV of its own. Each test starts real
containers through the real engine: start at a trajectory's first action, one exec per
worker, grants written into the container's cgroup, kills that keep the container, `rm`
at the trajectory's end and at close(); the escape attempts run inside them.

Engine configuration: some machines cannot run podman's defaults (crun refuses a hybrid
cgroup v1 host; podman's default ulimits exceed a container host's hard limits). The module
finds a configuration that runs a container here, first the defaults, then runc with
`default_ulimits = []`, and skips, saying why, when none does. docker is not installed on
the machines these tests run on: its code path (the same CLI) is not exercised here.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import socket
import subprocess
import tarfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from test_image_sandboxes import busybox_root

from tangram.runtime.call import Call, Placement
from tangram.runtime.managers.cpu import CpuManager
from tangram.runtime.errors import ActionFailed, ManagerError, ResourceLimitExceeded
from tangram.runtime.sandbox.isolation import detect as detect_resources
from tangram.runtime.managers.base import LiveAction
from tangram.runtime.sandbox.kills import marked_processes

PODMAN = shutil.which("podman")
pytestmark = [
    pytest.mark.skipif(PODMAN is None, reason="podman is not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="these tests run rootful podman"),
    pytest.mark.skipif(not detect_resources().cgroup, reason="no writable cgroups here"),
]
_ids = itertools.count(1)
IMAGE = f"localhost/tangram-test-containers:{os.getpid()}"
OTHER_IMAGE = f"localhost/tangram-test-containers-other:{os.getpid()}"  # the same, tagged again


def _works(env: dict[str, str], options: list[str]) -> str | None:
    """None when podman runs a container of IMAGE with `options` under `env`, else its words."""
    done = subprocess.run([PODMAN, "run", "--rm", "--network", "none", *options, IMAGE, "true"],  # type: ignore[list-item]
                          env=env, capture_output=True, text=True, timeout=120)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The image in podman's store and the options that run it here: (options, env)."""
    base = tmp_path_factory.mktemp("containers")
    root = busybox_root(base / "root")
    archive = base / "busybox.tar"
    with tarfile.open(archive, "w") as tar:
        for entry in sorted(root.iterdir()):
            tar.add(entry, arcname=entry.name)
    subprocess.run([PODMAN, "import", "-q", "--change", "ENV=IMAGE_SAYS=hello", "--change",  # type: ignore[list-item]
                    "ENV=PATH=/opt/tools:/bin", str(archive), IMAGE], check=True, capture_output=True)
    subprocess.run([PODMAN, "tag", IMAGE, OTHER_IMAGE], check=True, capture_output=True)  # type: ignore[list-item]
    conf = base / "containers.conf"
    conf.write_text("[containers]\ndefault_ulimits = []\n")
    tried = []
    found = None
    for env, options in (({}, []), ({"CONTAINERS_CONF": str(conf)}, ["--runtime", "runc"])):
        why = _works({**os.environ, **env}, options)
        if why is None:
            found = (options, env)
            break
        tried.append(f"{options or 'defaults'}: {why}")
    try:
        if found is None:
            pytest.skip("podman cannot run a container here: " + "; ".join(tried))
        yield found
    finally:
        subprocess.run([PODMAN, "rmi", "-f", IMAGE, OTHER_IMAGE], capture_output=True)  # type: ignore[list-item]


@pytest.fixture(autouse=True)
def nothing_left(engine: Any) -> Any:
    yield
    assert marked_processes(f"{os.getpid()}.") == []
    names = subprocess.run([PODMAN, "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True,  # type: ignore[list-item]
                           env={**os.environ, **engine[1]}).stdout.split()
    assert not [n for n in names if n.startswith(f"tangram-{os.getpid()}.")], names


def placement(cores: float = 1.0, memory: float = 0.0) -> Placement:
    return Placement(action_id=0, node=0, node_name="local", device=None, grant=cores, cores=cores, memory=memory,
                     gpu_memory=0.0, env={})


def with_manager(engine: Any, body: Callable[[CpuManager], Awaitable[None]], monkeypatch: pytest.MonkeyPatch,
                 **options: Any) -> None:
    run_options, env = engine
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    options.setdefault("warm_sandboxes", 0)
    mgr = CpuManager(containers="podman", container_options=run_options, **options)

    async def main() -> None:
        await mgr.start()
        try:
            await body(mgr)
        finally:
            await mgr.close()

    asyncio.run(main())


async def run(mgr: CpuManager, cores: float = 1.0, memory: float = 0.0, **call: Any) -> Any:
    call.setdefault("image", IMAGE)
    return await mgr.execute(LiveAction(next(_ids), Call(**call)), placement(cores, memory))


async def sh(mgr: CpuManager, script: str, trajectory: int = 1, **call: Any) -> str:
    result = await run(mgr, command=script, trajectory=trajectory, **call)
    assert result.returncode == 0, result.stderr
    return result.stdout.decode()


def look_around() -> dict[str, Any]:
    import os
    import sys
    return {"uid": os.getuid(), "cwd": os.getcwd(), "root": sorted(os.listdir("/")), "says": os.environ.get("IMAGE_SAYS"),
            "path": os.environ.get("PATH"), "home": os.environ.get("HOME"), "python": sys.version_info[:2],
            "testbed": open("/testbed/project.py").read()}


def _container(mgr: CpuManager, trajectory: int) -> Any:
    return mgr._sandboxes[trajectory].slot


def test_commands_and_functions_run_in_the_images_container(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    async def body(mgr: CpuManager) -> None:
        out = await sh(mgr, "cat /etc/os-release; echo $IMAGE_SAYS $PATH $HOME; pwd; id -u")
        assert "NAME=tangram-test-busybox" in out
        assert "hello /opt/tools:/bin /sandbox" in out  # the image's ENV, PATH included; HOME is the sandbox's
        assert out.split()[-2:] == ["/sandbox", "0"]
        seen = await run(mgr, fn=look_around, trajectory=1)
        assert seen["says"] == "hello" and seen["cwd"] == seen["home"] == "/sandbox" and seen["uid"] == 0
        assert tuple(seen["python"]) == sys.version_info[:2]  # the orchestrator's interpreter, on the image's files
        assert seen["testbed"] == "def answer():\n    return 41\n" and "work" not in seen["root"]
        slot = _container(mgr, 1)
        with open(f"/proc/{slot.init}/status") as f:
            host_uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
        assert host_uid == slot.uid >= 1 << 31  # the container's root is an unprivileged uid of the host
        worker = [p for p in mgr.processes()]
        cgroup = Path(f"/proc/{slot.init}/cgroup").read_text()
        assert worker and all(Path(f"/proc/{p}/cgroup").read_text() == cgroup
                              for p in worker)  # the worker runs in the container's cgroup
        assert (Path(mgr.sandbox_dir(1)) / ".").exists()

    with_manager(engine, body, monkeypatch)


def test_each_trajectory_has_its_container_and_the_image_never_changes(engine: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    async def body(mgr: CpuManager) -> None:
        await asyncio.gather(*(sh(mgr, f"echo 'EDIT = {t}' >> /testbed/project.py; echo {t} > $HOME/mine", t)
                               for t in (1, 2, 3)))
        names = {_container(mgr, t).name for t in (1, 2, 3)}
        assert len(names) == 3
        for t in (1, 2, 3):
            out = await sh(mgr, "cat /testbed/project.py $HOME/mine", t)
            assert out.count("EDIT =") == 1 and f"EDIT = {t}" in out and out.endswith(f"{t}\n")
        gone = _container(mgr, 2).name
        await mgr.end_trajectory(2)
        listed = subprocess.run([PODMAN, "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True).stdout  # type: ignore[list-item]
        assert gone not in listed.split()  # stopped and removed with its trajectory
        assert "EDIT" not in await sh(mgr, "cat /testbed/project.py", 2)  # a new trajectory: the image as it is

    with_manager(engine, body, monkeypatch)


def test_grants_go_to_the_containers_cgroup_and_kills_keep_the_container(engine: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    async def body(mgr: CpuManager) -> None:
        await sh(mgr, "echo kept > $HOME/file")
        cg = mgr._sandboxes[1].cgroup
        assert cg is _container(mgr, 1).cgroup
        if mgr._containers.cgroup_parent is not None:  # type: ignore[union-attr]  # cgroupfs: beside its sandboxes
            assert cg.dirs["cpu"].startswith(mgr._cgroups.dirs["cpu"] + "/")  # type: ignore[union-attr]
        shares = os.path.join(cg.dirs["cpu"], "cpu.weight" if cg.v2 else "cpu.shares")
        # a running action's grant changes: its weight and its grant file follow
        action = LiveAction(next(_ids), Call(command="sleep 0.5; cat $TANGRAM_GRANT_FILE", trajectory=1, image=IMAGE))
        task = asyncio.ensure_future(mgr.execute(action, placement(1.0)))
        await asyncio.sleep(0.3)
        first = int(Path(shares).read_text())
        mgr.resize(action, placement(2.0))
        assert int(Path(shares).read_text()) == 2 * first
        result = await task
        assert float(result.stdout) == 2.0
        # a memory limit in the container's cgroup
        with pytest.raises(ResourceLimitExceeded) as e:
            await run(mgr, fn=bytearray, args=(256 << 20,), trajectory=1, memory=64)
        assert e.value.limit == "memory"
        assert not os.path.exists("oom")  # the engine's monitor notes an OOM kill where it runs: not here
        # a timeout kills what the action runs, not the container
        init = _container(mgr, 1).init
        slow = LiveAction(next(_ids), Call(command="sleep 60", trajectory=1, image=IMAGE))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(mgr.execute(slow, placement()), 1.0)
        for _ in range(100):
            if not [p for p in cg.procs()]:
                break
            await asyncio.sleep(0.02)
        assert cg.procs() == [] and os.path.exists(f"/proc/{init}")
        assert await sh(mgr, "cat $HOME/file") == "kept\n"  # the same container, a new worker
        assert _container(mgr, 1).init == init
        # a worker killed from outside between actions: the next action starts another
        killed = mgr.processes()
        for p in killed:
            os.kill(p, 9)
        while any(os.path.exists(f"/proc/{p}") and "Z" not in Path(f"/proc/{p}/stat").read_text().split(")")[-1][:3]
                  for p in killed):
            time.sleep(0.01)  # gone (the engine's exec, which the loop watches, may still be running)
        assert await sh(mgr, "cat $HOME/file") == "kept\n"

    with_manager(engine, body, monkeypatch)


def test_escape_attempts_from_a_container_fail(engine: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("key")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    def attempts(secret: str, root_secret: str, port: int, me: int) -> dict[str, str]:
        import os
        import signal
        import socket
        out = {}
        for name, f in {"secret": lambda: open(secret).read(),
                        "host_root": lambda: open("/run/host" + root_secret).read(),
                        "host_etc": lambda: open("/run/host/etc/hostname").read(),
                        "root": lambda: open(root_secret).read(),
                        "port": lambda: socket.create_connection(("127.0.0.1", port), timeout=2),
                        "outside": lambda: socket.create_connection(("10.0.0.1", 80), timeout=2),
                        "host_python": lambda: open(os.__file__, "a"),
                        "host_usr": lambda: open("/run/host/usr/planted", "w"),
                        "control": lambda: open("/run/tangram/planted", "w"),
                        "signal_orchestrator": lambda: os.kill(me, signal.SIGTERM),
                        "proc_sys": lambda: open("/proc/sys/kernel/hostname", "w").write("x"),
                        "mknod": lambda: os.mknod("/sandbox/sda", 0o600 | 0o60000, os.makedev(8, 0))}.items():
            try:
                f()
                out[name] = "ok"
            except OSError as e:
                out[name] = type(e).__name__
        return out

    async def body(mgr: CpuManager) -> None:
        out = await run(mgr, fn=attempts, args=(str(secret), str(root_secret), port, os.getpid()), trajectory=1)
        assert all(v != "ok" for v in out.values()), out
        said = await run(mgr, command=f"nc 127.0.0.1 {port} < /dev/null", trajectory=1)
        assert said.returncode != 0
        ps = await sh(mgr, "ls /proc | grep -c '^[0-9]'")
        assert int(ps) <= 5  # its init, the worker, sh, ls and grep: no process of the host
        with pytest.raises(ResourceLimitExceeded) as e:  # a fork bomb meets the PIDs limit
            await run(mgr, command="bomb() { bomb | bomb & }; bomb; sleep 5", trajectory=1)
        assert e.value.limit == "pids"
        assert await sh(mgr, "echo alive") == "alive\n"

    root_secret = Path(os.path.expanduser("~root"), f".tangram-test-secret-{os.getpid()}")
    root_secret.write_text("key")
    try:
        with_manager(engine, body, monkeypatch, pids_limit=64)
    finally:
        server.close()
        root_secret.unlink()
    assert not os.path.exists("/usr/planted")


def test_what_cannot_work_is_a_typed_error(engine: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    async def body(mgr: CpuManager) -> None:
        with pytest.raises(ActionFailed) as e:
            await run(mgr, command="true", trajectory=1, image="localhost/tangram-test-absent:1")
        assert e.value.error_type == "ImageError" and "tangram-test-absent" in str(e.value) and "store" in str(e.value)
        with pytest.raises(ActionFailed) as e:
            await run(mgr, command="true", trajectory=1, image=str(tmp_path))
        assert e.value.error_type == "ImageError" and "podman load" in str(e.value)
        with pytest.raises(ActionFailed) as e:
            await run(mgr, command="true", trajectory=1, image="docker:" + IMAGE)
        assert e.value.error_type == "ImageError" and "docker" in str(e.value)
        await sh(mgr, "true", 2, image="podman:" + IMAGE)
        assert await sh(mgr, "echo $IMAGE_SAYS", 2, image=None) == "hello\n"  # a later call without image: its container
        with pytest.raises(ActionFailed) as e:  # a trajectory keeps its container
            await run(mgr, command="true", trajectory=2, image=OTHER_IMAGE)
        assert e.value.error_type == "ImageError" and "keeps the image of its first call" in str(e.value)
        with pytest.raises(ActionFailed) as e:  # its network is fixed when it starts
            await run(mgr, command="true", trajectory=2, network=True)
        assert e.value.error_type == "ContainerError" and "without a network" in str(e.value)

    with_manager(engine, body, monkeypatch)

    async def refused(mgr: CpuManager) -> None:
        with pytest.raises(ActionFailed) as e:  # the engine's own refusal, in its words
            await run(mgr, command="true", trajectory=1)
        assert e.value.error_type == "ContainerError" and "no-such-runtime" in str(e.value)

    with_manager((["--runtime", "no-such-runtime"], engine[1]), refused, monkeypatch)

    for options, field in (({"containers": "lxc"}, "managers.cpu.containers"),
                           ({"containers": "podman", "disk_limit": 16}, "managers.cpu.disk_limit"),
                           ({"container_options": ["--privileged"]}, "managers.cpu.container_options"),
                           ({"containers": "podman", "container_options": "--privileged"},
                            "managers.cpu.container_options")):
        with pytest.raises(ManagerError) as m:
            CpuManager(**options)
        assert m.value.field == field

    async def absent() -> None:
        mgr = CpuManager(containers=str(tmp_path / "podman"))
        try:
            with pytest.raises(ManagerError) as m:
                await mgr.start()
            assert m.value.field == "managers.cpu.containers" and "not installed" in str(m.value)
        finally:
            await mgr.close()

    asyncio.run(absent())


KILLED_MANAGER = """
import asyncio, sys
from tangram.runtime.call import Call, Placement
from tangram.runtime.managers.cpu import CpuManager
from tangram.runtime.managers.base import LiveAction

async def main():
    mgr = CpuManager(warm_sandboxes=0, containers="podman", container_options=sys.argv[2:])
    await mgr.start()
    place = Placement(action_id=0, node=0, node_name="local", device=None, grant=1.0, cores=1.0, memory=0.0,
                      gpu_memory=0.0, env={})
    await mgr.execute(LiveAction(1, Call(command="true", trajectory=1, image=sys.argv[1])), place)
    print("ready", mgr._sandboxes[1].slot.name, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def test_a_killed_managers_containers_are_removed_by_the_next_one(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    run_options, env = engine
    proc = subprocess.Popen([sys.executable, "-c", KILLED_MANAGER, IMAGE, *run_options], stdout=subprocess.PIPE,
                            env={**os.environ, **env})
    try:
        assert proc.stdout is not None
        said = proc.stdout.readline().split()
        assert said[:1] == [b"ready"]
        name = said[1].decode()
    finally:
        proc.kill()  # no close(): its container stays
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    listed = lambda: subprocess.run([PODMAN, "ps", "-a", "--format", "{{.Names}}"], capture_output=True,  # type: ignore[list-item]
                                    text=True, env={**os.environ, **env}).stdout.split()
    assert name in listed()

    async def nothing(mgr: CpuManager) -> None:
        return None

    with_manager(engine, nothing, monkeypatch)  # its start() removes the killed one's container
    assert name not in listed()
    for _ in range(100):  # its worker, killed with the container, is reaped by the engine
        if not marked_processes(f"{proc.pid}."):
            break
        time.sleep(0.05)


def test_pooled_containers_are_reused_beside_the_hosts_warm_workers(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Call.pooled with an image: a container per pooled action running at once, each kept
    for the next; the manager's warm workers (for sandboxes on the host) are not used for
    containers."""
    async def body(mgr: CpuManager) -> None:
        for _ in range(3):
            out = await run(mgr, command="cat /etc/os-release; echo $IMAGE_SAYS", pooled=True)
            assert "NAME=tangram-test-busybox" in out.stdout.decode() and "hello" in out.stdout.decode()
        assert mgr.pooled_sandbox_count == 1
        outs = await asyncio.gather(*(run(mgr, command="sleep 0.3; echo $IMAGE_SAYS", pooled=True) for _ in range(3)))
        assert all(o.stdout == b"hello\n" for o in outs)
        assert mgr.pooled_sandbox_count == 3
        assert (await run(mgr, command="echo host", pooled=True, image=None)).stdout == b"host\n"
        assert len(mgr.warm_processes()) >= 1  # the host's warm pool is untouched by containers

    with_manager(engine, body, monkeypatch, warm_sandboxes=2)
