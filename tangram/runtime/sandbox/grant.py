"""How a running action hears its CPU grant: a live grant file and a GNU make jobserver.

Each sandbox has two files beside its directory, made once with the sandbox:

  t<trajectory>.grant      the current grant in cores, one fixed-width line ("    1.2500\n"),
                           rewritten in place at each start and resize (a reader never sees
                           a half-written number: one pwrite of 16 bytes). Read it with
                           `tangram.worker.grant()`; its path is TANGRAM_GRANT_FILE.
  t<trajectory>.jobserver  a FIFO holding the jobserver's tokens: ceil(grant) - 1 of them
                           while an action runs (every client of a jobserver owns one
                           implicit token). Commands get MAKEFLAGS pointing at it, so `make`,
                           `ninja` and `cargo` run as many jobs as the grant allows, and more
                           or fewer as it changes. Its path is TANGRAM_JOBSERVER ("fifo:PATH").
  t<trajectory>.limit      a FIFO the other way: the action writes "<action id> <cores>\n"
                           (TANGRAM_ACTION is its id) when it can use at most that many cores
                           from now on, or more again (`tangram.worker.limit_grant`; a
                           GrantedExecutor does it as its tasks run out). The manager reads
                           it on the event loop and tells the orchestrator, which bounds the
                           grant. Its path is TANGRAM_LIMIT.

A grow writes tokens at once. A shrink reads back the tokens that are free now and collects
the rest as the jobs holding them return them (a reader on the event loop), so a build
never has a job killed: it just starts fewer.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Callable

from ...worker import whole_cores

GRANT_WIDTH = 16
# What one turn of the event loop reads of a sandbox's FIFOs. The sandbox writes them, so a
# loop "until empty" is one the sandbox can keep from ending (by writing as fast as it is
# read) while every other action's timeout waits behind it.
LIMIT_READ_BYTES = 64 << 10
DRAIN_ALL_BYTES = 1 << 20  # the most a pipe holds (fs.pipe-max-size's default)
LIMIT_FLOOD_PAUSE = 0.05  # seconds the limit FIFO is left unread after a full turn


class GrantChannel:
    """The grant file and jobserver FIFO of one sandbox, written by the CPU manager."""

    def __init__(self, base: str, on_limit: Callable[[int, float], None] | None = None, *,
                 owner: int | None = None, inside: str | None = None, shared: bool = False) -> None:
        """`on_limit(action, cores)`: called on the event loop for each limit the running
        action (the one `start` named) writes about itself (None: the limit FIFO is still
        made, and what is written is dropped); a line naming any other action is dropped,
        so a sandbox cannot limit another's grant.
        `owner`: the uid (and gid) of a namespaced sandbox, given the FIFOs; `inside`: the
        base the sandbox sees them at (default `base`); `shared`: the FIFOs are everyone's
        (a container's, whose user is the image's: its directory is bound in that
        container only)."""
        self.grant_path = base + ".grant"
        self.fifo_path = base + ".jobserver"
        self.limit_path = base + ".limit"
        self.inside = base if inside is None else inside
        self._grant_fd = os.open(self.grant_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self._fifo = self._limit_fd = -1
        try:
            os.mkfifo(self.fifo_path, 0o600)
            # O_RDWR: never blocks and never sees EOF, whoever else has it open
            self._fifo = os.open(self.fifo_path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
            os.mkfifo(self.limit_path, 0o600)
            self._limit_fd = os.open(self.limit_path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
            if owner is not None:
                os.chown(self.fifo_path, owner, owner)
                os.chown(self.limit_path, owner, owner)
            if shared:
                os.chmod(self.fifo_path, 0o666)
                os.chmod(self.limit_path, 0o666)
        except BaseException:
            for fd in (self._grant_fd, self._fifo, self._limit_fd):
                if fd >= 0:
                    os.close(fd)
            raise
        self._on_limit = on_limit
        self._limit_loop: asyncio.AbstractEventLoop | None = None
        self._partial = b""  # a line the action has not finished writing
        self._action: int | None = None  # the running action, whose limits are heard
        if on_limit is not None:
            self._limit_loop = asyncio.get_running_loop()
            self._limit_loop.add_reader(self._limit_fd, self._read_limits)
        self._tokens = 0  # tokens this action should have outstanding (ceil(grant) - 1)
        self._owed = 0  # tokens to take back as jobs return them
        self._loop: asyncio.AbstractEventLoop | None = None
        self.write_grant(0.0)

    @staticmethod
    def env_for(base: str) -> dict[str, str]:
        """The variables that name the channel's files at `base` (as the sandbox sees them)."""
        return {"TANGRAM_GRANT_FILE": base + ".grant", "TANGRAM_JOBSERVER": "fifo:" + base + ".jobserver",
                "TANGRAM_LIMIT": base + ".limit"}

    @property
    def env(self) -> dict[str, str]:
        return self.env_for(self.inside)

    @property
    def paths(self) -> tuple[str, ...]:
        return self.grant_path, self.fifo_path, self.limit_path

    def write_grant(self, cores: float) -> None:
        os.pwrite(self._grant_fd, f"{cores:{GRANT_WIDTH - 1}.4f}\n".encode(), 0)

    @property
    def closed(self) -> bool:
        return self._fifo < 0

    def start(self, cores: float, action: int | None = None) -> None:
        """A new action (`action`, whose limits are heard from now on): the grant file says
        `cores`, the FIFO holds exactly its tokens (whatever an earlier action left is
        drained)."""
        if self.closed:
            return
        self._action = action
        self._stop_collecting()
        self._drain(-1)
        self._owed = 0
        self._tokens = whole_cores(cores) - 1
        self._put(self._tokens)
        self.write_grant(cores)

    def resize(self, cores: float) -> None:
        """The running action's grant changed: the file and the tokens follow."""
        if self.closed:
            return
        self.write_grant(cores)
        target = whole_cores(cores) - 1
        delta = target - self._tokens
        self._tokens = target
        if delta > 0:
            returned = min(delta, self._owed)  # tokens still owed cancel out first
            self._owed -= returned
            self._put(delta - returned)
        elif delta < 0:
            self._owed += -delta
            self._collect()
        if self._owed == 0:
            self._stop_collecting()

    def stop(self) -> None:
        """The action ended: no tokens, a grant of 0. Nothing once closed (the trajectory
        ended while its action was being torn down)."""
        if self.closed:
            return
        self._action = None
        self._stop_collecting()
        self._drain(-1)
        self._owed = self._tokens = 0
        self.write_grant(0.0)

    def close(self) -> None:
        if self.closed:
            return
        self._stop_collecting()
        if self._limit_loop is not None:
            self._limit_loop.remove_reader(self._limit_fd)
            self._limit_loop = None
        for fd in (self._fifo, self._grant_fd, self._limit_fd):
            os.close(fd)
        self._fifo = self._grant_fd = self._limit_fd = -1

    # ------------------------------------------------------------------ limits
    def _read_limits(self) -> None:
        data = self._partial
        while len(data) < LIMIT_READ_BYTES:
            try:
                chunk = os.read(self._limit_fd, 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
        else:  # a full turn's worth: more than any action says; read on after a pause
            self._pause_limits()
        *lines, self._partial = data.split(b"\n")
        if len(self._partial) > 64:  # no line is that long: not ours, drop it
            self._partial = b""
        latest: dict[int, float] = {}
        for line in lines:  # the last word of each action counts; a garbled line is dropped
            try:
                action, text = line.split()
                action_id, cores = int(action), float(text)
            except ValueError:
                continue
            if math.isfinite(cores) and cores > 0 and action_id == self._action:  # "nan", "inf", "0" are garbled too
                latest[action_id] = cores
        for action, cores in latest.items():
            self._on_limit(action, cores)  # type: ignore[misc]

    def _pause_limits(self) -> None:
        loop = self._limit_loop
        if loop is None:
            return
        loop.remove_reader(self._limit_fd)

        def resume() -> None:
            if self._limit_loop is loop and not self.closed:
                loop.add_reader(self._limit_fd, self._read_limits)

        loop.call_later(LIMIT_FLOOD_PAUSE, resume)

    # ------------------------------------------------------------------ tokens
    def _put(self, n: int) -> None:
        if n > 0:
            try:
                os.write(self._fifo, b"+" * n)  # far below the pipe's default capacity
            except BlockingIOError:  # full: a process of the sandbox shrank it (F_SETPIPE_SZ) and filled it
                pass  # with tokens of its own; it only ever lends its own sandbox more jobs

    def _drain(self, limit: int) -> int:
        """Reads up to `limit` tokens (-1: all, up to what a pipe holds) that are free now;
        returns how many."""
        got = 0
        limit = DRAIN_ALL_BYTES if limit < 0 else limit
        while got < limit:
            try:
                data = os.read(self._fifo, min(4096, limit - got))
            except BlockingIOError:
                break
            if not data:
                break
            got += len(data)
        return got

    def _collect(self) -> None:
        self._owed -= self._drain(self._owed)
        if self._owed > 0 and self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._fifo, self._collect_returned)

    def _collect_returned(self) -> None:
        self._owed -= self._drain(self._owed)
        if self._owed <= 0:
            self._stop_collecting()

    def _stop_collecting(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._fifo)
            self._loop = None


__all__ = ["GrantChannel", "whole_cores"]
