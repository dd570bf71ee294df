"""Task images unpacked into the cache (tangram.runtime.sandbox.images): OCI layouts and docker/podman
save archives built here, offline, from two layers with whiteouts; root directories used in
place; bad images refused with an ImageError naming the cause."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from tangram.runtime.sandbox.images import ImageCache, ImageError


def layer(files: dict[str, bytes | None], dirs: tuple[str, ...] = (), links: dict[str, str] | None = None) -> bytes:
    """A layer tar: files (None: a whiteout entry's empty file), directories, symlinks."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data or b""), 0o4755 if name.endswith("suid") else 0o644
            tar.addfile(info, io.BytesIO(data or b""))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return out.getvalue()


LOWER = layer({"etc/a": b"a", "etc/b": b"b", "data/x": b"x", "data/y": b"y", "bin/tool-suid": b"#!"},
              dirs=("etc", "data", "bin"), links={"bin/sh": "/bin/busybox"})
UPPER = layer({"etc/.wh.a": None, "data/.wh..wh..opq": None, "data/z": b"z", "etc/b": b"b2"})


def oci_layout(path: Path, layers: list[bytes], tag: str = "latest") -> Path:
    blobs = path / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def blob(data: bytes) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    config = blob(json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers"}}).encode())
    manifest = {"schemaVersion": 2, "config": {**config, "mediaType": "application/vnd.oci.image.config.v1+json"},
                "layers": [{**blob(gzip.compress(data)), "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip"}
                           for data in layers]}
    entry = blob(json.dumps(manifest).encode())
    (path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (path / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {**entry, "mediaType": "application/vnd.oci.image.manifest.v1+json",
         "annotations": {"org.opencontainers.image.ref.name": tag}}]}))
    return path


def save_archive(path: Path, layers: list[bytes], repo_tag: str = "task:1") -> Path:
    with tarfile.open(path, "w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        names = []
        for i, data in enumerate(layers):
            names.append(f"{i}/layer.tar")
            add(names[-1], data)
        add("config.json", b"{}")
        add("manifest.json", json.dumps([{"Config": "config.json", "RepoTags": [repo_tag], "Layers": names}]).encode())
    return path


def check_rootfs(root: str) -> None:
    r = Path(root)
    assert not (r / "etc" / "a").exists()  # whited out by the upper layer
    assert (r / "etc" / "b").read_bytes() == b"b2"  # replaced
    assert sorted(p.name for p in (r / "data").iterdir()) == ["z"]  # the opaque directory
    assert os.readlink(r / "bin" / "sh") == "/bin/busybox"  # an absolute link, kept for inside the sandbox
    assert not (r / "bin" / "tool-suid").stat().st_mode & 0o6000  # no setuid from an image


def test_an_oci_layout_is_unpacked_once_with_its_whiteouts(tmp_path: Path) -> None:
    cache = ImageCache(str(tmp_path / "cache"))
    image = oci_layout(tmp_path / "oci", [LOWER, UPPER])
    root = cache.rootfs(str(image))
    check_rootfs(root)
    marker = Path(root) / "unpacked-once"
    marker.write_text("")
    assert cache.rootfs(f"{image}:latest") == root and marker.exists()  # the cache, not a second unpack
    assert ImageCache(str(tmp_path / "cache")).rootfs(str(image)) == root  # shared by another manager
    with pytest.raises(ImageError, match="0 manifests match"):
        cache.rootfs(f"{image}:other")


def test_a_save_archive_is_unpacked_with_its_whiteouts(tmp_path: Path) -> None:
    cache = ImageCache(str(tmp_path / "cache"))
    archive = save_archive(tmp_path / "image.tar", [LOWER, UPPER])
    root = cache.rootfs(str(archive))
    check_rootfs(root)
    assert cache.rootfs(f"{archive}:task:1") == root
    with pytest.raises(ImageError, match="0 images match"):
        cache.rootfs(f"{archive}:task:2")


def test_a_root_directory_is_used_in_place(tmp_path: Path) -> None:
    (tmp_path / "root" / "bin").mkdir(parents=True)
    assert ImageCache(str(tmp_path / "cache")).rootfs(str(tmp_path / "root")) == str((tmp_path / "root").resolve())


def test_bad_images_are_image_errors_naming_the_cause(tmp_path: Path) -> None:
    cache = ImageCache(str(tmp_path / "cache"))
    with pytest.raises(ImageError, match="no such file"):
        cache.rootfs(str(tmp_path / "missing.tar"))
    (tmp_path / "garbage.tar").write_bytes(b"not a tar at all" * 100)
    with pytest.raises(ImageError, match="not a docker/podman save archive"):
        cache.rootfs(str(tmp_path / "garbage.tar"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImageError, match="neither an OCI layout"):
        cache.rootfs(str(tmp_path / "empty"))
    layout = oci_layout(tmp_path / "oci", [LOWER])
    index = json.loads((layout / "index.json").read_text())
    blobs = layout / "blobs" / "sha256"
    manifest = json.loads((blobs / index["manifests"][0]["digest"].split(":")[1]).read_text())
    blob = blobs / manifest["layers"][0]["digest"].split(":")[1]
    blob.write_bytes(blob.read_bytes()[:100])  # the layer, truncated
    with pytest.raises(ImageError, match="corrupt layer"):
        cache.rootfs(str(layout))
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []  # nothing half-unpacked is left
    escaping = save_archive(tmp_path / "escape.tar", [layer({"../../outside": b"x"})])
    with pytest.raises(ImageError, match="outside the root"):
        cache.rootfs(str(escaping))
    through_link = save_archive(tmp_path / "link.tar", [layer({}, links={"etc": str(tmp_path)}),
                                                        layer({"etc/planted": b"x"})])
    with pytest.raises(ImageError):
        cache.rootfs(str(through_link))
    assert not (tmp_path / "planted").exists()
    if shutil.which("podman") is None:
        with pytest.raises(ImageError, match="podman is not installed"):
            cache.rootfs("podman:nothing")
