"""Task images: an OCI image's root filesystem, unpacked once into a cache.

A reference names an image as users have one:

  a directory holding a root filesystem (with /bin, /usr or /etc): used where it is (never
      the host's own root, /)
  an OCI image layout directory (`oci-layout` and `index.json`, as `skopeo copy ... oci:DIR`
      or `umoci` write it): its only manifest, or the one tagged TAG with "DIR:TAG"
  an archive of `docker save` or `podman save` (a tar holding manifest.json and the layers):
      its only image, or the one tagged REPO:TAG with "ARCHIVE:REPO:TAG"
  "podman:NAME" or "docker:NAME": an image of the local container store, exported through
      the `podman save` or `docker save` of this machine (where one is installed)

`ImageCache.rootfs(reference)` unpacks the image's layers in order into
`<cache>/<key>/rootfs`, once: a second sandbox of the same image, or a second manager
sharing the cache, finds it there. The key of an OCI layout is its manifest's digest; of an
archive, a hash of its layers' contents.

Digests are checked: each one the layout names must be `sha256:<64 hex digits>` or
`sha512:<128 hex digits>`, and each blob read (index.json's manifest, a nested index, the
layers) must hash to its digest, as it is read; a layer of an archive is hashed before it
is unpacked and checked again while it is (as are layers an archive names
blobs/<algorithm>/<digest>). So a layout cannot name a file outside it, nor claim another
image's digest (and cache entry).

Layers are unpacked by this module, not by tarfile's extraction (whose filters
os.path.realpath defeats: CVE-2025-4517): each member's path is resolved inside the root as
in a chroot, component by component with lstat and readlink (an absolute link restarts at
the root, `..` stops there, at most 40 links per path, a link to a missing directory or a
path past PATH_MAX is refused), and the member is made there without following a link in
its last component: a file is created new (O_EXCL, O_NOFOLLOW) after what was there is
removed, a directory merges with a directory, a link's text is kept verbatim, a hard link
must name a regular file of the image. OCI whiteouts (`.wh.NAME` deletes NAME from the
layers below, `.wh..wh..opq` empties its directory) are resolved the same way. Member names
leading outside the root (`../x`) are refused; setuid, setgid and sticky bits and write bits
for group and others are cleared; owners are the members' numeric ids (as root); device
nodes and fifos are skipped; sparse files (GNU tar's, old or pax: images hold none, and
their holes would be written for real) are refused, before their maps are read. An image
may unpack at most `max_bytes` (the layers' tar streams, uncompressed: a gzip bomb; and as
much written to its files) and `max_members` members; a member's extended headers (pax
records, GNU long names) at most _MAX_HEADER bytes together and _MAX_HEADERS_IN_A_ROW
headers, a layer's global pax records _MAX_GLOBAL bytes, an image's extended headers
_MAX_EXTENDED bytes; only the member being unpacked is held in memory (tarfile's stream
mode would keep them all). Trees are removed (whiteouts, a directory replaced, a failed
unpacking's work directory) without recursion, at any depth. A missing, unreadable,
corrupt or malformed image, or any error while it is unpacked, is an ImageError naming
the reference and the cause (and the member), its work directory removed.

The cache is used only where nobody but root and this user can change it: its directory
and every directory on the way to it (through links, as the kernel follows them) owned by
root or this user and writable by no one else (or sticky, as /tmp, with the entry in it
theirs), the cache's own directory this user's (made 0700); an entry <key> is used only if
a real directory of this user, writable by no one else, holding a real directory rootfs:
a link or anything else planted there is an ImageError, never an image's root.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import os
import posixpath
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

from ..errors import ManagerError

_ROOT_MARKERS = ("bin", "usr", "etc")
_WHITEOUT = ".wh."
_OPAQUE = ".wh..wh..opq"

MAX_IMAGE_BYTES = 64 << 30  # what one image may unpack: its layers' tar streams, uncompressed
MAX_IMAGE_MEMBERS = 1 << 22  # and its layers' members, all together
_MAX_JSON = 16 << 20  # index.json, a manifest, manifest.json
_MAX_HEADER = 1 << 20  # a tar member's extended headers (pax, GNU long names), together, read into memory
_MAX_HEADERS_IN_A_ROW = 8  # extended headers before one member (tarfile reads them recursively, each held)
_MAX_GLOBAL = 4 << 10  # a layer's global pax records: kept, and copied onto each of its members
_MAX_EXTENDED = 256 << 20  # an image's extended headers, all together
_MAX_NAME = 4095  # a member's name (PATH_MAX): a longer one could not be made
_MAX_LINKS = 40  # symbolic links followed while resolving one path (the kernel's limit)
_CHUNK = 1 << 20
_DIGEST_HEX = {"sha256": 64, "sha512": 128}
_HEX = re.compile(r"[0-9a-f]+")
_BLOB_NAME = re.compile(r"(?:.*/)?blobs/(sha256|sha512)/([0-9a-f]+)")  # an archive's layer named by its digest
_EXTENDED = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
             tarfile.GNUTYPE_LONGLINK)
_SPARSE = "a sparse file (GNU tar's), which images do not hold"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_REMOVE_BATCH = 256  # subdirectories of one directory remembered while a tree is removed


class ImageError(ManagerError):
    """An image that cannot be used: `field` is where it was named, `reason` says why."""


class _Ref:
    """The reference being resolved, to name it in errors."""

    def __init__(self, reference: str, field: str) -> None:
        self.reference, self.field = reference, field

    def error(self, what: str) -> ImageError:
        return ImageError(self.field, f"image {self.reference!r}: {what}")


class _Refused(Exception):
    """A layer member (or header) this unpacker will not make: said by _apply_layer, naming it."""


class _Corrupt(Exception):
    """A layer's stream broke while a member's data was read."""


# ---------------------------------------------------------------------------- files, JSON, digests
def _open_regular(path: str, what: str, ref: _Ref) -> IO[bytes]:
    """`path` opened for reading, if a regular file (a fifo would block, a device never end)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except (OSError, ValueError) as e:
        raise ref.error(f"{what} missing: {getattr(e, 'strerror', None) or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ref.error(f"{what} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_json(f: IO[bytes], what: str, ref: _Ref, digest: str | None = None) -> Any:
    """The JSON document in `f` (closed after), its bytes checked against `digest` if given."""
    try:
        with f:
            data = f.read(_MAX_JSON + 1)
    except (OSError, EOFError, tarfile.TarError, zlib.error) as e:
        raise ref.error(f"{what}: unreadable: {type(e).__name__}: {e}") from None
    if len(data) > _MAX_JSON:
        raise ref.error(f"{what}: more than {_MAX_JSON} bytes, not a manifest")
    if digest is not None:
        algorithm, _, value = digest.partition(":")
        if hashlib.new(algorithm, data).hexdigest() != value:
            raise ref.error(f"{what}: its content does not match its digest")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ref.error(f"{what}: not JSON ({type(e).__name__}: {e})") from None


def _object(value: Any, what: str, ref: _Ref) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ref.error(f"{what} is not a JSON object")
    return value


def _list(value: Any, what: str, ref: _Ref) -> list[Any]:
    if not isinstance(value, list):
        raise ref.error(f"{what} is not a list")
    return value


def _digest(value: Any, what: str, ref: _Ref) -> str:
    """`value` if it is an OCI digest of a supported algorithm (lowercase hex of its length)."""
    if isinstance(value, str):
        algorithm, _, hexa = value.partition(":")
        if len(hexa) == _DIGEST_HEX.get(algorithm) and _HEX.fullmatch(hexa):
            return value
    raise ref.error(f"{what}: {value!r} is not a digest (sha256:<64 lowercase hex digits> or "
                    "sha512:<128 lowercase hex digits>)")


class _Blob:
    """A layer's bytes, read once front to back, hashed as they are read when its digest
    is known (`intact` checks it, reading what is left); `unread` puts bytes back."""

    def __init__(self, f: IO[bytes], name: str, digest: str | None = None) -> None:
        self._f, self.name, self.digest = f, name, digest
        self._hash = hashlib.new(digest.partition(":")[0]) if digest else None
        self._back = b""

    def _read(self, n: int) -> bytes:
        data = self._f.read(n)
        if self._hash is not None:
            self._hash.update(data)
        return data

    def read(self, n: int = -1) -> bytes:
        if not self._back:
            return self._read(n)
        if n is None or n < 0:
            data, self._back = self._back + self._read(-1), b""
            return data
        data, self._back = self._back[:n], self._back[n:]
        return data + self._read(n - len(data)) if len(data) < n else data

    def unread(self, data: bytes) -> None:
        self._back = data + self._back

    def intact(self) -> bool:
        while self._read(_CHUNK):
            pass
        return self._hash is None or self._hash.hexdigest() == self.digest.partition(":")[2]  # type: ignore[union-attr]

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> _Blob:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------------------- the cache
class ImageCache:
    """Root filesystems of images, unpacked under `directory` (made if missing); one image
    may unpack at most `max_bytes` (its layers' tar streams, uncompressed) and
    `max_members` members."""

    def __init__(self, directory: str, max_bytes: int = MAX_IMAGE_BYTES, max_members: int = MAX_IMAGE_MEMBERS) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.max_members = max_members
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError:
            pass  # said by rootfs, as an ImageError
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def rootfs(self, reference: str, field: str = "call.image") -> str:
        """The root filesystem of `reference` (see the module docstring), unpacked if need be."""
        if not isinstance(reference, str) or not reference:
            raise ImageError(field, f"{reference!r} is not an image reference")
        ref = _Ref(reference, field)
        if reference.startswith(("podman:", "docker:")):
            return self._from_store(reference, ref)
        path, _, tag = reference.partition(":") if not os.path.exists(reference) else (reference, "", "")
        if not os.path.exists(path):
            raise ref.error("no such file or directory")
        if os.path.isdir(path):
            if os.path.realpath(path) == "/":
                raise ref.error("the host's root / cannot be a task image (its sandboxes would be given the "
                                "host's files, owned by them)")
            if os.path.exists(os.path.join(path, "oci-layout")):
                return self._from_oci_layout(path, tag, ref)
            if any(os.path.isdir(os.path.join(path, m)) for m in _ROOT_MARKERS):
                return os.path.realpath(path)
            raise ref.error("a directory that is neither an OCI layout (no oci-layout file) nor a root filesystem "
                            "(no bin, usr or etc)")
        return self._from_archive(path, tag, ref)

    # ------------------------------------------------------------------ sources
    def _from_oci_layout(self, path: str, tag: str, ref: _Ref) -> str:
        index = _object(_read_json(_open_regular(os.path.join(path, "index.json"), "index.json", ref), "index.json",
                                   ref), "index.json", ref)
        manifests = _list(index.get("manifests"), "index.json manifests", ref)
        chosen = []
        for i, m in enumerate(manifests):
            m = _object(m, f"index.json manifests[{i}]", ref)
            annotations = _object(m.get("annotations", {}), f"index.json manifests[{i}].annotations", ref)
            if not tag or annotations.get("org.opencontainers.image.ref.name") == tag:
                chosen.append((i, m))
        if len(chosen) != 1:
            raise ref.error(f"{len(chosen)} manifests match in its index.json (name one with DIR:TAG)")
        i, entry = chosen[0]
        digest = _digest(entry.get("digest"), f"index.json manifests[{i}].digest", ref)
        manifest = _object(_read_json(self._blob(path, digest, ref), f"manifest {digest}", ref, digest),
                           f"manifest {digest}", ref)
        if "layers" not in manifest and "manifests" in manifest:  # an index of manifests (several platforms): its first
            nested = _list(manifest["manifests"], f"index {digest} manifests", ref)
            if not nested:
                raise ref.error(f"index {digest} manifests is empty")
            first = _object(nested[0], f"index {digest} manifests[0]", ref)
            digest = _digest(first.get("digest"), f"index {digest} manifests[0].digest", ref)
            manifest = _object(_read_json(self._blob(path, digest, ref), f"manifest {digest}", ref, digest),
                               f"manifest {digest}", ref)
        if "layers" not in manifest:
            raise ref.error(f"manifest {digest} has neither layers nor manifests")
        layers = []
        for j, layer in enumerate(_list(manifest["layers"], f"manifest {digest} layers", ref)):
            layer = _object(layer, f"manifest {digest} layers[{j}]", ref)
            layers.append(_digest(layer.get("digest"), f"manifest {digest} layers[{j}].digest", ref))

        def blobs() -> Iterator[_Blob]:
            for d in layers:
                yield _Blob(self._blob(path, d, ref), d, d)

        return self._unpacked(digest.partition(":")[2], blobs, ref)

    @staticmethod
    def _blob(layout: str, digest: str, ref: _Ref) -> IO[bytes]:
        """The blob of `digest` (checked by _digest: no path of its own) in `layout`."""
        algorithm, _, value = digest.partition(":")
        return _open_regular(os.path.join(layout, "blobs", algorithm, value), f"blob {digest}", ref)

    def _from_archive(self, path: str, tag: str, ref: _Ref) -> str:
        with _open_regular(path, "the archive", ref) as f:  # opened once: hashed and unpacked alike
            try:
                archive = tarfile.open(fileobj=f)
            except (OSError, EOFError, tarfile.TarError, zlib.error) as e:
                raise ref.error(f"not a docker/podman save archive: {e}") from None
            with archive:
                names = self._archive_layers(archive, tag, ref)
                digests = []  # of each layer's content: the key, and checked again as it is unpacked
                size = 0
                for name in names:
                    size += _archive_member(archive, name, ref)[0].size
                    if size > self.max_bytes:  # (a gzipped archive's claims: not hashed for hours)
                        raise ref.error(f"more than {self.max_bytes} bytes of layers: the image cache's limit")
                for name in names:
                    blob_name = _BLOB_NAME.fullmatch(posixpath.normpath(name))
                    if blob_name and len(blob_name.group(2)) != _DIGEST_HEX[blob_name.group(1)]:
                        blob_name = None  # not a digest after all
                    algorithms = {"sha256"} | ({blob_name.group(1)} if blob_name else set())
                    hashes = {a: hashlib.new(a) for a in algorithms}
                    try:
                        with _archive_member(archive, name, ref)[1] as member:
                            for chunk in iter(lambda: member.read(_CHUNK), b""):
                                for h in hashes.values():
                                    h.update(chunk)
                    except (OSError, EOFError, tarfile.TarError, zlib.error) as e:
                        raise ref.error(f"a corrupt archive: layer {name!r}: {type(e).__name__}: {e}") from None
                    if blob_name and hashes[blob_name.group(1)].hexdigest() != blob_name.group(2):
                        raise ref.error(f"a corrupt layer {name!r}: its content does not match its digest")
                    digests.append(f"sha256:{hashes['sha256'].hexdigest()}")
                key = hashlib.sha256("\n".join(["docker-archive", *digests]).encode()).hexdigest()

                def blobs() -> Iterator[_Blob]:
                    for name, digest in zip(names, digests):
                        yield _Blob(_archive_member(archive, name, ref)[1], name, digest)

                return self._unpacked(key, blobs, ref)

    @staticmethod
    def _archive_layers(archive: tarfile.TarFile, tag: str, ref: _Ref) -> list[str]:
        """The layers (names of the archive's members) of its image tagged `tag` (or its only one)."""
        try:
            manifest_json = archive.extractfile("manifest.json")
        except (KeyError, OSError, EOFError, tarfile.TarError, zlib.error) as e:
            raise ref.error(f"not a docker/podman save archive (no usable manifest.json: {type(e).__name__}: {e})") \
                from None
        if manifest_json is None:
            raise ref.error("not a docker/podman save archive (its manifest.json is not a file)")
        manifest = _list(_read_json(manifest_json, "manifest.json", ref), "manifest.json", ref)
        chosen = []
        for i, m in enumerate(manifest):
            m = _object(m, f"manifest.json[{i}]", ref)
            tags = _list(m.get("RepoTags") or [], f"manifest.json[{i}].RepoTags", ref)
            if not tag or tag in tags:
                chosen.append((i, m))
        if len(chosen) != 1:
            raise ref.error(f"{len(chosen)} images match in the archive (name one with ARCHIVE:REPO:TAG)")
        i, entry = chosen[0]
        if not isinstance(entry.get("Config", ""), str):
            raise ref.error(f"manifest.json[{i}].Config is not a string")
        names = _list(entry.get("Layers"), f"manifest.json[{i}].Layers", ref)
        for j, name in enumerate(names):
            normal = posixpath.normpath(name) if isinstance(name, str) and name and "\0" not in name else "/"
            if normal.startswith("/") or normal in (".", "..") or normal.startswith("../"):
                raise ref.error(f"manifest.json[{i}].Layers[{j}]: {name!r} is not a path inside the archive")
        return names

    def _from_store(self, reference: str, ref: _Ref) -> str:
        tool, _, name = reference.partition(":")
        if shutil.which(tool) is None:
            raise ref.error(f"{tool} is not installed on this machine")
        self._check_directory(ref)
        with tempfile.TemporaryDirectory(dir=self.directory) as tmp:
            archive = os.path.join(tmp, "image.tar")
            argv = [tool, "save", "-o", archive, name] + (["--format", "docker-archive"] if tool == "podman" else [])
            try:
                out = subprocess.run(argv, capture_output=True, timeout=600)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise ref.error(f"{tool} save failed: {e}") from None
            if out.returncode != 0:
                said = out.stderr.decode("utf-8", "replace").strip()
                raise ref.error(f"{tool} save failed: {said}")
            return self._from_archive(archive, "", ref)

    # ------------------------------------------------------------------ unpacking
    @contextmanager
    def _lock(self, key: str) -> Iterator[None]:
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            yield

    def _check_directory(self, ref: _Ref) -> None:
        """An ImageError unless only root and this user can change the cache's directory."""
        why = _unsafe_directory(self.directory)
        if why is not None:
            raise ref.error(f"the image cache {self.directory!r} cannot be used: {why} (only root and uid "
                            f"{os.geteuid()} may be able to change it, and the directory must be theirs)")

    @staticmethod
    def _cached(target: str, ref: _Ref) -> bool:
        """Whether the entry `target` holds an unpacked image: False if missing; an ImageError
        if it is not what this cache makes (a directory of this user, writable by no one
        else, holding a directory rootfs), as a link planted there: never used."""
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            return False
        except OSError as e:
            why = e.strerror or str(e)
        else:
            why = _foreign_entry(target, st)
        if why:
            raise ref.error(f"{target} is not a directory of this cache ({why}): it is not used (remove it)")
        return True

    def _unpacked(self, key: str, layers: Callable[[], Iterator[_Blob]], ref: _Ref) -> str:
        target = os.path.join(self.directory, key)
        rootfs = os.path.join(target, "rootfs")
        with self._lock(key):
            self._check_directory(ref)
            if self._cached(target, ref):
                return rootfs
            try:
                work = tempfile.mkdtemp(prefix=f".{key[:12]}-", dir=self.directory)
            except OSError as e:
                raise ref.error(f"cannot unpack into the image cache {self.directory!r}: {e.strerror or e}") from None
            try:
                root = os.path.join(work, "rootfs")
                os.mkdir(root, 0o755)
                unpacking = _Unpacking(root, ref, self.max_bytes, self.max_members)
                for blob in layers():
                    with blob:
                        _apply_layer(blob, unpacking)
                try:
                    os.rename(work, target)  # another process may have made it meanwhile: theirs is kept
                except OSError:
                    if not self._cached(target, ref):
                        raise
                    _discard(work)
            except ImageError:
                _discard(work)
                raise
            except Exception as e:  # (RecursionError, MemoryError, OSError: an ImageError all the same)
                _discard(work)
                raise ref.error(f"unpacking failed: {type(e).__name__}: {e}") from None
            except BaseException:
                _discard(work)
                raise
        return rootfs


def _foreign_entry(target: str, st: os.stat_result) -> str:
    """Why the cache's entry `target` (lstat: `st`) is not one the cache made; "" if it is."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}"
    if st.st_mode & 0o022:
        return "writable by others"
    try:
        if not stat.S_ISDIR(os.lstat(os.path.join(target, "rootfs")).st_mode):
            return "its rootfs is not a directory"
    except OSError as e:
        return f"its rootfs: {e.strerror or e}"
    return ""


def _archive_member(archive: tarfile.TarFile, name: str, ref: _Ref) -> tuple[tarfile.TarInfo, IO[bytes]]:
    """The archive's member `name` and its data (never a file outside the archive)."""
    for candidate in (name, posixpath.normpath(name)):
        try:
            member = archive.getmember(candidate)
        except KeyError:
            continue
        try:
            data = archive.extractfile(member)
        except (KeyError, tarfile.TarError) as e:  # a link to no member
            raise ref.error(f"layer {name!r} is not a file in the archive: {e}") from None
        if data is None:
            raise ref.error(f"layer {name!r} is not a file in the archive")
        return member, data
    raise ref.error(f"layer {name!r} missing from the archive")


# ---------------------------------------------------------------------------- layers
class _Unpacking:
    """One image being unpacked into `root`: what it unpacked so far, against the limits."""

    def __init__(self, root: str, ref: _Ref, max_bytes: int, max_members: int) -> None:
        self.root, self.ref, self.max_bytes, self.max_members = root, ref, max_bytes, max_members
        self.bytes = self.members = self.written = self.extended = 0
        self.as_root = os.geteuid() == 0

    def count(self, n: int) -> None:
        self.bytes += n
        if self.bytes > self.max_bytes:
            raise self.ref.error(f"more than {self.max_bytes} bytes unpacked (its layers, uncompressed): the image "
                                 "cache's limit")

    def write(self, n: int) -> None:
        """`n` more bytes written to the image's files (a member's real size, not its stream's)."""
        self.written += n
        if self.written > self.max_bytes:
            raise self.ref.error(f"more than {self.max_bytes} bytes written (its files): the image cache's limit")

    def member(self) -> None:
        self.members += 1
        if self.members > self.max_members:
            raise self.ref.error(f"more than {self.max_members} members in its layers: the image cache's limit")


class _Counted:
    """A layer's uncompressed tar stream, counted against the image's limit as it is read."""

    def __init__(self, stream: Any, unpacking: _Unpacking) -> None:
        self._stream, self._unpacking = stream, unpacking

    def read(self, n: int = -1) -> bytes:
        data = self._stream.read(n if n is not None and n >= 0 else _CHUNK)
        self._unpacking.count(len(data))
        return data


class _Headers:
    """A layer's extended headers, against the limits, as tarfile reads them: it reads those
    of a member recursively (each held until the member is read), keeps a global header's
    records for all the members after it (copying them onto each)."""

    def __init__(self, unpacking: _Unpacking) -> None:
        self.unpacking = unpacking
        self.in_a_row = self.row_bytes = self.globals = 0

    def header(self, info: tarfile.TarInfo) -> None:
        if info.type not in _EXTENDED:  # a member: the next one's headers begin
            self.in_a_row = self.row_bytes = 0
            return
        size = max(info.size, 0)
        if size > _MAX_HEADER:
            raise _Refused(f"a {size}-byte extended header (at most {_MAX_HEADER})")
        self.in_a_row += 1
        self.row_bytes += size
        if self.in_a_row > _MAX_HEADERS_IN_A_ROW:
            raise _Refused(f"more than {_MAX_HEADERS_IN_A_ROW} extended headers in a row")
        if self.row_bytes > _MAX_HEADER:
            raise _Refused(f"{self.row_bytes} bytes of extended headers for one member (at most {_MAX_HEADER})")
        if info.type == tarfile.XGLTYPE:
            self.globals += size
            if self.globals > _MAX_GLOBAL:
                raise _Refused(f"more than {_MAX_GLOBAL} bytes of global (pax 'g') headers")
        self.unpacking.extended += size
        if self.unpacking.extended > _MAX_EXTENDED:
            raise _Refused(f"more than {_MAX_EXTENDED} bytes of extended headers in the image's layers: the image "
                           "cache's limit")


class _TarInfo(tarfile.TarInfo):
    """Bounds the extended headers (pax, GNU long names) tarfile reads whole into memory, and
    refuses sparse members before tarfile reads their maps (unbounded: old GNU sparse
    headers' extension blocks, a pax map's list of numbers, version 1.0's map in the data).
    A layer's subclass sets `_headers`."""

    _headers: _Headers

    def _proc_member(self, archive: tarfile.TarFile) -> Any:  # type: ignore[override]
        self._headers.header(self)
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise _Refused(f"member {_shown(self.name)}: {_SPARSE}")
        return super()._proc_member(archive)  # type: ignore[misc]

    def _proc_gnusparse_00(self, next: tarfile.TarInfo, pax_headers: dict[str, str], *rest: Any) -> None:
        name = pax_headers.get("GNU.sparse.name") or pax_headers.get("path") or next.name
        raise _Refused(f"member {_shown(name)}: {_SPARSE}")

    _proc_gnusparse_01 = _proc_gnusparse_10 = _proc_gnusparse_00


def _shown(name: str) -> str:
    """A member's name in a message (a long one shortened)."""
    return repr(name if len(name) <= 256 else f"{name[:120]}...{name[-120:]}")


def _apply_layer(blob: _Blob, unpacking: _Unpacking) -> None:
    """One layer (a tar, gzip or not) onto the image's root, in its members' order."""
    ref, what = unpacking.ref, blob.name
    head = blob.read(4)
    blob.unread(head)
    if head == b"\x28\xb5\x2f\xfd":
        raise ref.error(f"layer {what}: compressed with zstd, which this unpacker does not read")
    stream: Any = gzip.GzipFile(fileobj=blob, mode="rb") if head[:2] == b"\x1f\x8b" else blob  # type: ignore[arg-type]
    try:
        counted: Any = _Counted(stream, unpacking)
        tarinfo = type("_LayerTarInfo", (_TarInfo,), {"_headers": _Headers(unpacking)})
        with tarfile.open(fileobj=counted, mode="r|", tarinfo=tarinfo) as layer:
            while True:
                member = layer.next()
                if member is None:
                    break
                layer.members.clear()  # stream mode keeps each member read (its pax records): only this one is
                unpacking.member()
                try:
                    _apply_member(layer, member, unpacking)
                except (ImageError, _Corrupt, tarfile.TarError, EOFError, zlib.error):
                    raise
                except _Refused as e:
                    raise ref.error(f"layer {what}: member {_shown(member.name)}: {e}") from None
                except (OSError, ValueError, OverflowError) as e:
                    said = (e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}")
                    raise ref.error(f"layer {what}: member {_shown(member.name)}: {said}") from None
                except Exception as e:  # RecursionError, MemoryError, ...: an ImageError all the same
                    raise ref.error(f"layer {what}: member {_shown(member.name)}: {type(e).__name__}: {e}") from None
    except ImageError:
        raise
    except _Refused as e:
        raise ref.error(f"layer {what}: {e}") from None
    except (_Corrupt, OSError, EOFError, tarfile.TarError, ValueError, zlib.error) as e:
        cause = e.args[0] if isinstance(e, _Corrupt) else e
        try:
            intact = blob.intact()
        except OSError:
            intact = True
        if not intact:
            raise ref.error(f"a corrupt layer {what}: its content does not match its digest") from None
        raise ref.error(f"a corrupt layer {what}: {type(cause).__name__}: {cause}") from None
    except Exception as e:  # RecursionError, MemoryError, ...: an ImageError all the same
        raise ref.error(f"layer {what}: {type(e).__name__}: {e}") from None
    try:
        intact = blob.intact()
    except OSError as e:
        raise ref.error(f"a corrupt layer {what}: {e}") from None
    if not intact:
        raise ref.error(f"a corrupt layer {what}: its content does not match its digest")


def _apply_member(layer: tarfile.TarFile, member: tarfile.TarInfo, unpacking: _Unpacking) -> None:
    root = unpacking.root
    if member.sparse is not None or member.type == tarfile.GNUTYPE_SPARSE or \
            any(key.startswith("GNU.sparse.") for key in member.pax_headers):
        raise _Refused(_SPARSE)
    if len(member.name) > _MAX_NAME:
        raise _Refused(f"a name of {len(member.name)} characters (at most {_MAX_NAME})")
    parts = _parts(member.name)
    if not parts:  # the root itself ("./")
        if member.isdir():
            _set_attrs_at(root, member, unpacking, os.O_DIRECTORY)
        return
    dirs, leaf = parts[:-1], parts[-1]
    if leaf == _OPAQUE:
        _empty(root, dirs)
        return
    if leaf.startswith(_WHITEOUT):
        if leaf.startswith(_WHITEOUT + _WHITEOUT):
            return  # other aufs metadata (.wh..wh.plnk, ...): nothing of the image
        name = leaf[len(_WHITEOUT):]
        if name in ("", ".", ".."):
            raise _Refused("a whiteout naming nothing")
        parent = _resolve(root, dirs, make=False)
        if parent is not None:
            _clear(_join(root, parent + [name]), keep_directory=False)
        return
    if member.isdev() or member.isfifo():
        return  # devices come from the sandbox's own /dev
    if member.islnk():
        _hard_link(member, dirs, leaf, unpacking)
        return
    path = _join(root, _resolve(root, dirs, make=True) + [leaf])  # type: ignore[operator]
    if member.isdir():
        if not _clear(path, keep_directory=True):  # a directory over a directory merges
            os.mkdir(path, 0o700)
        _set_attrs_at(path, member, unpacking, os.O_DIRECTORY)
    elif member.issym():
        _clear(path, keep_directory=False)
        os.symlink(member.linkname, path)  # its text verbatim: resolved inside the sandbox, or by _resolve
        if unpacking.as_root:
            os.chown(path, member.uid, member.gid, follow_symlinks=False)
    elif member.isreg() or member.type not in tarfile.SUPPORTED_TYPES:  # unknown types as files, as tarfile does
        if member.size > unpacking.max_bytes - unpacking.bytes:
            unpacking.count(member.size)  # says it: the stream is about to go past the limit
        _clear(path, keep_directory=False)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            source = layer.extractfile(member)
            while source is not None:
                try:
                    chunk = source.read(_CHUNK)
                except (OSError, EOFError, tarfile.TarError, zlib.error) as e:
                    raise _Corrupt(e) from None
                if not chunk:
                    break
                unpacking.write(len(chunk))
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
            _set_attrs(fd, member, unpacking)
        finally:
            os.close(fd)


def _hard_link(member: tarfile.TarInfo, dirs: list[str], leaf: str, unpacking: _Unpacking) -> None:
    """A hard link to a regular file of the image (its target resolved inside the root)."""
    root, linkname = unpacking.root, member.linkname
    try:
        target_parts = _parts(linkname)
    except _Refused:
        raise _Refused(f"a hard link to {linkname!r}, outside the root") from None
    if not target_parts:
        raise _Refused(f"a hard link to {linkname!r}, which is not a regular file")
    target_dir = _resolve(root, target_parts[:-1], make=False)
    if target_dir is None:
        raise _Refused(f"a hard link to {linkname!r}, which is not in the image")
    target = _join(root, target_dir + [target_parts[-1]])
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        raise _Refused(f"a hard link to {linkname!r}, which is not in the image") from None
    if not stat.S_ISREG(st.st_mode):
        raise _Refused(f"a hard link to {linkname!r}, which is not a regular file")
    path = _join(root, _resolve(root, dirs, make=True) + [leaf])  # type: ignore[operator]
    if path != target:
        _clear(path, keep_directory=False)
        os.link(target, path, follow_symlinks=False)
    _set_attrs_at(path, member, unpacking, os.O_NONBLOCK)


def _parts(name: str) -> list[str]:
    """A member's name as components below the root (lexically: tar's `a/../b` is `b`); a
    name that leads above it is refused."""
    normal = posixpath.normpath(name.lstrip("/"))
    if normal == ".." or normal.startswith("../"):
        raise _Refused("outside the root")
    return [] if normal == "." else normal.split("/")


def _join(root: str, parts: list[str]) -> str:
    return os.path.join(root, *parts)


def _resolve(root: str, parts: list[str], make: bool) -> list[str] | None:
    """The directory `parts` names, resolved inside `root` as if `root` were / (a chroot):
    component by component with lstat; a symbolic link's text replaces it (an absolute one
    restarts at the root), `..` never goes above the root, at most _MAX_LINKS links. Returns
    the components of a real directory under root (no link in them), or None where one is
    missing or not a directory and not `make`; with `make`, missing directories the name
    itself gives are made, and one a link's text gives is refused (a link to a missing
    directory), as is a component that is neither a directory nor a link. Any other lstat error (a path past
    PATH_MAX) propagates: nothing is ever taken as missing that is not."""
    pending = [(part, False) for part in reversed(parts)]  # a stack: (component, from a link's text)
    done: list[str] = []
    links = 0
    while pending:
        part, from_link = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        path = _join(root, done + [part])
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if not make:
                return None
            if from_link:
                raise _Refused(f"/{'/'.join(done + [part])} is reached through a symbolic link to a missing "
                               "directory") from None
            os.mkdir(path, 0o755)
            done.append(part)
            continue
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise _Refused(f"too many levels of symbolic links (more than {_MAX_LINKS})")
            text = os.readlink(path)
            if text.startswith("/"):
                done = []
            pending.extend((p, True) for p in reversed(text.split("/")))
            continue
        if not stat.S_ISDIR(st.st_mode):
            if not make:
                return None
            raise _Refused(f"/{'/'.join(done + [part])} is not a directory")
        done.append(part)
    return done


def _clear(path: str, keep_directory: bool) -> bool:
    """Removes what is at `path` (a link itself, never what it names; a directory with its
    contents, unless `keep_directory`); True if a directory was kept there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        if keep_directory:
            return True
        _remove(path)
    else:
        os.unlink(path)
    return False


def _empty(root: str, dirs: list[str]) -> None:
    """An opaque whiteout: the directory `dirs` (resolved inside the root, not itself a link) emptied."""
    if dirs:
        parent = _resolve(root, dirs[:-1], make=False)
        if parent is None:
            return
        directory = _join(root, parent + [dirs[-1]])
        try:
            if not stat.S_ISDIR(os.lstat(directory).st_mode):
                return
        except FileNotFoundError:
            return
    else:
        directory = root
    for entry in os.listdir(directory):
        _remove(os.path.join(directory, entry))


def _remove(path: str) -> None:
    """Removes what is at `path`: a link or a file itself, a directory with all it holds, at
    any depth, without recursion (shutil.rmtree recurses in Python 3.11: a tree 1 000
    directories deep is a RecursionError) and with one directory open at a time, through
    directory fds, following no link; a directory of ours without read, write or search
    permission for its owner gets them first (as a user other than root)."""
    parent, name = os.path.split(path)
    top = os.open(parent or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = os.stat(name, dir_fd=top, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=top)
            return
        # the directories from `top` to the one open, and the subdirectories each has left to remove
        names, ids, subdirectories = [name], [(st.st_dev, st.st_ino)], [[]]
        fd = _open_directory(top, name, st)
        try:
            while True:
                seen = bool(subdirectories[-1])
                if not seen:  # (read again from its start: what was removed is gone)
                    with os.scandir(fd) as entries:
                        for entry in entries:
                            seen = True
                            if not entry.is_dir(follow_symlinks=False):
                                os.unlink(entry.name, dir_fd=fd)
                            elif len(subdirectories[-1]) < _REMOVE_BATCH:
                                subdirectories[-1].append(entry.name)
                            else:
                                break
                if subdirectories[-1]:
                    sub = subdirectories[-1].pop()
                    st = os.stat(sub, dir_fd=fd, follow_symlinks=False)
                    child = _open_directory(fd, sub, st)
                    os.close(fd)
                    fd = child
                    names.append(sub)
                    ids.append((st.st_dev, st.st_ino))
                    subdirectories.append([])
                elif not seen:  # empty: removed from its parent
                    done = names.pop()
                    ids.pop()
                    subdirectories.pop()
                    if not names:
                        break
                    up = os.open("..", _DIR_FLAGS, dir_fd=fd)
                    os.close(fd)
                    fd = up
                    st = os.fstat(fd)
                    if (st.st_dev, st.st_ino) != ids[-1]:
                        raise OSError(errno.ESTALE, f"{path} was moved while it was removed")
                    os.rmdir(done, dir_fd=fd)
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)


def _open_directory(parent: int, name: str, st: os.stat_result) -> int:
    """The directory `name` in `parent` (as lstat saw it: `st`) open, with rwx for its owner."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except PermissionError:  # no read permission (not root): given, as it is ours
        try:
            os.chmod(name, st.st_mode | 0o700, dir_fd=parent, follow_symlinks=False)
        except (NotImplementedError, OSError) as e:
            if isinstance(e, OSError) and e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            os.chmod(name, st.st_mode | 0o700, dir_fd=parent)  # (a directory: lstat said so)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise OSError(errno.ESTALE, f"{name} was replaced while it was removed")
        if now.st_mode & 0o700 != 0o700:
            try:
                os.fchmod(fd, now.st_mode | 0o700)
            except OSError:
                pass  # not ours: root needs none, anyone else fails on what they cannot remove
    except BaseException:
        os.close(fd)
        raise
    return fd


def _discard(path: str) -> None:
    """`path` removed if it can be (a failed unpacking's work directory)."""
    try:
        _remove(path)
    except OSError:
        pass


def _unsafe_directory(path: str) -> str | None:
    """Why someone other than root and this user could change the directory `path` or
    replace it; None if nobody can: every directory on the way to it (through symbolic
    links, as the kernel follows them) owned by root or this user and writable by no one
    else, or sticky (as /tmp) with the entry in it owned by root or this user; `path` a
    directory of this user that no one else can write."""
    me = os.geteuid()
    ours = (0, me)
    pending = list(reversed(os.path.join(os.getcwd(), path).split("/")))
    here = "/"
    links = 0
    try:
        st = os.lstat(here)
        while pending:
            part = pending.pop()
            if part in ("", "."):
                continue
            if part == "..":
                here = os.path.dirname(here)
                st = os.lstat(here)
                continue
            entry = os.path.join(here, part)
            entry_st = os.lstat(entry)
            if st.st_uid not in ours:
                return f"{here} is owned by uid {st.st_uid}"
            if st.st_mode & 0o022:
                if not st.st_mode & stat.S_ISVTX:
                    return f"{here} is writable by others"
                if entry_st.st_uid not in ours:
                    return f"{entry}, in the shared directory {here}, is owned by uid {entry_st.st_uid}"
            if stat.S_ISLNK(entry_st.st_mode):
                links += 1
                if links > _MAX_LINKS:
                    return f"too many levels of symbolic links (more than {_MAX_LINKS})"
                text = os.readlink(entry)
                if text.startswith("/"):
                    here = "/"
                    st = os.lstat(here)
                pending.extend(reversed(text.split("/")))
                continue
            here, st = entry, entry_st
    except OSError as e:
        return f"{e.filename or here}: {e.strerror or e}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{here} is not a directory"
    if st.st_uid != me:
        return f"{here} is owned by uid {st.st_uid}"
    if st.st_mode & 0o022:
        return f"{here} is writable by others"
    return None


def _set_attrs_at(path: str, member: tarfile.TarInfo, unpacking: _Unpacking, flags: int) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | flags)
    try:
        _set_attrs(fd, member, unpacking)
    finally:
        os.close(fd)


def _set_attrs(fd: int, member: tarfile.TarInfo, unpacking: _Unpacking) -> None:
    """Owner (numeric, as root), mode (no setuid, setgid, sticky, group or other write
    bits) and modification time of what `fd` has open: never through a link."""
    if unpacking.as_root:
        os.fchown(fd, member.uid, member.gid)
    os.fchmod(fd, member.mode & 0o755)
    try:
        os.utime(fd, (member.mtime, member.mtime))
    except (OSError, OverflowError, ValueError):
        pass


__all__ = ["MAX_IMAGE_BYTES", "MAX_IMAGE_MEMBERS", "ImageCache", "ImageError"]
