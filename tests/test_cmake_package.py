"""The C++ core as a CMake package: `cmake --install` puts the static library, the public
headers and tangram_coreConfig.cmake under a prefix, and a separate project
(examples/consumer) finds it with find_package(tangram_core CONFIG), links tangram::core
and runs examples/burst.cc. Also: a plain configure succeeds without GoogleTest.

Everything is built in tmp_path (Release, Ninja when present, -j2): about 15 s on two
cores, most of it compiling the core once. Skipped where cmake or a C++ compiler is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONSUMER = ROOT / "examples" / "consumer"


def _cxx_compiler() -> str | None:
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return next((found for name in candidates if (found := shutil.which(name))), None)


pytestmark = [
    pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not on PATH"),
    pytest.mark.skipif(_cxx_compiler() is None, reason="no C++ compiler on PATH (CXX, c++, g++ or clang++)"),
]

GENERATOR = ["-G", "Ninja"] if shutil.which("ninja") else []


def _version() -> str:
    # The one place the version is written; CMake reads the same line.
    match = re.search(r'^__version__ = "([^"]+)"', (ROOT / "tangram" / "__init__.py").read_text(), re.MULTILINE)
    assert match, "tangram/__init__.py has no __version__ line"
    return match.group(1)


def _cmake(*args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["cmake", *map(str, args)], capture_output=True, text=True, timeout=600)
    if check and done.returncode != 0:
        pytest.fail(f"cmake {' '.join(map(str, args))} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done


def _unwrapped(message: str) -> str:
    # CMake wraps message() text at about 80 columns.
    return " ".join(message.split())


def _configure_core(build: Path, *options: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _cmake("-S", ROOT, "-B", build, *GENERATOR, *options, check=check)


def test_the_installed_package_builds_and_runs_a_consumer(tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    _configure_core(tmp_path / "core", "-DCMAKE_BUILD_TYPE=Release",
                    "-DTANGRAM_BUILD_TESTS=OFF", "-DTANGRAM_BUILD_EXAMPLES=OFF")
    _cmake("--build", tmp_path / "core", "-j2")
    _cmake("--install", tmp_path / "core", "--prefix", prefix)

    # The public headers only: the core's private headers (bin_tree.h, quota.h...) stay out.
    assert sorted(p.name for p in (prefix / "include" / "tangram").iterdir()) == ["model.h", "policy.h", "scheduler.h", "types.h"]
    package_dirs = list(prefix.glob("lib*/cmake/tangram_core"))
    assert len(package_dirs) == 1, f"expected one <prefix>/lib*/cmake/tangram_core, found {package_dirs}"
    package_files = {p.name for p in package_dirs[0].iterdir()}
    assert {"tangram_coreConfig.cmake", "tangram_coreConfigVersion.cmake", "tangram_coreTargets.cmake"} <= package_files
    assert list(prefix.glob("lib*/libtangram_core.a")), "the static library was not installed"

    # The consumer compiles examples/burst.cc; its include path is the prefix's, not csrc/.
    consumer = tmp_path / "consumer"
    configured = _cmake("-S", CONSUMER, "-B", consumer, *GENERATOR, "-DCMAKE_BUILD_TYPE=Release",
                        f"-DCMAKE_PREFIX_PATH={prefix}")
    assert f"tangram_core {_version()} from {package_dirs[0]}" in configured.stdout
    _cmake("--build", consumer, "-j2")
    ran = subprocess.run([consumer / "burst"], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "OK: all 200 actions ended" in ran.stdout

    # The version file: this major.minor is accepted, any other minor is not (before 1.0 a
    # minor release may change the API).
    major, minor = (int(part) for part in _version().split(".")[:2])
    asked = [(f"{major}.{minor}", True), (f"{major}.{minor + 1}", False)]
    if minor > 0:
        asked.append((f"{major}.{minor - 1}", False))
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.20)\nproject(probe LANGUAGES NONE)\n"
        "find_package(tangram_core ${WANTED} CONFIG REQUIRED)\n")
    for wanted, accepted in asked:
        done = _cmake("-S", probe, "-B", tmp_path / f"probe-{wanted}", f"-DWANTED={wanted}",
                      f"-DCMAKE_PREFIX_PATH={prefix}", check=False)
        assert (done.returncode == 0) == accepted, f"asking for {wanted}:\n{done.stdout}\n{done.stderr}"


def test_a_plain_configure_needs_no_googletest(tmp_path: Path) -> None:
    # The default (AUTO) warns and skips the C++ unit tests when GoogleTest is missing.
    done = _configure_core(tmp_path / "auto", "-DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON")
    assert "GoogleTest not found, so the C++ unit tests are not built" in _unwrapped(done.stderr)

    # Asked for explicitly, the tests need GoogleTest: configuring fails and says why.
    refused = _configure_core(tmp_path / "on", "-DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON", "-DTANGRAM_BUILD_TESTS=ON",
                              check=False)
    assert refused.returncode != 0
    assert "TANGRAM_BUILD_TESTS=ON needs GoogleTest, which was not found" in _unwrapped(refused.stderr)
