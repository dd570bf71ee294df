"""Running a program the way Sandbox Fusion's `POST /run_code` does, inside a sandbox.

A request is the Sandbox Fusion request (`RunCodeRequest`: code, language, stdin,
compile_timeout, run_timeout, memory_limit_MB, files, fetch_files); the result is its
response (`RunCodeResponse`: status, message, compile_result, run_result, executor_pod_name,
files), with the same status values:

    status              Success (every step finished with return code 0), Failed (a
                        non-zero return code or a time limit), SandboxError (the sandbox
                        could not run it: a missing compiler, a bad file path)
    compile_result,     per step: status Finished / TimeLimitExceeded / Error,
    run_result          execution_time (wall seconds), return_code, stdout, stderr
                        (compile_result is null for interpreted languages; run_result is
                        null when compiling failed)

`check_request` validates a request as the endpoint receives it (a ValidationError naming
the field); `run_code_call` makes it one tangram action (a Call whose function runs in the
trajectory's sandbox); `run_code` is that function. It writes `files` (base64) into a
working directory, writes the code to a file, compiles it when the language has a compile
step, runs it with `stdin`, and reads back `fetch_files`:

- in a fresh directory inside the sandbox, removed afterwards (`keep_files=False`: a
  request of its own), or in the sandbox's own directory (`keep_files=True`: a session,
  whose requests see each other's files); `scrub=True` (a sandbox pooled between requests
  without a session) then also kills every process the request left, those that
  detached themselves too, and empties the sandbox's directory;
- each step in a process group of its own, killed at its timeout (partial output kept);
- stdout and stderr through files, not pipes, and at most OUTPUT_LIMIT bytes of each read
  back (as Sandbox Fusion: 1 MiB), decoded as UTF-8 with invalid bytes replaced;
- memory_limit_MB > 0: RLIMIT_AS of that many MiB on each step's process (as Sandbox
  Fusion), and the action's memory demand, so the core places it where that fits.

Languages: LANGUAGES (in tangram.runtime.sandbox.inside_run_code, the part that runs in the sandbox), each with the file its code goes to, its compile step (if
any) and its run step; a language Sandbox Fusion knows but this table does not, or whose
compiler or interpreter is not on the machine, is a SandboxError naming it.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any, Callable, Mapping

from ..._errors import ValidationError
from ..._model import given
from .inside_run_code import LANGUAGES, OUTPUT_LIMIT, run_code, run_code_timed, sandbox_error
from ..call import Call
from ..errors import ActionCancelled, ActionTimeout, ResourceLimitExceeded

__all__ = ["LANGUAGES", "OUTPUT_LIMIT", "SANDBOX_FUSION_LANGUAGES", "TrajectoryPool", "check_request", "error_answer",
           "run_code", "run_code_call", "run_code_timed", "sandbox_error"]

# Every language name Sandbox Fusion's server accepts (its `Language` literal); others are
# a validation error, as there (HTTP 422).
SANDBOX_FUSION_LANGUAGES = (
    "python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql", "rust", "cuda",
    "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit", "kotlin_script", "jest", "verilog",
    "python_gpu", "lean", "swift", "racket")

DEFAULT_COMPILE_TIMEOUT = 10.0  # Sandbox Fusion's defaults, seconds
DEFAULT_RUN_TIMEOUT = 10.0
MAX_TIMEOUT = 86400.0
# The action's own timeout is the request's two timeouts plus this: the steps' timeouts
# are enforced inside, so the action's only catches a sandbox that stopped answering.
ACTION_TIMEOUT_SLACK = 10.0


def check_request(request: Any) -> dict[str, Any]:
    """A Sandbox Fusion request (a JSON object) made whole: defaults filled in, every field
    checked (ValidationError naming it, as `request.FIELD`). Fields it does not know are
    ignored, as Sandbox Fusion's server ignores them."""
    if not isinstance(request, Mapping):
        raise ValidationError("request", f"must be a JSON object, got {given(request)}")
    code = request.get("code")
    if not isinstance(code, str):
        raise ValidationError("request.code", f"is required, a string; got {given(code)}")
    language = request.get("language")
    if language not in SANDBOX_FUSION_LANGUAGES:
        raise ValidationError("request.language", f"must be one of Sandbox Fusion's languages "
                                                  f"({', '.join(SANDBOX_FUSION_LANGUAGES)}); got {given(language)}")
    out: dict[str, Any] = {"code": code, "language": language}
    for name, default in (("compile_timeout", DEFAULT_COMPILE_TIMEOUT), ("run_timeout", DEFAULT_RUN_TIMEOUT)):
        value = request.get(name, default)
        if value is None:
            value = default
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and 0 < value <= MAX_TIMEOUT):
            raise ValidationError(f"request.{name}", f"must be a number of seconds in (0, {MAX_TIMEOUT:g}], "
                                                     f"got {given(value)}")
        out[name] = float(value)
    memory = sent = request.get("memory_limit_MB", -1)
    if memory is None:
        memory = -1
    if isinstance(memory, float) and memory.is_integer():
        memory = int(memory)
    if not isinstance(memory, int) or isinstance(memory, bool) or not (memory == -1 or 0 < memory <= 1 << 30):
        raise ValidationError("request.memory_limit_MB", f"must be -1 (no limit) or a number of MiB in "
                                                         f"[1, {1 << 30}], got {given(sent)}")
    out["memory_limit_MB"] = memory
    stdin = request.get("stdin")
    if stdin is not None and not isinstance(stdin, str):
        raise ValidationError("request.stdin", f"must be a string or null, got {given(stdin)}")
    _check_text("request.code", code)
    if stdin is not None:
        _check_text("request.stdin", stdin)
    out["stdin"] = stdin
    files = request.get("files")
    if files is None:  # null or left out: no files (false, "", [] are not "none": they are refused)
        files = {}
    if not isinstance(files, Mapping):
        raise ValidationError("request.files", f"must be an object of path -> base64 content (or null), "
                                               f"got {given(files)}")
    checked: dict[str, bytes] = {}
    named: list[tuple[str, tuple[str, ...]]] = []  # each path, and the parts it names
    for path, content in files.items():
        if content is None:  # skipped, as Sandbox Fusion does
            continue
        field = f"request.files[{path!r}]"
        named.append((path, _check_path(field, path)))
        if not isinstance(content, str):
            raise ValidationError(field, f"must be base64 text or null, got {given(content)}")
        try:
            checked[path] = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValidationError(field, f"is not base64: {e}") from None
    _check_distinct(named, LANGUAGES[language][0] if language in LANGUAGES else None)
    out["files"] = checked
    fetch = request.get("fetch_files")
    if fetch is None:  # null or left out: nothing to fetch (0, "", false are refused)
        fetch = []
    if not isinstance(fetch, list):
        raise ValidationError("request.fetch_files", f"must be a list of paths (or null), got {given(fetch)}")
    for i, path in enumerate(fetch):
        _check_path(f"request.fetch_files[{i}]", path)
    out["fetch_files"] = list(fetch)
    return out


