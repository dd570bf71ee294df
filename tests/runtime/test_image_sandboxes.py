"""Sandboxes on a task image (Call.image; tangram.runtime.sandbox.rootfs): a busybox image built here,
offline, from the Debian package busybox-static, as a root directory and as an OCI layout.
Commands run the image's programs; functions run the orchestrator's Python with the image
as /; each sandbox writes to its own overlay, so no trajectory sees another's edits and the
image never changes; what cannot work is an ImageError naming the cause; nothing stays
mounted or running after close()."""

from __future__ import annotations

import asyncio
import io
import itertools
import os
import shutil
import socket
import tarfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from test_images import oci_layout

from tangram.runtime.call import Call, Placement
from tangram.runtime.managers.cpu import CpuManager
from tangram.runtime.errors import ActionFailed, ResourceLimitExceeded
from tangram.runtime.managers.base import LiveAction
from tangram.runtime.sandbox.namespaces import detect
from tangram.runtime.sandbox.kills import marked_processes

BOUNDARY = detect("auto")
BUSYBOX = shutil.which("busybox") or "/bin/busybox"
pytestmark = [
    pytest.mark.skipif(not BOUNDARY.namespaces, reason=f"no namespaces here: {BOUNDARY.reason}"),
    pytest.mark.skipif(os.geteuid() != 0, reason="image sandboxes mount an overlay (root only)"),
    pytest.mark.skipif(not os.path.exists(BUSYBOX), reason="busybox-static is not installed"),
]
_ids = itertools.count(1)
TESTBED = "def answer():\n    return 41\n"


def busybox_root(path: Path) -> Path:
    """A root filesystem of a static busybox and its applets, a project at /testbed and an
    /etc/os-release that names it."""
    (path / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, path / "bin" / "busybox")
    for applet in ("sh", "ls", "cat", "echo", "id", "wc", "head", "rm", "mkdir", "touch", "nc", "true"):
        os.symlink("busybox", path / "bin" / applet)
    (path / "etc").mkdir()
    (path / "etc" / "os-release").write_text("NAME=tangram-test-busybox\n")
    (path / "testbed").mkdir()
    (path / "testbed" / "project.py").write_text(TESTBED)
    (path / "tmp").mkdir(mode=0o1777)
    return path


