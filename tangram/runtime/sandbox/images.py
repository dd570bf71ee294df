"""Task images: an OCI image's root filesystem, unpacked once into a cache.

A reference names an image as users have one:

  a directory holding a root filesystem (with /bin, /usr or /etc): used where it is
  an OCI image layout directory (`oci-layout` and `index.json`, as `skopeo copy ... oci:DIR`
      or `umoci` write it): its only manifest, or the one tagged TAG with "DIR:TAG"
  an archive of `docker save` or `podman save` (a tar holding manifest.json and the layers):
      its only image, or the one tagged REPO:TAG with "ARCHIVE:REPO:TAG"
  "podman:NAME" or "docker:NAME": an image of the local container store, exported through
      the `podman save` or `docker save` of this machine (where one is installed)

`ImageCache.rootfs(reference)` unpacks the image's layers in order into
`<cache>/<digest>/rootfs` (digest: of the image's manifest, or of the archive), once: a
second sandbox of the same image, or a second manager sharing the cache, finds it there.
Layers are applied with the OCI whiteouts (`.wh.NAME` deletes NAME from the layers below,
`.wh..wh..opq` empties its directory) and extracted with tarfile's "tar" filter: no member
lands outside the root (absolute names are made relative, `..` and links that resolve
outside are refused), setuid, setgid and sticky bits and write bits for group and others
are cleared, device nodes are skipped. A missing, unreadable or corrupt image is an
ImageError naming the reference and the cause.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from ..errors import ManagerError

_ROOT_MARKERS = ("bin", "usr", "etc")
_WHITEOUT = ".wh."
_OPAQUE = ".wh..wh..opq"


class ImageError(ManagerError):
    """An image that cannot be used: `field` is where it was named, `reason` says why."""


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class ImageCache:
    """Root filesystems of images, unpacked under `directory` (made if missing)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def rootfs(self, reference: str, field: str = "call.image") -> str:
        """The root filesystem of `reference` (see the module docstring), unpacked if need be."""
        if not isinstance(reference, str) or not reference:
            raise ImageError(field, f"{reference!r} is not an image reference")
        if reference.startswith(("podman:", "docker:")):
            return self._from_store(reference, field)
        path, _, tag = reference.partition(":") if not os.path.exists(reference) else (reference, "", "")
        if not os.path.exists(path):
            raise ImageError(field, f"image {reference!r}: no such file or directory")
        if os.path.isdir(path):
            if os.path.exists(os.path.join(path, "oci-layout")):
                return self._from_oci_layout(path, tag, reference, field)
            if any(os.path.isdir(os.path.join(path, m)) for m in _ROOT_MARKERS):
                return os.path.realpath(path)
            raise ImageError(field, f"image {reference!r}: a directory that is neither an OCI layout (no oci-layout "
                             "file) nor a root filesystem (no bin, usr or etc)")
        return self._from_archive(path, tag, reference, field)

    # ------------------------------------------------------------------ sources
    def _from_oci_layout(self, path: str, tag: str, reference: str, field: str) -> str:
        try:
            with open(os.path.join(path, "index.json")) as f:
                index = json.load(f)
            manifests = index["manifests"]
            if tag:
                manifests = [m for m in manifests
                             if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag]
            if len(manifests) != 1:
                raise ImageError(field, f"image {reference!r}: {len(manifests)} manifests match in its index.json "
                                 "(name one with DIR:TAG)")
            digest = manifests[0]["digest"]
            with self._blob(path, digest, reference, field) as f:
                manifest = json.load(f)
            if "layers" not in manifest:  # an index of manifests (several platforms): its first
                digest = manifest["manifests"][0]["digest"]
                with self._blob(path, digest, reference, field) as f:
                    manifest = json.load(f)
            layers = [layer["digest"] for layer in manifest["layers"]]
        except ImageError:
            raise
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
            raise ImageError(field, f"image {reference!r}: not a readable OCI layout: {type(e).__name__}: {e}") from None
        key = digest.split(":", 1)[-1]
        return self._unpacked(key, lambda: (self._blob(path, d, reference, field) for d in layers), reference, field)

    @staticmethod
    def _blob(layout: str, digest: str, reference: str, field: str) -> IO[bytes]:
        algorithm, _, value = digest.partition(":")
        blob = os.path.join(layout, "blobs", algorithm, value)
        try:
            return open(blob, "rb")
        except OSError as e:
            raise ImageError(field, f"image {reference!r}: blob {digest} missing: {e.strerror}") from None

    def _from_archive(self, path: str, tag: str, reference: str, field: str) -> str:
        try:
            archive = tarfile.open(path)
        except (OSError, tarfile.TarError) as e:
            raise ImageError(field, f"image {reference!r}: not a docker/podman save archive: {e}") from None
        with archive:
            try:
                manifest = json.load(archive.extractfile("manifest.json"))  # type: ignore[arg-type]
                entries = [m for m in manifest if not tag or tag in (m.get("RepoTags") or [])]
                if len(entries) != 1:
                    raise ImageError(field, f"image {reference!r}: {len(entries)} images match in the archive "
                                     "(name one with ARCHIVE:REPO:TAG)")
                layers = list(entries[0]["Layers"])
                config = entries[0].get("Config", "")
            except ImageError:
                raise
            except (KeyError, ValueError, TypeError, tarfile.TarError) as e:
                raise ImageError(field, f"image {reference!r}: not a docker/podman save archive (no usable "
                                 f"manifest.json: {type(e).__name__}: {e})") from None
        key = hashlib.sha256(f"{_sha256_file(path)}:{config}".encode()).hexdigest()

        def streams() -> Iterator[IO[bytes]]:
            with tarfile.open(path) as outer:
                for name in layers:
                    member = outer.extractfile(name)
                    if member is None:
                        raise ImageError(field, f"image {reference!r}: layer {name} missing from the archive")
                    yield io.BytesIO(member.read())

        return self._unpacked(key, streams, reference, field)

    def _from_store(self, reference: str, field: str) -> str:
        tool, _, name = reference.partition(":")
        if shutil.which(tool) is None:
            raise ImageError(field, f"image {reference!r}: {tool} is not installed on this machine")
        with tempfile.TemporaryDirectory(dir=self.directory) as tmp:
            archive = os.path.join(tmp, "image.tar")
            argv = [tool, "save", "-o", archive, name] + (["--format", "docker-archive"] if tool == "podman" else [])
            try:
                out = subprocess.run(argv, capture_output=True, timeout=600)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise ImageError(field, f"image {reference!r}: {tool} save failed: {e}") from None
            if out.returncode != 0:
                said = out.stderr.decode("utf-8", "replace").strip()
                raise ImageError(field, f"image {reference!r}: {tool} save failed: {said}")
            return self._from_archive(archive, "", reference, field)

    # ------------------------------------------------------------------ unpacking
    @contextmanager
    def _lock(self, key: str) -> Iterator[None]:
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            yield

    def _unpacked(self, key: str, layers: Any, reference: str, field: str) -> str:
        target = os.path.join(self.directory, key)
        rootfs = os.path.join(target, "rootfs")
        with self._lock(key):
            if os.path.isdir(rootfs):
                return rootfs
            work = tempfile.mkdtemp(prefix=f".{key[:12]}-", dir=self.directory)
            try:
                root = os.path.join(work, "rootfs")
                os.mkdir(root, 0o755)
                for stream in layers():
                    with stream:
                        _apply_layer(stream, root, reference, field)
                try:
                    os.rename(work, target)  # another process may have made it meanwhile: theirs is kept
                except OSError:
                    if not os.path.isdir(rootfs):
                        raise
                    shutil.rmtree(work, ignore_errors=True)
            except BaseException:
                shutil.rmtree(work, ignore_errors=True)
                raise
        return rootfs