# What a path in `files` or `fetch_files` may be: the limits of Linux (NAME_MAX, PATH_MAX)
# and a depth the sandbox makes directories to without running out of stack.
MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 4095
MAX_PATH_DEPTH = 64


def _shown(path: str) -> str:
    """A path as a refusal shows it: its repr, cut short past 80 characters."""
    return repr(path) if len(path) <= 80 else f"{path[:60]!r}... ({len(path)} characters)"


def _check_text(field: str, text: str) -> None:
    """Text the sandbox writes as UTF-8: no lone surrogate (JSON's \\uXXXX escapes can
    carry one; no encoding can write it)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValidationError(field, f"is not valid Unicode text: a lone surrogate ({text[e.start]!r}) at "
                                     f"position {e.start}") from None


def _check_path(field: str, path: Any) -> tuple[str, ...]:
    """A file path inside the working directory: relative, without '..', naming a file
    (not a directory: not '.', not ending in '/'), within Linux's limits on names and
    paths and MAX_PATH_DEPTH directories deep. Its parts, without the empty and '.' ones."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValidationError(field, f"must be a non-empty path, got {given(path)}")
    _check_text(field, path)
    parts = path.replace("\\", "/").split("/")
    if path.startswith("/") or ".." in parts:
        raise ValidationError(field, f"must be a path inside the sandbox's working directory (relative, without "
                                     f"'..'), got {_shown(path)}")
    if parts[-1] in ("", "."):
        raise ValidationError(field, f"must name a file, got {_shown(path)}, which names a directory")
    named = tuple(part for part in parts if part not in ("", "."))
    if len(path.encode("utf-8")) > MAX_PATH_BYTES or len(named) > MAX_PATH_DEPTH:
        raise ValidationError(field, f"must be at most {MAX_PATH_BYTES} bytes long and {MAX_PATH_DEPTH} directories "
                                     f"deep, got {_shown(path)} ({len(path.encode('utf-8'))} bytes, {len(named) - 1} "
                                     f"directories deep)")
    for part in named:
        if len(part.encode("utf-8")) > MAX_NAME_BYTES:
            raise ValidationError(field, f"has a name over {MAX_NAME_BYTES} bytes ({_shown(part)}), in "
                                         f"{_shown(path)}")
    return named


