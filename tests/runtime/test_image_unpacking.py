"""Hostile images (tangram.runtime.sandbox.images): layers, layouts and archives built here, offline,
to escape the unpacker (CVE-2025-4517's PATH_MAX symlink chain, hard links and whiteouts
through symbolic links, digests used as paths or claiming another image's, gzip bombs,
malformed JSON, the host's own root as an image). Each is unpacked for real: the host's
files outside stay as they were, and the image is refused with an ImageError naming why."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import itertools
import json
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from test_images import layer, oci_layout, save_archive

from tangram.runtime.sandbox import images
from tangram.runtime.sandbox.images import ImageCache, ImageError

_ids = itertools.count(1)


def tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as t:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            t.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, mode
    return info


def work_root_length(cache: Path) -> int:
    """The length of the root a layer is unpacked into: <cache>/.<key[:12]>-<8 random>/rootfs."""
    return len(os.path.realpath(cache)) + len("/.") + 12 + len("-") + 8 + len("/rootfs")


def path_max_chain(dest_len: int, last: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    """CVE-2025-4517: 16 long directories reached through 16 symbolic links, so that
    os.path.realpath of `escape/...` stops resolving past PATH_MAX (and tarfile's filter
    sees it inside the root) while the kernel follows `escape` to the host's /. `last`
    is the member written through it."""
    comp = "d" * ((4096 - dest_len - 1) // 17)
    steps = "abcdefghijklmnop"
    members: list[tuple[tarfile.TarInfo, bytes | None]] = []
    path = ""
    for step in steps:
        members.append((entry(os.path.join(path, comp), tarfile.DIRTYPE, mode=0o755), None))
        members.append((entry(os.path.join(path, step), tarfile.SYMTYPE, comp), None))
        path = os.path.join(path, comp)
    linkpath = os.path.join(*steps, "l" * 254)
    members.append((entry(linkpath, tarfile.SYMTYPE, "/".join([".."] * len(steps))), None))
    members.append((entry("escape", tarfile.SYMTYPE, linkpath + "/.." * 17), None))
    members.append(last)
    members.append((entry("bin", tarfile.DIRTYPE, mode=0o755), None))
    return tar(*members)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """The host's files an image must not reach: a file, a directory, a secret."""
    out = tmp_path / "outside"
    (out / "precious").mkdir(parents=True)
    (out / "precious" / "data").write_text("keep me\n")
    (out / "secret").write_text("secret\n")
    os.chmod(out / "secret", 0o600)
    return out


def untouched(out: Path) -> None:
    assert sorted(p.name for p in out.iterdir()) == ["precious", "secret"]
    assert (out / "precious" / "data").read_text() == "keep me\n"
    st = (out / "secret").stat()
    assert (out / "secret").read_text() == "secret\n" and st.st_nlink == 1 and st.st_mode & 0o7777 == 0o600


def nothing_cached(cache: Path) -> None:
    assert not cache.exists() or list(cache.iterdir()) == []


# ---------------------------------------------------------------------------- escapes through layers
def test_a_path_max_symlink_chain_writes_no_host_file(tmp_path: Path, outside: Path) -> None:
    cache = tmp_path / "cache"
    content = b"root was here\n"
    evil = path_max_chain(work_root_length(cache), (entry("escape" + str(outside / "pwned")), content))
    with pytest.raises(ImageError, match="File name too long"):
        ImageCache(str(cache)).rootfs(str(oci_layout(tmp_path / "oci", [evil])))
    assert not (outside / "pwned").exists()
    untouched(outside)
    nothing_cached(cache)


def test_a_path_max_symlink_chain_whites_out_no_host_directory(tmp_path: Path, outside: Path) -> None:
    cache = tmp_path / "cache"
    evil = path_max_chain(work_root_length(cache), (entry(f"escape{outside}/.wh.precious"), b""))
    with pytest.raises(ImageError, match="File name too long"):
        ImageCache(str(cache)).rootfs(str(save_archive(tmp_path / "evil.tar", [evil])))
    untouched(outside)
    nothing_cached(cache)


def test_a_hard_link_through_a_symlink_links_no_host_file(tmp_path: Path, outside: Path) -> None:
    """`l` -> the host's directory, then a hard link `x` -> `l/secret` (mode 4777): the
    kernel would follow `l` on the host; inside the root `l/secret` does not exist."""
    cache = tmp_path / "cache"
    image = save_archive(tmp_path / "link.tar", [layer({}, links={"l": str(outside)}),
                                                 tar((entry("x", tarfile.LNKTYPE, "l/secret", 0o4777), None))])
    with pytest.raises(ImageError, match="hard link.*l/secret"):
        ImageCache(str(cache)).rootfs(str(image))
    untouched(outside)
    nothing_cached(cache)
    # the root is <cache>/.<key>-<random>/rootfs: ../../../outside/secret is the host's file
    hard = entry("x", tarfile.LNKTYPE, "../../../outside/secret", 0o4777)
    up = save_archive(tmp_path / "up.tar", [tar((hard, None))])
    with pytest.raises(ImageError, match="hard link.*outside the root"):
        ImageCache(str(cache)).rootfs(str(up))
    untouched(outside)
    nothing_cached(cache)


