"""The root of a sandbox that runs in a task image (`Call.image`), and the host's Python in it.

An image sandbox's `/` is the image's root filesystem (tangram.runtime.sandbox.images unpacks it
once, into a cache all its sandboxes share) under an overlay of the sandbox's own:

  <slot>/lower    the image's root, idmapped: what the image owns as its root (uid and
                  gid 0) the sandbox's own uid owns here, so the sandbox may change the
                  image's files as a container's root may (an SWE task edits /testbed);
                  files of the image's other users show as the overflow uid (nobody). The
                  mount is read-only: the cache is never written.
  <slot>/upper    the sandbox's writes (copy-on-write): a 1,000-sandbox step on one image
  <slot>/work     shares one unpacked copy, each sandbox holding only what it changed
  <slot>/rootfs   the overlay, bound at / by bwrap (tangram.runtime.sandbox.namespaces)

Both mounts are made on the host by the orchestrator (root: an idmapped mount needs
CAP_SYS_ADMIN, and bubblewrap 0.8 makes no overlays) inside the slot, and detached when the
slot is removed (or by the manager's close(), whatever is left).

The worker is the orchestrator's own Python, not the image's: command actions need nothing
from the image beyond what they run, and function actions run with the orchestrator's
interpreter and packages whatever the image holds (a busybox image has no Python at all).
The host's system directories and Python paths are shown read-only under HOST (/run/host,
as Flatpak names the same thing), and the interpreter is started through the host's
dynamic loader with the host's library directories, so that no library of the image is
ever loaded into it: `HOST/<ld.so> --library-path HOST/<dirs> HOST/<python> -I -S ...`.
Processes the action starts (its commands) are the image's own: the loader's path is not
inherited. `sys.executable` in such a worker names the host's interpreter under HOST, which
runs only through that loader: a function that starts `sys.executable` again fails there.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import sysconfig
import time

from .images import ImageError

HOST = "/run/host"  # the host's system directories and Python, read-only, in an image sandbox

_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442  # x86_64 and aarch64 alike (the new numbers)
_OPEN_TREE_CLONE, _OPEN_TREE_CLOEXEC = 1, 0o2000000
_AT_FDCWD, _AT_EMPTY_PATH, _AT_RECURSIVE = -100, 0x1000, 0x8000
_MOVE_MOUNT_F_EMPTY_PATH = 4
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV, _MOUNT_ATTR_IDMAP = 0x1, 0x2, 0x4, 0x100000
_CLONE_NEWUSER = 0x10000000
_MS_NOSUID, _MS_NODEV = 2, 4


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str, path: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what} {path}: {os.strerror(err)}")
    return result


def _user_namespace(uid: int) -> int:
    """An fd of a new user namespace mapping uid and gid 0 to `uid`: the idmapping of a
    mount. A child makes it (a process cannot leave its own) and waits while the maps are
    written, then exits; the fd keeps the namespace."""
    unshare = _libc().unshare  # looked up before the fork: the child only calls it
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            if unshare(_CLONE_NEWUSER) != 0:
                os._exit(1)
            # Until the parent has the fd and says so with a byte: not until the pipe's end
            # of file, which a child forked meanwhile by another thread (another slot made
            # at the same time) would hold back for as long as it lives.
            os.read(read_end, 1)
        finally:
            os._exit(0)
    try:
        own = os.readlink("/proc/self/ns/user")
        deadline = time.monotonic() + 5
        while os.readlink(f"/proc/{pid}/ns/user") == own:  # not unshared yet
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                raise OSError("cannot make a user namespace for an idmapped mount")
            if time.monotonic() > deadline:
                raise OSError("a user namespace for an idmapped mount took more than 5 s")
            time.sleep(0.0002)
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(f"0 {uid} 1\n")
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.write(write_end, b"x")
        os.close(write_end)
        os.close(read_end)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def mount_idmapped(source: str, target: str, uid: int) -> None:
    """`source` bound read-only at `target` (an empty directory), what uid 0 owns there
    shown as owned by `uid` (and gid 0 as gid `uid`), no setuid bits, no device nodes."""
    libc = _libc()
    userns = _user_namespace(uid)
    try:
        tree = _check(libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, source.encode(),
                                   _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC | _AT_RECURSIVE), "cannot clone", source)
        try:
            attr = _MountAttr(_MOUNT_ATTR_IDMAP | _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV, 0, 0, userns)
            _check(libc.syscall(_SYS_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH | _AT_RECURSIVE, ctypes.byref(attr),
                                ctypes.sizeof(attr)), "cannot idmap", source)
            _check(libc.syscall(_SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, target.encode(), _MOVE_MOUNT_F_EMPTY_PATH),
                   "cannot mount at", target)
        finally:
            os.close(tree)
    finally:
        os.close(userns)


def mount_overlay(lower: str, upper: str, work: str, target: str) -> None:
    """An overlay of `upper` (writes, copy-on-write) over `lower` at `target`."""
    options = f"lowerdir={lower},upperdir={upper},workdir={work}".encode()
    _check(_libc().mount(b"overlay", target.encode(), b"overlay", _MS_NOSUID | _MS_NODEV, options),
           "cannot mount an overlay at", target)


def mount_image_root(image: str, slot: str, uid: int) -> str:
    """The sandbox root of `image` (an unpacked root filesystem) in `slot` (see the module
    docstring); returns <slot>/rootfs. An image that cannot be idmapped is an ImageError.
    Mounts made before a failure are left for the caller's unmount_under(slot)."""
    lower, upper, work, rootfs = (os.path.join(slot, d) for d in ("lower", "upper", "work", "rootfs"))
    for d in (lower, upper, work, rootfs):
        os.makedirs(d, exist_ok=True)
    try:
        mount_idmapped(image, lower, uid)
    except OSError as e:  # a file system, or a mount inside the image, that cannot be idmapped
        raise ImageError("call.image", f"{image!r} cannot be a sandbox's root (an idmapped mount of it): "
                         f"{e.strerror or e}") from None
    remount_image_root(slot, uid)
    return rootfs


