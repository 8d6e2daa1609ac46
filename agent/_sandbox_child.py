"""The child side of agent/sandbox.py: limit itself, then run a job.

Run as `python -I -S _sandbox_child.py` with {"config", "job"} JSON on stdin (see
sandbox_process.py). `-I` keeps this file's folder off sys.path (so `import math` is the
stdlib's). Results go to an inherited pipe as lines "TOKEN {json}", the last a "done" line.
Jobs ("mode"):
    tests   run the solution `code`, then each top-level assert of `tests`: one line per test
    call    call the function `ref` ('module:function' or '/abs/FILE.py:function') with the
            keyword `arguments`: its return value as text, or the error it raised
The limits and their honesty notes are described in sandbox.py.
"""

import ast
import builtins
import importlib
import importlib.util
import json
import os
import resource
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000

_PROCESS_EVENTS = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                   "subprocess.Popen", "os.kill", "os.killpg", "pty.spawn"}
_NETWORK_EVENTS = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
                   "socket.gethostbyname", "socket.gethostbyaddr", "socket.sendto"}
_NATIVE_EVENTS = {"ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function",
                  "ctypes.addressof"}
# Ways to the harness's objects (the result token) that solutions have no need for.
_INTROSPECTION_EVENTS = {"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames"}
# Modules that start processes without an audit event (subprocess's own fork_exec).
_PROCESS_MODULES = {"_posixsubprocess"}
# event -> positions of path arguments that are written to
_PATH_EVENTS = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1),
                "os.link": (1,), "os.symlink": (1,), "os.chmod": (0,), "os.chown": (0,),
                "os.truncate": (0,), "os.utime": (0,), "shutil.rmtree": (0,), "shutil.copyfile": (1,),
                "shutil.copytree": (1,), "shutil.chown": (0,), "os.chflags": (0,), "os.lchown": (0,)}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _isolate_network() -> bool:
    """Enter a fresh network namespace (only a downed loopback): nothing is reachable."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        for flags in (CLONE_NEWNET, CLONE_NEWUSER | CLONE_NEWNET):
            if libc.unshare(flags) == 0:
                return True
    except Exception:
        pass
    return False


def _process_memory(path) -> bool:
    """/proc/<pid>/mem and the like: the harness's memory, token included."""
    parts = path.split("/")
    return path.startswith("/proc/") and len(parts) > 3 and parts[3] in ("mem", "pagemap", "map_files")


def _install_hook(workdir: str, allow_subprocess: bool) -> None:
    realpath, join, getcwd = os.path.realpath, os.path.join, os.getcwd
    busy = [False]

    def outside(path) -> bool:
        if isinstance(path, int):  # an fd the process already holds
            return False
        if not isinstance(path, (str, bytes)):
            try:
                path = os.fspath(path)
            except TypeError:
                return True
        if isinstance(path, bytes):
            path = path.decode(errors="replace")
        full = realpath(join(getcwd(), path))
        return not (full == workdir or full.startswith(workdir + os.sep) or full == "/dev/null")

    def hook(event, args):
        if busy[0]:
            return
        if event in _NETWORK_EVENTS:
            raise PermissionError(f"sandbox: network access refused ({event})")
        if event in _NATIVE_EVENTS:
            raise PermissionError(f"sandbox: native calls refused ({event})")
        if event in _INTROSPECTION_EVENTS:
            raise PermissionError(f"sandbox: introspecting the harness refused ({event})")
        if event in _PROCESS_EVENTS and not allow_subprocess:
            raise PermissionError(f"sandbox: new processes refused ({event})")
        if event == "import" and args[0] in _PROCESS_MODULES and not allow_subprocess:
            raise PermissionError(f"sandbox: new processes refused (import {args[0]})")
        if event == "open":
            path, mode, flags = args
            if isinstance(path, (str, bytes)):
                busy[0] = True
                try:
                    memory = _process_memory(realpath(join(getcwd(), os.fsdecode(path))))
                finally:
                    busy[0] = False
                if memory:
                    raise PermissionError(f"sandbox: reading process memory refused ({path!r})")
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                     (mode is None and isinstance(flags, int) and flags & _WRITE_FLAGS)
            if writes:
                busy[0] = True
                try:
                    bad = outside(path)
                finally:
                    busy[0] = False
                if bad:
                    raise PermissionError(f"sandbox: writing outside the working directory refused ({path!r})")
        elif event in _PATH_EVENTS:
            busy[0] = True
            try:
                bad = any(i < len(args) and outside(args[i]) for i in _PATH_EVENTS[event])
            finally:
                busy[0] = False
            if bad:
                raise PermissionError(f"sandbox: {event} outside the working directory refused")

    sys.addaudithook(hook)