def test_links_are_followed_inside_the_root_as_in_a_chroot(tmp_path: Path, outside: Path) -> None:
    """Absolute links restart at the image's root, `..` stops there: what goes through
    them lands inside the image (as in the container), never on the host."""
    lower = tar((entry("run", tarfile.DIRTYPE, mode=0o755), None), (entry("var", tarfile.DIRTYPE, mode=0o755), None),
                (entry("var/run", tarfile.SYMTYPE, "/run"), None),
                (entry("up", tarfile.SYMTYPE, "../../../../../../../.."), None),
                (entry("host", tarfile.SYMTYPE, str(outside)), None),
                (entry("secret", tarfile.SYMTYPE, str(outside / "secret")), None),
                (entry("mkdir", tarfile.DIRTYPE, mode=0o755), None), (entry("mkdir/in/file"), b"made\n"))
    upper = tar((entry("var/run/pid"), b"1\n"), (entry(f"up{outside}/"[:-1], tarfile.DIRTYPE, mode=0o755), None),
                (entry(f"up{outside}/precious/.wh.data"), b""), (entry(f"up{outside}/secret", mode=0o4777), b"image\n"),
                (entry("host/.wh.precious"), b""), (entry("secret", mode=0o600), b"replaced the link\n"),
                (entry("var/run/../run/again"), b"2\n"))
    root = Path(ImageCache(str(tmp_path / "cache")).rootfs(str(oci_layout(tmp_path / "oci", [lower, upper]))))
    untouched(outside)
    assert (root / "run" / "pid").read_text() == "1\n" and (root / "run" / "again").read_text() == "2\n"
    inner = root / str(outside).lstrip("/")
    assert (inner / "secret").read_text() == "image\n" and not (inner / "secret").stat().st_mode & 0o7000
    assert not (root / "secret").is_symlink() and (root / "secret").read_text() == "replaced the link\n"
    assert os.readlink(root / "host") == str(outside)  # kept verbatim, for inside the sandbox
    assert (root / "mkdir" / "in" / "file").read_text() == "made\n"


def test_a_member_under_a_dangling_link_or_a_file_is_refused(tmp_path: Path, outside: Path) -> None:
    cache = ImageCache(str(tmp_path / "cache"))
    dangling = save_archive(tmp_path / "d.tar", [layer({}, links={"etc": str(outside / "new")}),
                                                 layer({"etc/planted": b"x"})])
    with pytest.raises(ImageError, match="etc/planted.*missing directory"):
        cache.rootfs(str(dangling))
    loop = save_archive(tmp_path / "l.tar", [layer({}, links={"a": "b", "b": "a"}), layer({"a/x": b"x"})])
    with pytest.raises(ImageError, match="too many levels of symbolic links"):
        cache.rootfs(str(loop))
    under_file = save_archive(tmp_path / "f.tar", [layer({"f": b"x"}), layer({"f/x": b"x"})])
    with pytest.raises(ImageError, match="not a directory"):
        cache.rootfs(str(under_file))
    assert not (outside / "new").exists()
    untouched(outside)
    nothing_cached(tmp_path / "cache")


def test_hard_links_modes_and_owners(tmp_path: Path) -> None:
    lower = tar((entry("bin", tarfile.DIRTYPE, mode=0o1777), None), (entry("bin/tool", mode=0o6777), b"#!\n"),
                (entry("bin/same", tarfile.LNKTYPE, "bin/tool", 0o4755), None),
                (entry("bin/fifo", tarfile.FIFOTYPE), None), (entry("bin/dev", tarfile.CHRTYPE), None))
    owned = entry("home", tarfile.DIRTYPE, mode=0o700)
    owned.uid = owned.gid = 4321
    owned.uname = owned.gname = "root"  # numeric ids, as container runtimes use them
    upper = tar((owned, None), (entry("link-to-link", tarfile.LNKTYPE, "bin/sh"), None))
    cache = ImageCache(str(tmp_path / "cache"))
    root = Path(cache.rootfs(str(oci_layout(tmp_path / "ok", [lower, layer({}, links={"bin/sh": "tool"})]))))
    st = (root / "bin" / "tool").stat()
    assert st.st_ino == (root / "bin" / "same").stat().st_ino and st.st_nlink == 2
    assert st.st_mode & 0o7777 == 0o755 and (root / "bin").stat().st_mode & 0o7777 == 0o755
    assert not (root / "bin" / "fifo").exists() and not (root / "bin" / "dev").exists()
    with pytest.raises(ImageError, match="hard link.*not a regular file"):
        cache.rootfs(str(oci_layout(tmp_path / "bad", [lower, layer({}, links={"bin/sh": "tool"}), upper])))
    if os.geteuid() == 0:
        root = Path(cache.rootfs(str(oci_layout(tmp_path / "owned", [tar((owned, None))]))))
        assert (root / "home").stat().st_uid == 4321 and (root / "home").stat().st_mode & 0o777 == 0o700