def _apply_layer(stream: IO[bytes], root: str, reference: str, field: str) -> None:
    """One layer (a tar, gzip or not) onto `root`, whiteouts first."""
    head = stream.read(2)
    stream.seek(0)
    raw: IO[bytes] = gzip.GzipFile(fileobj=stream) if head == b"\x1f\x8b" else stream  # type: ignore[assignment]
    try:
        with tarfile.open(fileobj=raw, mode="r|") as layer:
            for member in layer:
                name = os.path.normpath(member.name.lstrip("/"))
                if name.startswith(".."):
                    raise ImageError(field, f"image {reference!r}: layer member {member.name!r} outside the root")
                base, leaf = os.path.split(name)
                if leaf == _OPAQUE:
                    _empty(os.path.join(root, base), root)
                    continue
                if leaf.startswith(_WHITEOUT):
                    _remove(os.path.join(root, base, leaf[len(_WHITEOUT):]), root)
                    continue
                if member.isdev() or member.isfifo():
                    continue  # devices come from the sandbox's own /dev
                target = os.path.join(root, name)
                if os.path.lexists(target) and not (member.isdir() and os.path.isdir(target)
                                                    and not os.path.islink(target)):
                    _remove(target, root)  # a later layer replaces what an earlier one had
                layer.extract(member, root, set_attrs=True, filter="tar")
    except ImageError:
        raise
    except (OSError, EOFError, tarfile.TarError, ValueError) as e:
        raise ImageError(field, f"image {reference!r}: a corrupt layer: {type(e).__name__}: {e}") from None


def _inside(path: str, root: str) -> bool:
    real = os.path.realpath(os.path.dirname(path))
    return real == root or real.startswith(root.rstrip("/") + "/")


def _remove(path: str, root: str) -> None:
    if not _inside(path, root):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _empty(directory: str, root: str) -> None:
    if not os.path.isdir(directory) or os.path.islink(directory) or not _inside(os.path.join(directory, "x"), root):
        return
    for entry in os.listdir(directory):
        _remove(os.path.join(directory, entry), root)


__all__ = ["ImageCache", "ImageError"]