def _load_function(ref: str, paths: list[str]):
    """The function `ref` names. A FILE.py's folder joins the end of sys.path (its siblings
    import; the stdlib is not shadowed)."""
    where, _, name = ref.rpartition(":")
    sys.path.extend(p for p in paths if p not in sys.path)
    if where.endswith(".py"):
        sys.path.append(os.path.dirname(where))
        spec = importlib.util.spec_from_file_location("_opd_tool", where)
        module = importlib.util.module_from_spec(spec)
        sys.modules["_opd_tool"] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def _as_text(value) -> str:
    """A return value as the model reads it: str as is, None as nothing, else JSON (or repr)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


def _error(e: BaseException, memory_mb: int) -> str:
    if isinstance(e, MemoryError):
        return f"MemoryError: out of memory (the limit is {memory_mb} MiB)"
    return f"{type(e).__name__}: {e}"[:500]


def _call(job, cfg, function, emit) -> None:
    try:
        text = _as_text(function(**job["arguments"]))
    except BaseException as e:  # noqa: BLE001 - whatever the tool does wrong is its answer
        sys.stdout.flush()
        emit({"kind": "done", "ok": False, "error": _error(e, cfg["memory_mb"])})
        return
    try:
        sys.stdout.flush()      # its printed output comes before the value (the parent reads the file)
    except OSError:             # past RLIMIT_FSIZE: what fit is kept
        pass
    # The parent reads a few hundred KB at most: send a head of the value and its full length.
    limit = job["max_chars"]
    emit({"kind": "done", "ok": True, "text": text[:limit], "length": len(text)})


def _tests(job, cfg, emit, netns: bool) -> None:
    # each top-level assert is one test, other statements are setup
    try:
        statements = ast.parse(job["tests"]).body
    except SyntaxError as e:
        emit({"kind": "done", "total": 0, "error": f"tests do not parse: {e}", "netns": netns})
        return
    total = sum(isinstance(s, ast.Assert) for s in statements)
    compiled = [(isinstance(s, ast.Assert), compile(ast.Module(body=[s], type_ignores=[]), "tests.py", "exec"))
                for s in statements]

    # from here on the audit hook guards network, processes, native calls and writes
    _install_hook(cfg["workdir"], cfg["allow_subprocess"])
    ns = {"__name__": "__solution__", "__builtins__": builtins}
    try:
        exec(compile(job["code"], "solution.py", "exec"), ns)
    except BaseException as e:  # noqa: BLE001 - anything the solution does wrong scores 0
        emit({"kind": "done", "total": total, "error": f"solution raised {type(e).__name__}: {e}"[:300],
              "netns": netns})
        return
    index = 0
    for is_test, code in compiled:
        try:
            exec(code, ns)
            ok, err = True, ""
        except BaseException as e:  # noqa: BLE001
            ok, err = False, f"{type(e).__name__}: {e}"[:300]
        if is_test:
            emit({"kind": "test", "index": index, "ok": ok, "error": err})
            index += 1
    emit({"kind": "done", "total": total, "netns": netns})


def main() -> None:
    payload = json.loads(sys.stdin.read())
    cfg, job = payload["config"], payload["job"]
    sys.path.extend(cfg.get("site_packages", []))  # started with -S: libraries without .pth hooks
    fd, token = cfg["result_fd"], cfg["token"]
    cfg["workdir"] = os.path.realpath(cfg["workdir"])

    def emit(obj) -> None:
        os.write(fd, (token + " " + json.dumps(obj) + "\n").encode())

    # 1. isolate (namespaces need root, so before dropping privileges)
    netns = _isolate_network()
    function = None
    if job["mode"] == "call":
        # The tool's module is the operator's code, like the parent's: it loads before the
        # limits (as root it can still read files `nobody` cannot) and before the audit hook
        # (libraries may use ctypes at import). Only the call itself runs limited.
        try:
            function = _load_function(job["ref"], job.get("sys_path", []))
        except BaseException as e:  # noqa: BLE001
            emit({"kind": "done", "ok": False, "error": f"cannot load {job['ref']}: {type(e).__name__}: {e}"[:500]})
            return
    # 2. limit
    if cfg["drop_to_nobody"]:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    mb = 1 << 20
    for res, value in ((resource.RLIMIT_AS, cfg["memory_mb"] * mb), (resource.RLIMIT_FSIZE, cfg["max_file_mb"] * mb),
                       (resource.RLIMIT_NPROC, cfg["max_processes"]), (resource.RLIMIT_CPU, cfg["cpu_s"]),
                       (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))
    os.chdir(cfg["workdir"])

    # 3. run the job
    if job["mode"] == "call":
        _install_hook(cfg["workdir"], cfg["allow_subprocess"])
        _call(job, cfg, function, emit)
    else:
        _tests(job, cfg, emit, netns)


if __name__ == "__main__":
    main()