# ---------------------------------------------------------------------------- digests
def layout(path: Path, layers: list[bytes], index_digest: str | None = None, layer_digests: list[Any] | None = None,
           algorithm: str = "sha256") -> tuple[Path, str]:
    """An OCI layout of uncompressed layers, the index's and the manifest's digests as
    given (default: the true ones); returns it and the manifest's true digest."""
    def blob(data: bytes, name: str | None = None) -> str:
        digest = name or f"{algorithm}:{hashlib.new(algorithm, data).hexdigest()}"
        alg, _, hexa = digest.partition(":")
        (path / "blobs" / alg).mkdir(parents=True, exist_ok=True)
        (path / "blobs" / alg / hexa).write_bytes(data)
        return digest

    digests = [blob(data) for data in layers]
    manifest = json.dumps({"schemaVersion": 2, "layers": [{"digest": d} for d in (layer_digests or digests)]}).encode()
    true = blob(manifest)
    if index_digest is not None:
        (path / "blobs" / true.replace(":", "/")).rename(path / "blobs" / index_digest.replace(":", "/"))
    (path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (path / "index.json").write_text(json.dumps({"manifests": [{"digest": index_digest or true}]}))
    return path, true


def test_a_layout_cannot_claim_another_images_digest(tmp_path: Path) -> None:
    cache = ImageCache(str(tmp_path / "cache"))
    good, digest = layout(tmp_path / "good", [tar((entry("etc/os-release"), b"GOOD\n"))])
    evil, _ = layout(tmp_path / "evil", [tar((entry("etc/os-release"), b"EVIL\n"))], index_digest=digest)
    with pytest.raises(ImageError, match=f"manifest {digest}: its content does not match"):
        cache.rootfs(str(evil))
    nothing_cached(tmp_path / "cache")
    assert Path(cache.rootfs(str(good)), "etc", "os-release").read_text() == "GOOD\n"
    # a layer swapped for another: the manifest is right, the layer is not
    swapped, _ = layout(tmp_path / "swapped", [tar((entry("etc/os-release"), b"GOOD\n"))])
    (blob,) = [p for p in (swapped / "blobs" / "sha256").iterdir() if p.read_bytes().startswith(b"etc")]
    blob.write_bytes(tar((entry("etc/os-release"), b"EVIL\n")))
    with pytest.raises(ImageError, match="corrupt layer sha256:.*does not match its digest"):
        ImageCache(str(tmp_path / "other-cache")).rootfs(str(swapped))  # (in this cache: the good image's, unread)
    nothing_cached(tmp_path / "other-cache")


def test_digests_are_not_paths(tmp_path: Path) -> None:
    cache = ImageCache(str(tmp_path / "cache"))
    secret = tmp_path / "host-secret.tar"
    secret.write_bytes(tar((entry("stolen"), b"host secret outside the layout\n")))
    sha = hashlib.sha256(secret.read_bytes()).hexdigest()
    for n, bad in enumerate([f"sha256:{secret}", f"sha256:../../{secret.name}", f"sha256:{sha.upper()}",
                             f"md5:{hashlib.md5(b'').hexdigest()}", "sha256:", f"sha256:{sha}/..", f"sha512:{sha}",
                             f" sha256:{sha}", None, 5]):
        path, _ = layout(tmp_path / f"reader{n}", [tar((entry("etc/x"), b"x"))], layer_digests=[bad])
        (path / "blobs" / "sha256" / sha).symlink_to(secret)
        with pytest.raises(ImageError, match=r"layers\[0\]\.digest: .* is not a digest"):
            cache.rootfs(str(path))
    nothing_cached(tmp_path / "cache")


def test_sha512_digests_are_verified_too(tmp_path: Path) -> None:
    path, _ = layout(tmp_path / "oci", [tar((entry("etc/x"), b"x"))], algorithm="sha512")
    assert Path(ImageCache(str(tmp_path / "cache")).rootfs(str(path)), "etc", "x").read_text() == "x"


# ---------------------------------------------------------------------------- malformed images
def raw_layout(path: Path, index: Any, blobs: dict[str, Any] | None = None) -> Path:
    (path / "blobs" / "sha256").mkdir(parents=True)
    (path / "oci-layout").write_text("{}")
    (path / "index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    for digest, value in (blobs or {}).items():
        (path / "blobs" / "sha256" / digest).write_text(json.dumps(value))
    return path


def json_digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()


MALFORMED: dict[str, tuple[Any, list[Any], str]] = {  # index.json, manifests, what the error names
    "digest_int": ({"manifests": [{"digest": 5}]}, [], r"manifests\[0\]\.digest: 5 is not a digest"),
    "layer_digest_null": ({"manifests": [{"digest": "M0"}]}, [{"layers": [{"digest": None}]}],
                          r"layers\[0\]\.digest: None is not a digest"),
    "manifest_is_string": ({"manifests": [{"digest": "M0"}]}, ["hello"], "manifest .* is not a JSON object"),
    "digest_empty": ({"manifests": [{"digest": "M0"}]}, [{"layers": [{"digest": "sha256:"}]}], "is not a digest"),
    "index_is_list": ([1, 2], [], "index.json is not a JSON object"),
    "index_not_json": ("{", [], "index.json: not JSON"),
    "manifests_not_list": ({"manifests": {"digest": "x"}}, [], "index.json manifests is not a list"),
    "entry_not_object": ({"manifests": ["sha256:00"]}, [], r"manifests\[0\] is not a JSON object"),
    "annotations_not_object": ({"manifests": [{"digest": "M0", "annotations": []}]}, [],
                               r"manifests\[0\]\.annotations is not a JSON object"),
    "layers_not_list": ({"manifests": [{"digest": "M0"}]}, [{"layers": "abc"}], "layers is not a list"),
    "layer_not_object": ({"manifests": [{"digest": "M0"}]}, [{"layers": [7]}], r"layers\[0\] is not a JSON object"),
    "no_layers": ({"manifests": [{"digest": "M0"}]}, [{"config": {}}], "neither layers nor manifests"),
    "empty_nested_index": ({"manifests": [{"digest": "M0"}]}, [{"manifests": []}], "manifests is empty"),
    "missing_blob": ({"manifests": [{"digest": "sha256:" + "0" * 64}]}, [], "blob sha256:0+ missing"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_layouts_are_image_errors_naming_the_field(tmp_path: Path, case: str) -> None:
    index, manifests, said = MALFORMED[case]
    digests = [json_digest(m) for m in manifests]
    text = json.dumps(index) if not isinstance(index, str) else index
    for i, d in enumerate(digests):
        text = text.replace(f'"M{i}"', f'"sha256:{d}"')
    path = raw_layout(tmp_path / "oci", text, dict(zip(digests, manifests)))
    with pytest.raises(ImageError, match=said):
        ImageCache(str(tmp_path / "cache")).rootfs(str(path))


def test_a_blob_that_is_a_directory_or_a_fifo_is_an_image_error(tmp_path: Path) -> None:
    for kind in ("dir", "fifo"):
        d = "1" * 64 if kind == "dir" else "2" * 64
        path = raw_layout(tmp_path / kind, {"manifests": [{"digest": f"sha256:{d}"}]})
        (os.mkdir if kind == "dir" else os.mkfifo)(path / "blobs" / "sha256" / d)
        unblock = threading.Timer(5, writer_of, (path / "blobs" / "sha256" / d,))  # a reader would wait forever
        unblock.start()
        try:
            with pytest.raises(ImageError, match="not a regular file"):
                ImageCache(str(tmp_path / "cache")).rootfs(str(path))
        finally:
            unblock.cancel()


def writer_of(fifo: Path) -> None:
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


SAVE_MALFORMED: dict[str, tuple[Any, str]] = {
    "not_a_list": ({"Layers": []}, "manifest.json is not a list"),
    "entry_not_object": (["x"], r"manifest.json\[0\] is not a JSON object"),
    "repotags_not_list": ([{"RepoTags": 5, "Layers": []}], r"RepoTags is not a list"),
    "layers_not_list": ([{"Layers": "0/layer.tar"}], r"Layers is not a list"),
    "layer_absolute": ([{"Layers": ["/etc/passwd"]}], r"Layers\[0\]: '/etc/passwd' is not a path inside the archive"),
    "layer_dotdot": ([{"Layers": ["../image.tar"]}], r"Layers\[0\]: '../image.tar' is not a path inside the archive"),
    "layer_not_string": ([{"Layers": [3]}], r"Layers\[0\]: 3 is not a path inside the archive"),
    "layer_missing": ([{"Layers": ["nothere/layer.tar"]}], "layer 'nothere/layer.tar' missing from the archive"),
    "config_not_string": ([{"Config": {}, "Layers": []}], "Config is not a string"),
}


@pytest.mark.parametrize("case", sorted(SAVE_MALFORMED))
def test_malformed_save_archives_are_image_errors_naming_the_field(tmp_path: Path, case: str) -> None:
    manifest, said = SAVE_MALFORMED[case]
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text("host\n")
    archive = tmp_path / "image.tar"
    with tarfile.open(archive, "w") as t:
        data = json.dumps(manifest).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    with pytest.raises(ImageError, match=said):
        ImageCache(str(tmp_path / "cache")).rootfs(str(archive))


def test_an_archives_blob_layers_are_verified(tmp_path: Path) -> None:
    """A `docker save` of docker 25+ names its layers blobs/sha256/<digest>: checked."""
    good = tar((entry("etc/x"), b"x"))
    archive = tmp_path / "image.tar"
    with tarfile.open(archive, "w") as t:
        for name, data in ((f"blobs/sha256/{hashlib.sha256(good).hexdigest()}", tar((entry("etc/x"), b"evil"))),
                           ("manifest.json", json.dumps([{"Config": "c.json", "Layers": [
                               f"blobs/sha256/{hashlib.sha256(good).hexdigest()}"]}]).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    with pytest.raises(ImageError, match="does not match its digest"):
        ImageCache(str(tmp_path / "cache")).rootfs(str(archive))


# ---------------------------------------------------------------------------- limits
def test_a_gzip_bomb_ends_in_an_image_error(tmp_path: Path) -> None:
    big = entry("zeros")
    big.size = 64 << 20
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as t:
        t.addfile(big, io.BytesIO(bytes(big.size)))
    bomb = out.getvalue()
    assert len(gzip.compress(bomb)) < 1 << 20
    cache = tmp_path / "cache"
    with pytest.raises(ImageError, match="more than 16777216 bytes"):
        ImageCache(str(cache), max_bytes=16 << 20).rootfs(str(oci_layout(tmp_path / "oci", [bomb])))
    nothing_cached(cache)
    # the data of a member that is not unpacked (a whiteout's) counts too
    big.name = ".wh.zeros"
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as t:
        t.addfile(big, io.BytesIO(bytes(big.size)))
    skipped = out.getvalue()
    with pytest.raises(ImageError, match="more than 16777216 bytes"):
        ImageCache(str(cache), max_bytes=16 << 20).rootfs(str(save_archive(tmp_path / "skipped.tar", [skipped])))
    nothing_cached(cache)
    files = tar(*((entry(f"f{i}"), b"") for i in range(300)))
    with pytest.raises(ImageError, match="more than 200 members"):
        ImageCache(str(cache), max_members=200).rootfs(str(oci_layout(tmp_path / "many", [files])))
    nothing_cached(cache)
    assert Path(ImageCache(str(cache), max_members=400).rootfs(str(tmp_path / "many")), "f299").exists()


def test_a_zstd_layer_is_named(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="compressed with zstd"):
        ImageCache(str(tmp_path / "cache")).rootfs(str(layout(tmp_path / "oci", [b"\x28\xb5\x2f\xfd" + bytes(600)])[0]))


def test_a_huge_extended_header_is_refused(tmp_path: Path) -> None:
    info = entry("x")
    info.pax_headers = {"comment": "c" * (9 << 20)}
    data = tar((info, b"x"))
    with pytest.raises(ImageError, match="extended header"):
        ImageCache(str(tmp_path / "cache")).rootfs(str(oci_layout(tmp_path / "oci", [data])))


# ---------------------------------------------------------------------------- headers, sparse files, deep trees
def layer_peak(body: Any, monkeypatch: pytest.MonkeyPatch) -> int:
    """The most memory Python held (tracemalloc) while a layer was unpacked by `body`, above
    what it held before (reading a JSON document allocates _MAX_JSON bytes, briefly)."""
    peaks = [0]
    apply_layer = images._apply_layer

    def measured(*args: Any) -> None:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            apply_layer(*args)
        finally:
            peaks.append(tracemalloc.get_traced_memory()[1] - base)

    monkeypatch.setattr(images, "_apply_layer", measured)
    tracemalloc.start()
    try:
        body()
    finally:
        tracemalloc.stop()
        monkeypatch.setattr(images, "_apply_layer", apply_layer)
    return max(peaks)


def test_extended_headers_are_not_kept_for_the_whole_layer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tarfile's stream mode keeps every member it read (with its pax records) until the
    layer ends: 48 members with a 512 KiB pax record each held 24 MiB, 4 000 of them GBs
    (from a gzipped layer of a few MB). Only the member being unpacked is kept."""
    members = [(entry(f"f{i}"), b"") for i in range(48)]
    for i, (info, _) in enumerate(members):
        info.pax_headers = {"comment": chr(ord("a") + i % 26) * (512 << 10)}
    image = oci_layout(tmp_path / "oci", [tar(*members)])
    cache = ImageCache(str(tmp_path / "cache"))
    roots: list[str] = []
    peak = layer_peak(lambda: roots.append(cache.rootfs(str(image))), monkeypatch)
    assert Path(roots[0], "f47").exists()
    assert peak < 8 << 20, f"unpacking held {peak >> 20} MiB"
    # and the extended headers of an image are bounded all together
    monkeypatch.setattr(images, "_MAX_EXTENDED", 8 << 20)
    with pytest.raises(ImageError, match="extended headers"):
        ImageCache(str(tmp_path / "cache2")).rootfs(str(image))
    nothing_cached(tmp_path / "cache2")


def raw_tar(*members: tuple[bytes, bytes]) -> bytes:
    """A tar of raw headers: (type, data) each, named h<i>, nothing added by tarfile; a file ends it."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as t:
        for i, (kind, data) in enumerate(members):
            info = entry(f"h{i}", kind)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        info = entry("file")
        info.size = 2
        t.addfile(info, io.BytesIO(b"x\n"))
    return out.getvalue()


def pax_record(key: str, value: str) -> bytes:
    body = f" {key}={value}\n".encode()
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n += 1
    return str(n).encode() + body


def test_chained_and_global_extended_headers_are_bounded(tmp_path: Path) -> None:
    """Each extended header is parsed while the next is read (recursively, its records held):
    400 of them in a row were a RecursionError, not an ImageError; global (pax 'g') records
    are kept for all the layer's members, and copied onto each."""
    cache = tmp_path / "cache"
    chain = raw_tar(*[(tarfile.XHDTYPE, pax_record("comment", "c" * 100))] * 400)
    with pytest.raises(ImageError, match="extended headers in a row"):
        ImageCache(str(cache)).rootfs(str(oci_layout(tmp_path / "chain", [chain])))
    nothing_cached(cache)
    many = raw_tar(*[(tarfile.XGLTYPE, b"".join(pax_record(f"k{i}.{j}", "v") for j in range(100)))
                     for i in range(40)])
    with pytest.raises(ImageError, match="global"):
        ImageCache(str(cache)).rootfs(str(oci_layout(tmp_path / "globals", [many])))
    nothing_cached(cache)
    # a few in a row, as GNU tar and git archive write them, are fine
    fine = raw_tar((tarfile.XGLTYPE, pax_record("comment", "0" * 40)), (tarfile.XHDTYPE, pax_record("mtime", "1.5")))
    assert Path(ImageCache(str(cache)).rootfs(str(oci_layout(tmp_path / "fine", [fine]))), "file").read_text() == "x\n"


def old_gnu_sparse(name: str, realsize: int) -> bytes:
    """A GNU tar sparse member (type 'S'): one byte of data at its end, `realsize` bytes long."""
    info = entry(name)
    info.size = 1
    buf = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    buf[156:157] = tarfile.GNUTYPE_SPARSE
    buf[386:398] = tarfile.itn(realsize - 1, 12, tarfile.GNU_FORMAT)  # one struct: offset, numbytes
    buf[398:410] = tarfile.itn(1, 12, tarfile.GNU_FORMAT)
    buf[482] = 0  # not extended
    buf[483:495] = tarfile.itn(realsize, 12, tarfile.GNU_FORMAT)
    buf[148:156] = b" " * 8
    buf[148:156] = b"%06o\0 " % sum(buf)
    return bytes(buf) + b"x".ljust(512, b"\0")


def sparse_layer(version: str, count: int, realsize: int) -> bytes:
    """`count` sparse members s<i> of `realsize` bytes (one of data), GNU sparse `version`."""
    if version == "old":
        return b"".join(old_gnu_sparse(f"s{i}", realsize) for i in range(count)) + bytes(1024)
    members = []
    for i in range(count):
        info = entry(f"s{i}")
        data = b"x"
        if version == "0.0":
            info.pax_headers = {"GNU.sparse.size": str(realsize), "GNU.sparse.numblocks": "1",
                                "GNU.sparse.offset": str(realsize - 1), "GNU.sparse.numbytes": "1"}
        elif version == "0.1":
            info.pax_headers = {"GNU.sparse.map": f"{realsize - 1},1", "GNU.sparse.realsize": str(realsize)}
        else:
            info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": f"s{i}",
                                "GNU.sparse.realsize": str(realsize)}
            data = f"1\n{realsize - 1}\n1\n".encode().ljust(512, b"\0") + b"x"
            info.name = f"GNUSparseFile.0/s{i}"
        members.append((info, data))
    return tar(*members)


@pytest.mark.parametrize("version", ["old", "0.0", "0.1", "1.0"])
def test_sparse_members_are_refused(tmp_path: Path, version: str) -> None:
    """A sparse member's holes were written for real, and not counted: with max_bytes=4 MiB,
    4 members of 3 MiB each (a few bytes of stream) wrote 12 MiB. Images hold no sparse
    files: each is refused, by name."""
    cache = tmp_path / "cache"
    evil = sparse_layer(version, 4, 3 << 20)
    with pytest.raises(ImageError, match=r"member 's0'.*sparse"):
        ImageCache(str(cache), max_bytes=4 << 20).rootfs(str(oci_layout(tmp_path / "oci", [evil])))
    nothing_cached(cache)


def test_a_sparse_map_is_refused_before_it_is_parsed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GNU.sparse.map record became a list of ints and tuples, kept for the whole layer
    (+1.4 GB for a 62 KB gzipped layer)."""
    cache = tmp_path / "cache"
    sparse = ",".join(["0,0"] * 200_000)
    members = []
    for i in range(3):
        info = entry(f"s{i}")
        info.pax_headers = {"GNU.sparse.map": sparse, "GNU.sparse.realsize": "0"}
        members.append((info, b""))
    evil = tar(*members)
    image = oci_layout(tmp_path / "oci", [evil])
    failed: list[str] = []

    def unpack() -> None:
        with pytest.raises(ImageError, match=r"member 's0'.*sparse") as e:
            ImageCache(str(cache)).rootfs(str(image))
        failed.append(str(e.value))

    peak = layer_peak(unpack, monkeypatch)
    assert failed and peak < 8 << 20, f"unpacking held {peak >> 20} MiB"
    nothing_cached(cache)


def deep_layer(last: tuple[tarfile.TarInfo, bytes | None] | None, depth: int = 1900) -> bytes:
    """A file `depth` directories deep (a/a/.../a/f), then `last`."""
    members = [(entry("bin", tarfile.DIRTYPE, mode=0o755), None), (entry("/".join(["a"] * depth) + "/f"), b"x")]
    return tar(*members, *([last] if last else []))


@pytest.mark.parametrize("case", ["whiteout", "opaque", "file over it", "second layer"])
def test_a_deep_tree_is_removed_without_recursion(tmp_path: Path, case: str) -> None:
    """shutil.rmtree recurses (Python 3.11): a tree 1 900 directories deep, whited out or
    replaced, raised RecursionError."""
    if case == "whiteout":
        layers = [deep_layer((entry(".wh.a"), b""))]
    elif case == "opaque":
        layers = [deep_layer((entry("a/.wh..wh..opq"), b""))]
    elif case == "file over it":
        layers = [deep_layer((entry("a"), b"file\n"))]
    else:
        layers = [deep_layer(None), tar((entry("a"), b"file\n"))]
    root = Path(ImageCache(str(tmp_path / "cache")).rootfs(str(oci_layout(tmp_path / "oci", layers))))
    if case == "opaque":
        assert os.listdir(root / "a") == []
    elif case == "whiteout":
        assert not (root / "a").exists()
    else:
        assert (root / "a").read_text() == "file\n"


def test_a_deep_tree_then_an_error_leaves_no_work_directory(tmp_path: Path) -> None:
    """The cleanup's rmtree raised RecursionError (hiding the ImageError) and left
    <cache>/.<key>-<random> behind, one more at each try."""
    cache = tmp_path / "cache"
    image = oci_layout(tmp_path / "oci", [deep_layer((entry("../escape"), b"x"))])
    for _ in range(2):
        with pytest.raises(ImageError, match="member '../escape': outside the root"):
            ImageCache(str(cache)).rootfs(str(image))
        nothing_cached(cache)


def test_a_name_past_path_max_is_refused_at_once(tmp_path: Path) -> None:
    """A member 2 100 directories deep (4 200 characters) cannot be made: refused by its
    length, before 2 000 directories are made for it."""
    cache = tmp_path / "cache"
    with pytest.raises(ImageError, match="a name of 4201 characters"):
        ImageCache(str(cache)).rootfs(str(oci_layout(tmp_path / "oci", [tar((entry("a/" * 2100 + "f"), b"x"))])))
    nothing_cached(cache)


def test_a_read_only_tree_is_removed(tmp_path: Path) -> None:
    """Directories of the image without write (or read) permission for their owner are
    removed too (as a user other than root as well)."""
    lower = tar((entry("bin", tarfile.DIRTYPE, mode=0o755), None), (entry("ro", tarfile.DIRTYPE, mode=0o755), None),
                (entry("ro/sub", tarfile.DIRTYPE, mode=0o755), None), (entry("ro/sub/f"), b"x"),
                (entry("ro/sub", tarfile.DIRTYPE, mode=0o500), None), (entry("ro", tarfile.DIRTYPE, mode=0o000), None))
    upper = tar((entry(".wh.ro"), b""))
    root = Path(ImageCache(str(tmp_path / "cache")).rootfs(str(oci_layout(tmp_path / "oci", [lower, upper]))))
    assert not (root / "ro").exists()
    base = Path(tempfile.mkdtemp(prefix="tangram-test-")) if os.geteuid() == 0 else tmp_path  # reachable by nobody
    try:
        tree = base / "tree"
        (tree / "sub" / "deeper").mkdir(parents=True)
        (tree / "sub" / "deeper" / "f").write_text("x")
        (tree / "link").symlink_to(base / "keep")
        (base / "keep").mkdir()
        (base / "keep" / "mine").write_text("mine")
        if os.geteuid() == 0:  # removed by a user other than root (whom permissions do not stop)
            for path in (base, tree, tree / "sub", tree / "sub" / "deeper", tree / "link"):
                os.lchown(path, 65534, 65534)
            os.lchown(tree / "sub" / "deeper" / "f", 65534, 65534)
        os.chmod(tree / "sub" / "deeper", 0o000)
        os.chmod(tree / "sub", 0o500)
        if os.geteuid() != 0:
            images._remove(str(tree))
        else:
            pid = os.fork()
            if pid == 0:
                try:
                    os.setgroups([])
                    os.setgid(65534)
                    os.setuid(65534)
                    images._remove(str(tree))
                    os._exit(0)
                except BaseException:
                    os._exit(1)
            assert os.waitpid(pid, 0)[1] == 0
        assert not tree.exists() and (base / "keep" / "mine").read_text() == "mine"
    finally:
        if base != tmp_path:
            shutil.rmtree(base)


@pytest.mark.parametrize("error", [RecursionError, MemoryError, KeyError])
def test_an_unexpected_error_is_an_image_error_naming_the_member(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               error: type[BaseException]) -> None:
    def failing(*args: Any) -> None:
        raise error("injected")

    monkeypatch.setattr(images, "_set_attrs", failing)
    cache = tmp_path / "cache"
    with pytest.raises(ImageError, match=rf"member 'etc/x': {error.__name__}.*injected"):
        ImageCache(str(cache)).rootfs(str(oci_layout(tmp_path / "oci", [tar((entry("etc/x"), b"x"))])))
    nothing_cached(cache)


# ---------------------------------------------------------------------------- the cache's own directories
def manifest_key(layout_path: Path) -> str:
    return json.loads((layout_path / "index.json").read_text())["manifests"][0]["digest"].partition(":")[2]


def test_a_planted_cache_entry_is_not_used(tmp_path: Path, outside: Path) -> None:
    """<cache>/<key> is found by the image's digest: a symbolic link there (to the host's
    files), a directory of someone else's or a rootfs that is a link is refused, never
    used as the image's root."""
    image = oci_layout(tmp_path / "oci", [tar((entry("etc/x"), b"image\n"))])
    cache = tmp_path / "cache"
    entry_path = cache / manifest_key(image)
    (outside / "rootfs" / "etc").mkdir(parents=True)
    cache.mkdir(mode=0o700)
    planted: list[Any] = [lambda: entry_path.symlink_to(outside),
                          lambda: (entry_path.mkdir(), (entry_path / "rootfs").symlink_to(outside / "rootfs"))]
    if os.geteuid() == 0:
        planted.append(lambda: (entry_path.mkdir(), (entry_path / "rootfs").mkdir(), os.chown(entry_path, 4321, 4321)))
    planted.append(lambda: (entry_path.mkdir(mode=0o777), os.chmod(entry_path, 0o777), (entry_path / "rootfs").mkdir()))
    for plant in planted:
        plant()
        with pytest.raises(ImageError, match="not a directory of this cache"):
            ImageCache(str(cache)).rootfs(str(image))
        assert sorted(p.name for p in outside.iterdir()) == ["precious", "rootfs", "secret"]
        assert list((outside / "rootfs").iterdir()) == [outside / "rootfs" / "etc"]
        if entry_path.is_symlink():
            entry_path.unlink()
        else:
            shutil.rmtree(entry_path)
        assert list(cache.iterdir()) == []  # (nothing left by the refused try)
    assert Path(ImageCache(str(cache)).rootfs(str(image)), "etc", "x").read_text() == "image\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="files of another user need root")
def test_a_cache_directory_others_can_change_is_refused(tmp_path: Path) -> None:
    """The cache's directory and every directory on the way to it (through links) must be
    writable only by root or this user: someone who can replace it could swap in an image
    root of theirs. A link of ours (to a directory of ours) is fine."""
    image = oci_layout(tmp_path / "oci", [tar((entry("etc/x"), b"image\n"))])
    shared = tmp_path / "shared"  # as /tmp: sticky, anyone may add entries
    shared.mkdir()
    os.chmod(shared, 0o1777)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    (shared / "planted").symlink_to(mine)
    os.lchown(shared / "planted", 4321, 4321)
    theirs = shared / "theirs"
    theirs.mkdir()
    os.chown(theirs, 4321, 4321)
    group = tmp_path / "group"
    group.mkdir()
    os.chmod(group, 0o775)
    for directory in (shared / "planted", theirs, theirs / "cache", group / "cache", group):
        with pytest.raises(ImageError, match="image cache"):
            ImageCache(str(directory)).rootfs(str(image))
        assert list(mine.iterdir()) == []
    (tmp_path / "link").symlink_to(mine)
    (shared / "ours").symlink_to(mine)
    for directory in (tmp_path / "link", shared / "ours", shared / "new" / "cache"):
        assert Path(ImageCache(str(directory)).rootfs(str(image)), "etc", "x").read_text() == "image\n"
    assert stat.S_IMODE((shared / "new" / "cache").stat().st_mode) == 0o700


# ---------------------------------------------------------------------------- the host's root, idmapped
def test_the_hosts_root_is_not_an_image(tmp_path: Path) -> None:
    (tmp_path / "slash").symlink_to("/")
    for reference in ("/", str(tmp_path / "slash"), "/."):
        with pytest.raises(ImageError, match="the host's root"):
            ImageCache(str(tmp_path / "cache")).rootfs(reference)


@pytest.mark.skipif(os.geteuid() != 0, reason="an idmapped mount needs root")
def test_an_idmap_failure_is_an_image_error(tmp_path: Path) -> None:
    """A root directory holding a proc mount: proc cannot be idmapped."""
    from tangram.runtime.sandbox.rootfs import mount_image_root
    image = tmp_path / "root"
    (image / "bin").mkdir(parents=True)
    (image / "proc").mkdir()
    subprocess.run(["mount", "-t", "proc", "proc", str(image / "proc")], check=True)
    try:
        (tmp_path / "slot").mkdir()
        with pytest.raises(ImageError, match="cannot idmap"):
            mount_image_root(str(image), str(tmp_path / "slot"), 1 << 30)
    finally:
        subprocess.run(["umount", str(image / "proc")], check=True)
    with open("/proc/self/mountinfo") as f:
        assert str(tmp_path) not in f.read()


# ---------------------------------------------------------------------------- end to end
def end_to_end(cache: Path, image: str) -> Any:
    from tangram.runtime.call import Call, Placement
    from tangram.runtime.managers.base import LiveAction
    from tangram.runtime.managers.cpu import CpuManager
    from tangram.runtime.sandbox.namespaces import detect

    boundary = detect("auto")
    if not boundary.namespaces or os.geteuid() != 0 or not (shutil.which("busybox") or os.path.exists("/bin/busybox")):
        pytest.skip("image sandboxes need namespaces and root")
    mgr = CpuManager(isolation="namespaces", image_cache=str(cache), warm_sandboxes=0)
    place = Placement(action_id=0, node=0, node_name="local", device=None, grant=1.0, cores=1.0, memory=0.0,
                      gpu_memory=0.0, env={})

    async def main() -> Any:
        await mgr.start()
        try:
            return await mgr.execute(LiveAction(next(_ids), Call(command="true", trajectory=1, image=image)), place)
        finally:
            await mgr.close()

    return asyncio.run(main())


def test_a_malicious_image_through_the_cpu_manager(tmp_path: Path, outside: Path) -> None:
    from tangram.runtime.errors import ActionFailed
    cache = tmp_path / "cache"
    n = work_root_length(cache)
    write = path_max_chain(n, (entry("escape" + str(outside / "pwned")), b"root was here\n"))
    whiteout = path_max_chain(n, (entry(f"escape{outside}/.wh.precious"), b""))
    image = oci_layout(tmp_path / "e2e", [write, whiteout])
    with pytest.raises(ActionFailed) as e:
        end_to_end(cache, str(image))
    assert e.value.error_type == "ImageError" and "File name too long" in str(e.value)
    assert not (outside / "pwned").exists()
    untouched(outside)


def test_the_hosts_root_through_the_cpu_manager(tmp_path: Path) -> None:
    from tangram.runtime.errors import ActionFailed
    with pytest.raises(ActionFailed) as e:
        end_to_end(tmp_path / "cache", "/")
    assert e.value.error_type == "ImageError" and "the host's root" in str(e.value)


def test_an_idmap_failure_through_the_cpu_manager_fails_the_action(tmp_path: Path) -> None:
    """The root is mounted as the sandbox starts: its ImageError ends the action as
    ActionFailed(error_type="ImageError"), as every other image error does."""
    from tangram.runtime.errors import ActionFailed
    image = tmp_path / "root"
    (image / "bin").mkdir(parents=True)
    (image / "proc").mkdir()
    if os.geteuid() != 0:
        pytest.skip("an idmapped mount needs root")
    subprocess.run(["mount", "-t", "proc", "proc", str(image / "proc")], check=True)
    try:
        with pytest.raises(ActionFailed) as e:
            end_to_end(tmp_path / "cache", str(image))
        assert e.value.error_type == "ImageError" and "cannot idmap" in str(e.value)
    finally:
        subprocess.run(["umount", str(image / "proc")], check=True)


def test_a_deep_tree_through_the_cpu_manager(tmp_path: Path) -> None:
    """The action fails with ImageError (not a RecursionError), each try, and no work
    directory stays in the cache."""
    from tangram.runtime.errors import ActionFailed
    cache = tmp_path / "cache"
    image = oci_layout(tmp_path / "deep", [deep_layer((entry("../escape"), b"x"))])
    for _ in range(2):
        with pytest.raises(ActionFailed) as e:
            end_to_end(cache, str(image))
        assert e.value.error_type == "ImageError" and "outside the root" in str(e.value)
        assert list(cache.iterdir()) == []