def remount_image_root(slot: str, uid: int) -> None:
    """A fresh overlay at <slot>/rootfs, its upper and work directories (re)made empty:
    the sandbox's changes to the image are gone (a wipe, after it filled its disk)."""
    lower, upper, work, rootfs = (os.path.join(slot, d) for d in ("lower", "upper", "work", "rootfs"))
    for d in (upper, work):
        os.makedirs(d, exist_ok=True)
    # The upper's root takes the owner of the image's root as the sandbox sees it (its uid):
    # else a copy-up of / would leave the sandbox's root directory owned by the host's root.
    os.chown(upper, uid, uid)
    os.chmod(upper, os.stat(lower).st_mode & 0o7777)
    mount_overlay(lower, upper, work, rootfs)


# ---------------------------------------------------------------------------- the host's Python
def _mapped_library_dirs() -> set[str]:
    """Directories of the shared libraries this process has loaded (the interpreter's
    own, libpython, the extension modules' libraries so far), resolved."""
    dirs: set[str] = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith("/") and ".so" in os.path.basename(path) and os.path.exists(path):
                    dirs.add(os.path.dirname(os.path.realpath(path)))
    except OSError:
        pass
    return dirs


def _interpreter_of(path: str) -> str:
    """The dynamic loader an ELF executable names (its PT_INTERP), resolved; '' if none."""
    import struct

    with open(path, "rb") as f:
        ident = f.read(16)
        if ident[:4] != b"\x7fELF":
            return ""
        wide, little = ident[4] == 2, ident[5] == 1
        order = "<" if little else ">"
        f.seek(0x20 if wide else 0x1C)
        (phoff,) = struct.unpack(order + ("Q" if wide else "I"), f.read(8 if wide else 4))
        f.seek(0x36 if wide else 0x2A)
        phentsize, phnum = struct.unpack(order + "HH", f.read(4))
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            header = f.read(phentsize)
            if struct.unpack(order + "I", header[:4])[0] != 3:  # PT_INTERP
                continue
            if wide:  # Elf64_Phdr: p_offset at 8, p_filesz at 32
                offset, size = struct.unpack_from(order + "Q", header, 8)[0], struct.unpack_from(order + "Q", header, 32)[0]
            else:  # Elf32_Phdr: p_offset at 4, p_filesz at 16
                offset, size = struct.unpack_from(order + "I", header, 4)[0], struct.unpack_from(order + "I", header, 16)[0]
            f.seek(offset)
            return os.path.realpath(f.read(size).rstrip(b"\0").decode())
    return ""


@functools.lru_cache(maxsize=1)
def host_python() -> tuple[str, str, tuple[str, ...]]:
    """(the dynamic loader, the interpreter, the library directories) of this process, as
    host paths: what an image sandbox runs its worker with, shown under HOST."""
    interpreter = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    loader = _interpreter_of(interpreter)
    if not loader or not os.path.exists(loader):
        raise OSError(f"cannot find the dynamic loader of {interpreter}: it cannot run in an image sandbox")
    dirs = _mapped_library_dirs()
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    for d in ("/lib", "/usr/lib", "/lib64", "/usr/lib64", f"/lib/{multiarch}", f"/usr/lib/{multiarch}"):
        if os.path.isdir(d):
            dirs.add(os.path.realpath(d))
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and os.path.isdir(libdir):
        dirs.add(os.path.realpath(libdir))
    return loader, interpreter, tuple(sorted(dirs))


def host_python_argv() -> list[str]:
    """How an image sandbox starts the host's Python (paths inside, under HOST), up to its
    arguments: no site (the worker sets its sys.path from the host's, mapped under HOST)."""
    loader, interpreter, dirs = host_python()
    return [HOST + loader, "--library-path", ":".join(HOST + d for d in dirs), HOST + interpreter, "-I", "-S"]


def host_python_paths() -> list[str]:
    """The host paths the host's Python needs inside an image sandbox (shown under HOST)."""
    loader, interpreter, dirs = host_python()
    return [os.path.dirname(loader), os.path.dirname(os.path.dirname(interpreter)), *dirs]


def inside(path: str) -> str:
    """Where a host path shown to an image sandbox is, inside it."""
    return HOST + os.path.realpath(path)


__all__ = ["HOST", "host_python", "host_python_argv", "host_python_paths", "inside", "mount_idmapped",
           "mount_image_root", "mount_overlay", "remount_image_root"]