def oci_layout_of(root: Path, path: Path) -> Path:
    """`root` as a one-layer OCI image layout at `path`."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        for entry in sorted(root.iterdir()):
            tar.add(entry, arcname=entry.name)
    return oci_layout(path, [data.getvalue()])


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("images")
    root = busybox_root(base / "busybox-root")
    return {"root": str(root), "oci": str(oci_layout_of(root, base / "busybox-oci")), "cache": str(base / "cache")}


@pytest.fixture(autouse=True)
def nothing_left() -> Any:
    yield
    assert marked_processes(f"{os.getpid()}.") == []
    with open("/proc/self/mountinfo") as f:
        assert "tangram-" not in f.read(), "a mount of a sandbox outlived its manager"


def placement() -> Placement:
    return Placement(action_id=0, node=0, node_name="local", device=None, grant=1.0, cores=1.0, memory=0.0,
                     gpu_memory=0.0, env={})


def with_manager(images: dict[str, str], body: Callable[[CpuManager], Awaitable[None]], **options: Any) -> None:
    options.setdefault("warm_sandboxes", 0)
    mgr = CpuManager(isolation=options.pop("isolation", "namespaces"), image_cache=images["cache"], **options)

    async def main() -> None:
        await mgr.start()
        try:
            await body(mgr)
        finally:
            await mgr.close()

    asyncio.run(main())


async def run(mgr: CpuManager, **call: Any) -> Any:
    return await mgr.execute(LiveAction(next(_ids), Call(**call)), placement())


async def sh(mgr: CpuManager, script: str, trajectory: int = 1, **call: Any) -> str:
    result = await run(mgr, command=script, trajectory=trajectory, **call)
    assert result.returncode == 0, result.stderr
    return result.stdout.decode()


def look_around() -> dict[str, Any]:
    import os
    import sys
    return {"uid": os.getuid(), "owner": os.stat("/testbed/project.py").st_uid, "root": sorted(os.listdir("/")),
            "release": open("/etc/os-release").read(), "python": sys.version_info[:2]}


def test_commands_run_the_images_programs_on_its_files(images: dict[str, str]) -> None:
    async def body(mgr: CpuManager) -> None:
        out = await sh(mgr, "cat /etc/os-release; ls /; id -u; ls -ln /testbed/project.py", image=images["oci"])
        assert "NAME=tangram-test-busybox" in out
        listing = out.split()
        assert "testbed" in listing and "work" not in listing and "home" not in listing  # the image's /, not the host's
        uid = int(out.splitlines()[-2])
        assert uid >= 1 << 30  # the sandbox's own unprivileged uid
        assert out.splitlines()[-1].split()[2] == str(uid)  # it owns what the image's root owns

    with_manager(images, body)


def test_functions_run_the_orchestrators_python_with_the_image_as_root(images: dict[str, str]) -> None:
    async def body(mgr: CpuManager) -> None:
        import sys
        seen = await run(mgr, fn=look_around, trajectory=1, image=images["root"])
        assert seen["release"] == "NAME=tangram-test-busybox\n"
        assert seen["owner"] == seen["uid"] >= 1 << 30
        assert tuple(seen["python"]) == sys.version_info[:2]
        assert "testbed" in seen["root"] and "work" not in seen["root"]
        # a later call of the trajectory without image= runs in its sandbox's image
        assert (await sh(mgr, "cat /etc/os-release", trajectory=1)).startswith("NAME=tangram-test-busybox")

    with_manager(images, body)


def test_each_trajectory_edits_its_own_copy_and_the_image_never_changes(images: dict[str, str]) -> None:
    before = Path(images["root"], "testbed", "project.py").read_text()

    async def body(mgr: CpuManager) -> None:
        for t in (1, 2, 3):
            await sh(mgr, f"echo 'EDIT = {t}' >> /testbed/project.py; rm /etc/os-release; mkdir /new{t}", t,
                     image=images["oci"])
        for t in (1, 2, 3):
            out = await sh(mgr, "cat /testbed/project.py; ls /; cat /etc/os-release 2>&1 || true", t)
            assert out.count("EDIT =") == 1 and f"EDIT = {t}" in out  # its own edit only
            assert f"new{t}" in out and all(f"new{o}" not in out for o in (1, 2, 3) if o != t)
            assert "NAME=" not in out
        await mgr.end_trajectory(2)
        out = await sh(mgr, "cat /testbed/project.py; cat /etc/os-release", 2, image=images["oci"])
        assert "EDIT" not in out and "NAME=tangram-test-busybox" in out  # a new trajectory: the image as it is

    with_manager(images, body)
    assert Path(images["root"], "testbed", "project.py").read_text() == before
    cached = [p for p in Path(images["cache"]).rglob("project.py")]
    assert cached and all(p.read_text() == before for p in cached)  # the unpacked copy too


def test_no_network_nor_host_files_and_the_host_python_is_read_only(images: dict[str, str], tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("key")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    def attempts(secret: str, port: int) -> dict[str, str]:
        import os
        import socket
        out = {}
        for name, f in {"secret": lambda: open(secret).read(),
                        "port": lambda: socket.create_connection(("127.0.0.1", port), timeout=2),
                        "host_python": lambda: open(os.__file__, "a"),
                        "host_usr": lambda: open("/run/host/usr/planted", "w")}.items():
            try:
                f()
                out[name] = "ok"
            except OSError as e:
                out[name] = type(e).__name__
        return out

    async def body(mgr: CpuManager) -> None:
        out = await run(mgr, fn=attempts, args=(str(secret), port), trajectory=1, image=images["root"])
        assert all(v != "ok" for v in out.values()), out
        said = await run(mgr, command=f"nc 127.0.0.1 {port} < /dev/null", trajectory=1, image=images["root"])
        assert said.returncode != 0 and "can't connect" in said.stderr.decode()  # the image's own programs neither

    try:
        with_manager(images, body)
    finally:
        server.close()
    assert not os.path.exists("/usr/planted")


def test_what_cannot_work_is_an_image_error(images: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "oci-layout").write_text("{")

    async def body(mgr: CpuManager) -> None:
        for reference, cause in ((str(tmp_path / "missing"), "no such file"), (str(tmp_path / "corrupt"), "")):
            with pytest.raises(ActionFailed) as e:
                await run(mgr, command="true", trajectory=1, image=reference)
            assert e.value.error_type == "ImageError" and reference in str(e.value) and cause in str(e.value)
        await sh(mgr, "true", 2, image=images["root"])
        with pytest.raises(ActionFailed) as e:  # a trajectory keeps its image
            await run(mgr, command="true", trajectory=2, image=images["oci"])
        assert e.value.error_type == "ImageError" and "keeps the image of its first call" in str(e.value)
        await sh(mgr, "true", 3)
        with pytest.raises(ActionFailed) as e:  # started on the host's root
            await run(mgr, command="true", trajectory=3, image=images["root"])
        assert "no image" in str(e.value)

    with_manager(images, body)

    async def bare(mgr: CpuManager) -> None:
        with pytest.raises(ActionFailed) as e:
            await run(mgr, command="true", trajectory=1, image=images["root"])
        assert e.value.error_type == "ImageError" and "isolation='process'" in str(e.value)

    with_manager(images, bare, isolation="process")


def test_filling_the_disk_limit_in_an_image_drops_its_changes(images: dict[str, str]) -> None:
    async def body(mgr: CpuManager) -> None:
        await sh(mgr, "echo 'EDIT' >> /testbed/project.py", 1, image=images["root"])
        with pytest.raises(ResourceLimitExceeded) as e:
            await run(mgr, command="head -c 67108864 /dev/zero > /testbed/big", trajectory=1)
        assert e.value.limit == "disk"
        out = await sh(mgr, "cat /testbed/project.py; ls /testbed", 1)
        assert "EDIT" not in out and "big" not in out  # the image as it is, the sandbox works again

    with_manager(images, body, disk_limit=16)


def test_warm_workers_per_image_and_pooled_sandboxes_per_image(images: dict[str, str]) -> None:
    async def body(mgr: CpuManager) -> None:
        await sh(mgr, "true", 1, image=images["root"])  # the image's warm pool starts once nothing runs
        for _ in range(200):
            if len(mgr.warm_processes()) == 2 * 2:  # the host's pool and the image's
                break
            await asyncio.sleep(0.05)
        assert len(mgr.warm_processes()) == 4
        starts = [p for p in mgr.warm_processes()]
        assert "NAME=tangram" in await sh(mgr, "cat /etc/os-release", 2, image=images["root"])
        assert len(set(starts) - set(mgr.warm_processes())) == 1  # it took one of the image's warm workers
        for image, expected in ((images["root"], "NAME=tangram"), (None, "")):
            for _ in range(2):
                out = (await run(mgr, command="cat /etc/os-release", pooled=True, image=image)).stdout.decode()
                assert expected in out and ("tangram" in out) == (image is not None)
        assert mgr.pooled_sandbox_count == 2  # one per image, each reused

    with_manager(images, body, warm_sandboxes=2)


KILLED_MANAGER = """
import asyncio, sys
from tangram.runtime.call import Call, Placement
from tangram.runtime.managers.cpu import CpuManager
from tangram.runtime.managers.base import LiveAction