def _check_distinct(paths: list[tuple[str, tuple[str, ...]]], source: str | None) -> None:
    """The paths of `files` (as given, and the parts each names, in the request's order)
    each name a file that no other one names, nor needs as a directory; nor do they need
    the code's own file (`source`) as one. The later path of a pair that conflicts is
    the one refused. (Sorted with the parts joined by NUL, which no path holds, a path
    is followed by those inside it: one pass over neighbours finds every conflict.)"""
    for path, parts in paths:
        if source is not None and len(parts) > 1 and parts[0] == source:
            raise ValidationError(f"request.files[{path!r}]", f"needs {source!r}, the file the code goes to, as a "
                                                             f"directory: got {_shown(path)}")
    keyed = sorted(("\0".join(parts), i) for i, (_, parts) in enumerate(paths))
    for (key, i), (following, j) in zip(keyed, keyed[1:]):
        if following == key or following.startswith(key + "\0"):
            first, later = sorted((i, j))
            path, other = paths[later][0], paths[first][0]
            if following == key:
                reason = f"names the same file as {_shown(other)}, also in `files`"
            elif later == i:
                reason = f"names a file where {_shown(other)}, also in `files`, needs a directory"
            else:
                reason = f"needs a directory where {_shown(other)}, also in `files`, is a file"
            raise ValidationError(f"request.files[{path!r}]", f"{reason}: got {_shown(path)}")


def run_code_call(request: Mapping[str, Any], trajectory: int = 0, keep_files: bool = False,
                  cpu: float = 1.0, kind: str = "code", pooled: bool = False, timed: bool = False) -> Call:
    """One checked request (`check_request`) as a tangram action in `trajectory`'s sandbox
    (`keep_files`: see run_code); `pooled`: in any idle pooled sandbox instead
    (Call.pooled), scrubbed after the request (run_code's `scrub`); `timed`: its result is
    run_code_timed's (the answer and the seconds running it took in the sandbox).
    Its run time is learned per language (key "code:LANGUAGE"); its timeout is the
    request's two timeouts plus ACTION_TIMEOUT_SLACK; memory_limit_MB > 0 is its memory
    demand."""
    resources: dict[str, float] = {"cpu": cpu}
    if request["memory_limit_MB"] > 0:
        resources["memory"] = float(request["memory_limit_MB"])
    timeout = request["compile_timeout"] + request["run_timeout"] + ACTION_TIMEOUT_SLACK
    return Call(fn=run_code_timed if timed else run_code, args=(request, keep_files, pooled), resources=resources,
                timeout=timeout, trajectory=trajectory, kind=kind, key=f"{kind}:{request['language']}", pooled=pooled)


def checked_answer(value: Any) -> dict[str, Any]:
    """What a run_code action returned, if it has a run_code answer's shape (a dict whose
    status and message are strings, compile_result and run_result None or dicts, files a
    dict of strings); else a SandboxError saying so. The answer comes from the sandbox:
    plain data, but of any shape code in the worker chose to send."""
    files = value.get("files", {}) if type(value) is dict else None
    if (type(value) is dict and type(value.get("status")) is str and type(value.get("message", "")) is str
            and all(value.get(k) is None or type(value.get(k)) is dict for k in ("compile_result", "run_result"))
            and type(files) is dict and all(type(k) is str and type(v) is str for k, v in files.items())):
        return value
    return sandbox_error(f"the sandbox's answer is malformed: a {type(value).__name__} that is not a run_code answer")


def checked_timed_answer(value: Any) -> tuple[dict[str, Any], float]:
    """checked_answer of run_code_timed's (answer, seconds)."""
    if type(value) is tuple and len(value) == 2 and type(value[1]) is float:
        return checked_answer(value[0]), value[1]
    return checked_answer(None), 0.0


def error_answer(error: BaseException) -> dict[str, Any]:
    """The Sandbox Fusion answer for an action that ended in `error` instead of answering:
    a program killed by its memory limit is a Failed run with return code -9 (as a killed
    process's); anything else (a crash, a timeout past the request's own, a cancel, a call
    tangram cannot place) is a SandboxError saying why."""
    if isinstance(error, ResourceLimitExceeded) and error.limit == "memory":
        return {"status": "Failed", "message": "", "compile_result": None,
                "run_result": {"status": "Finished", "execution_time": None, "return_code": -9, "stdout": "",
                               "stderr": f"memory limit exceeded: {error.reason}"},
                "executor_pod_name": None, "files": {}}
    if isinstance(error, ActionTimeout):
        return sandbox_error(f"the sandbox did not answer within the request's timeouts: {error}")
    if isinstance(error, ActionCancelled):
        return sandbox_error(f"cancelled: {error}")
    return sandbox_error(str(error))


class TrajectoryPool:
    """Trajectory ids for requests without a session, whose calls are pooled (Call.pooled:
    the CPU manager gives each a pooled sandbox as it starts, so the ids hold none): a
    request takes one (the last given back first, else a new one from `new_trajectory`)
    and gives it back once its action has ended. The ids are as many as requests were in
    flight at once; the core keeps a little state per trajectory, so they are reused, not
    made anew for every request."""

    def __init__(self, new_trajectory: Callable[[], int]) -> None:
        self._new = new_trajectory
        self._idle: list[int] = []

    def take(self) -> int:
        return self._idle.pop() if self._idle else self._new()

    def give_back(self, trajectory: int) -> None:
        self._idle.append(trajectory)

    def drain(self) -> list[int]:
        """Every id given back, for the caller to end; none is kept afterwards."""
        idle, self._idle = self._idle, []
        return idle