async def main():
    mgr = CpuManager(isolation="namespaces", warm_sandboxes=0, root=sys.argv[1], image_cache=sys.argv[2],
                     disk_limit=16)
    await mgr.start()
    place = Placement(action_id=0, node=0, node_name="local", device=None, grant=1.0, cores=1.0, memory=0.0,
                      gpu_memory=0.0, env={})
    await mgr.execute(LiveAction(1, Call(command="true", trajectory=1, image=sys.argv[3])), place)
    print("ready", flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def test_a_killed_managers_mounts_are_removed_by_the_next_one(images: dict[str, str], tmp_path: Path) -> None:
    import subprocess
    import sys
    root = tmp_path / "root"
    root.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", KILLED_MANAGER, str(root), images["cache"], images["root"]],
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    finally:
        proc.kill()  # no close(): its tmpfs and its image's layers stay mounted
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    with open("/proc/self/mountinfo") as f:
        assert str(root) in f.read()

    async def nothing(mgr: CpuManager) -> None:
        return None

    with_manager(images, nothing, root=str(root))  # its start() cleans up after the killed one
    with open("/proc/self/mountinfo") as f:
        assert str(root) not in f.read()
    assert os.listdir(root) == []


def test_many_image_sandboxes_start_at_once_while_warm_ones_are_made(images: dict[str, str]) -> None:
    """Layers made on the event loop (warm workers) and in threads (cold starts) at the same
    time: each idmapped mount's helper process must not wait on another's."""
    async def body(mgr: CpuManager) -> None:
        for wave in range(3):
            await sh(mgr, "true", 100 + wave, image=images["root"])  # then idle: the image's pool refills
            outs = await asyncio.wait_for(asyncio.gather(*(
                sh(mgr, "cat /etc/os-release", 10 * wave + t, image=images["root"]) for t in range(8))), 60)
            assert all("NAME=tangram-test-busybox" in out for out in outs)

    with_manager(images, body, warm_sandboxes=3)


@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed")
def test_an_image_of_the_local_podman_store(images: dict[str, str], tmp_path: Path) -> None:
    """`podman:NAME`: an image imported into this machine's store (offline, `podman import`),
    exported through `podman save` and unpacked; a name the store lacks is an ImageError."""
    import subprocess
    archive = tmp_path / "busybox.tar"
    with tarfile.open(archive, "w") as tar:
        for entry in sorted(Path(images["root"]).iterdir()):
            tar.add(entry, arcname=entry.name)
    name = f"localhost/tangram-test-busybox:{os.getpid()}"
    subprocess.run(["podman", "import", "-q", str(archive), name], check=True, capture_output=True)
    try:
        async def body(mgr: CpuManager) -> None:
            assert "NAME=tangram-test-busybox" in await sh(mgr, "cat /etc/os-release", 1, image=f"podman:{name}")
            with pytest.raises(ActionFailed) as e:
                await run(mgr, command="true", trajectory=2, image="podman:localhost/tangram-test-absent:1")
            assert e.value.error_type == "ImageError" and "podman save failed" in str(e.value)

        with_manager(images, body)
    finally:
        subprocess.run(["podman", "rmi", "-f", name], capture_output=True)
