"""The in-sandbox agent. NOT imported by the worker: its source is handed to the sandbox's
own interpreter (``python3 -S -c <source>``) and runs as the sandbox's first process.

It is what makes a warm sandbox cheap: the sandbox (namespaces, mounts, cgroup) and this
interpreter start once, then each action costs one ``fork`` (plus an ``exec`` for a
command). Under the bwrap backend the agent is PID 1 of the sandbox's pid namespace,
so code in the sandbox cannot kill it (init ignores signals it has no handler for), every
orphan is re-parented to it, and ``kill(-1, SIGKILL)`` reaches every process in the
sandbox but itself — the setsid and double-fork escapes included.

Protocol on fds 3 (requests) and 4 (replies), duplicated away from the children:
request  = u32 length + marshal(dict)      (from the trusted worker)
reply    = u32 length + u32 head length + head + stdout + stderr + data
head     = ASCII ``key=value`` pairs joined by ``;`` (parsed on the worker without eval)

A zygote (``MODE`` "zygote") serves one-shot runs: each ``exec`` request carries the
files to write and the paths to fetch, and runs in namespaces no earlier request used.

Standard library only; imports kept to what ``python3 -S`` loads in a few milliseconds:
the C modules ``_signal``, ``_struct`` and ``_ctypes`` instead of their Python wrappers
(``signal`` alone imports ``enum``, which costs more than the rest of the start).
"""

import _signal as signal
import _struct as struct
import marshal
import os
import resource
import select
import sys
import time

REQ_FD, REP_FD = 3, 4
WORKSPACE = sys.argv[1] if len(sys.argv) > 1 else "/workspace"
PIDNS = len(sys.argv) > 2 and sys.argv[2] == "pidns"
MODE = sys.argv[3] if len(sys.argv) > 3 else ""
PROXY = MODE == "proxy"  # network: allowlist
# A zygote runs each action in pid, mount and IPC namespaces of its own, on a fresh
# tmpfs workspace and /tmp (see fresh_namespaces); it keeps CAP_SYS_ADMIN of the
# sandbox's user namespace for that, and its actions drop every capability.
ZYGOTE = MODE == "zygote"
DATA_FD = 3  # in a zygote's action: where its namespace's init reports (status, files)
PROXY_SOCKET, PROXY_PORT = "/run/temper/proxy.sock", 3128
CHUNK = 65536
TRIM_BYTES = 1 << 20  # after a request and reply of more, the agent trims its heap
# Sessions that outlive actions: the services and the proxy forwarder, each the session
# of a process the agent forked (setsid), so code in the sandbox cannot join one.
KEPT: set[int] = set()


_prctl = None


def _set_dumpable(flag):
    # Non-dumpable: code in the sandbox (same uid) cannot ptrace the agent or open its fds.
    # prctl through the bare _ctypes module, looked up once in the agent; a child only
    # makes the call.
    global _prctl
    try:
        if _prctl is None:
            import _ctypes

            class Int(_ctypes._SimpleCData):
                _type_ = "i"

            class Fn(_ctypes.CFuncPtr):
                _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
                _restype_ = Int

            class Libc:
                _handle = _ctypes.dlopen(None)

            _prctl = Fn(("prctl", Libc()))
        _prctl(4, flag, 0, 0, 0)  # PR_SET_DUMPABLE
    except Exception:
        pass


def read_exact(n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(REQ_FD, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def send(head, out=b"", err=b"", data=b""):
    head = dict(head, out=len(out), err=len(err), data=len(data))
    h = ";".join(f"{k}={v}" for k, v in head.items()).encode()
    body = struct.pack("<I", len(h)) + h + out + err + data
    msg = struct.pack("<I", len(body)) + body
    view = memoryview(msg)
    while view:
        view = view[os.write(REP_FD, view) :]


children: dict[int, int] = {}  # pid -> wait status, for children reaped while looking for another


def reap_all():
    """Reap every exited process (as PID 1 we inherit the sandbox's orphans)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children[pid] = status
        KEPT.discard(pid)  # a service's leader died: its pid may be reused, its session is not kept


def session_of(pid):
    """(session id, state) of a process of this pid namespace, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return int(fields[3]), fields[0]


def kill_unkept():
    """Kill every process but the agent and the kept sessions, until none is left."""
    for _ in range(200):
        victims = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or entry == "1":
                continue
            found = session_of(entry)
            if found is None or found[0] in KEPT or found[1] == b"Z":
                continue
            victims += 1
            try:
                os.kill(int(entry), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        reap_all()
        if not victims:
            return
        time.sleep(0.0005)


def kill_all(main_pid):
    """Kill every process of the action: all of the pid namespace but the agent."""
    if PIDNS and KEPT:
        kill_unkept()
        return
    for _ in range(200):
        try:
            if PIDNS:
                os.kill(-1, signal.SIGKILL)
            else:
                os.killpg(main_pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            reap_all()
            return
        reap_all()
        time.sleep(0.0005)
    reap_all()


def resolve(path):
    if not path:
        return WORKSPACE
    return path if path.startswith("/") else os.path.join(WORKSPACE, path)


def _limit_self(req):
    """In a forked child before exec: the action's or service's rlimits and cwd, first in
    line for the OOM killer (never the agent)."""
    _set_dumpable(1)
    try:
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        try:
            os.write(fd, b"1000")
        finally:
            os.close(fd)
    except OSError:
        pass
    for name, (soft, hard) in req["rlimits"].items():
        try:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        except (ValueError, OSError):
            pass
    os.chdir(resolve(req.get("cwd")))


def print_uncaught(exc, name, code):
    """What the interpreter prints for an exception a program did not catch, through
    ``sys.excepthook`` as ``python3 FILE`` does: the traceback starts at the program's
    first frame (the agent's own exec frame left out), and a SyntaxError of the program
    shows its file and line alone."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != name:
        tb = tb.tb_next
    if name == "<code>":
        # No file to read the lines from: the traceback module, with the code in its cache.
        import linecache
        import traceback

        linecache.cache[name] = (len(code), None, code.splitlines(True), name)
        traceback.print_exception(type(exc), exc, tb)
        return
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # it prints the exception's own


def child(req, rin, wout, werr, wdat=-1):
    try:
        os.setsid()
        os.dup2(rin, 0)
        os.dup2(wout, 1)
        os.dup2(werr, 2)
        if wdat >= 0:
            os.dup2(wdat, DATA_FD)
        os.closerange(DATA_FD + 1 if wdat >= 0 else DATA_FD, 65536)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGXCPU, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        if ZYGOTE:
            fresh_namespaces(req)  # returns in the action's process, without capabilities
        _limit_self(req)
        env = req["env"]
        argv = req.get("argv")
        if argv:
            os.execvpe(argv[0], argv, env)
        os.environ.clear()
        os.environ.update(env)
        sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
        code = req["code"]
        # The program runs as its file when it has one (``python3 FILE``: argv[0],
        # __file__, sys.path[0] and its tracebacks name it), else as "<code>".
        name = resolve(req["file"]) if req.get("file") else "<code>"
        sys.argv = [name]
        sys.path[0:0] = [os.path.dirname(name) if req.get("file") else os.getcwd()]
        glb = {"__name__": "__main__", "__builtins__": __builtins__, "__file__": name}
        status = 0
        try:
            exec(compile(code, name, "exec"), glb)
        except SystemExit as e:
            if e.code is None:
                status = 0
            elif isinstance(e.code, int):
                status = e.code & 0xFF
            else:
                sys.stderr.write(str(e.code) + "\n")
                status = 1
        except BaseException as e:
            print_uncaught(e, name, code)
            status = 1
        try:
            # What a normal interpreter exit does: join non-daemon threads, run atexit.
            threading = sys.modules.get("threading")
            if threading is not None:
                threading._shutdown()
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            status = status or 120
        os._exit(status)
    except FileNotFoundError as e:
        os.write(2, f"{e.filename}: command not found\n".encode())
        os._exit(127)
    except BaseException as e:
        try:
            os.write(2, f"sandbox: {e!r}\n".encode())
        finally:
            os._exit(126)


# --- the zygote: an action in namespaces of its own ------------------------------------
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWIPC = 0x00020000, 0x20000000, 0x08000000
OWN_PIDNS = -1  # the zygote agent's own pid namespace (an fd), to return to after each fork
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
_libc = None


def _lib():
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _sys(name, *args):
    """A libc call that must succeed (OSError otherwise)."""
    if getattr(_lib(), name)(*args) != 0:
        import ctypes

        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}: {os.strerror(errno)}")


def _mount(source, target, fstype, flags, data=None):
    _sys("mount", source.encode(), target.encode(), fstype and fstype.encode(), flags, data and data.encode())


def drop_capabilities():
    """Every capability gone for good: ambient, bounding, then effective/permitted/
    inheritable; no_new_privs so no exec can bring one back."""
    import ctypes

    _sys("prctl", 47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    for cap in range(64):
        if _libc.prctl(24, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:  # PR_CAPBSET_DROP
            break  # EINVAL: past the last capability this kernel knows
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable}, all zero
    _sys("capset", header, data)
    _sys("prctl", 38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS


def _inside(path):
    full = os.path.normpath(resolve(path))
    if not full.startswith(WORKSPACE + "/"):
        raise ValueError(f"{path!r} is outside the workspace")
    return full


SYS_OPENAT2, ENOSYS = 437, 38
# RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH
RESOLVE_INSIDE = 0x01 | 0x02 | 0x04 | 0x08
OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a fifo must not block
OPEN_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_beneath(dirfd, rel):
    """An fd for ``rel`` under the directory ``dirfd``, resolved without following a link
    in any component and without leaving the directory or its mount: openat2 with
    RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS, or (before Linux 5.6) a walk that opens each
    component with O_NOFOLLOW. OSError for anything else."""
    import ctypes

    how = (ctypes.c_uint64 * 3)(OPEN_FILE, 0, RESOLVE_INSIDE)
    fd = _lib().syscall(SYS_OPENAT2, dirfd, rel.encode("utf-8", "surrogateescape"), how, 24)
    if fd >= 0:
        return fd
    errno = ctypes.get_errno()
    if errno != ENOSYS:
        raise OSError(errno, os.strerror(errno))
    *dirs, name = rel.split("/")
    at = os.open(".", OPEN_DIR, dir_fd=dirfd)
    try:
        for part in dirs:
            nxt = os.open(part, OPEN_DIR, dir_fd=at)
            os.close(at)
            at = nxt
        return os.open(name, OPEN_FILE, dir_fd=at)
    finally:
        os.close(at)


def _fetch(paths, budget):
    """The fetched files as ``u32 name length, name, i32 size (-1 missing, -2 over the
    budget), bytes`` records: only regular files inside the workspace, reached without
    a link (``_open_beneath``), read from the fd that was checked."""
    out = bytearray()
    root = os.open(WORKSPACE, OPEN_DIR)
    try:
        for path in paths:
            size, body = -1, b""
            try:
                rel = _inside(path)[len(WORKSPACE) + 1 :]
                fd = _open_beneath(root, rel)
                try:
                    if os.fstat(fd).st_mode & 0o170000 == 0o100000:  # S_IFREG
                        os.set_blocking(fd, True)
                        with open(fd, "rb", closefd=False) as f:
                            body = f.read(budget + 1)
                        size = len(body) if len(body) <= budget else -2
                finally:
                    os.close(fd)
            except (OSError, ValueError):
                pass
            if size < 0:
                body = b""
            budget -= len(body)
            name = path.encode("utf-8", "surrogateescape")
            out += struct.pack("<I", len(name)) + name + struct.pack("<i", size) + body
    finally:
        os.close(root)
    return bytes(out)


def kill_namespace():
    """As PID 1 of a run's pid namespace: SIGKILL every other process in it and reap them
    all, so that nothing of the run still runs while its files are read. Every process of
    the namespace descends from its init (nothing in a run can setns into it), and orphans
    are re-parented to it: once it has no child left, none is left at all, and the common
    case (nothing left behind) costs one waitpid, not a kill(-1) that walks every process
    of the host."""
    for _ in range(10000):
        while True:
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                break
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass  # only zombies: reaped above on the next turn
        time.sleep(0.0002)


def _wait_for(pid):
    """As a namespace's init: reap every child until ``pid`` exits; its wait status."""
    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue
        if done == pid:
            return status


def fork_into_new_pid_namespace():
    """``os.fork()`` whose child is PID 1 of a new pid namespace (a zygote's run). The
    agent stays where it is: unshare(CLONE_NEWPID) only decides where its next child
    goes, and setns to its own namespace undoes that right after the fork."""
    _sys("unshare", CLONE_NEWPID)
    try:
        pid = os.fork()
    except BaseException:
        _sys("setns", OWN_PIDNS, CLONE_NEWPID)
        raise
    if pid:
        _sys("setns", OWN_PIDNS, CLONE_NEWPID)
    return pid


def become_pid1_of_own_namespace():
    """Go on as PID 1 of a pid namespace of this user namespace, the first process
    waiting for it. bwrap's pid namespace belongs to the user namespace above this one
    (``--disable-userns`` nests one), so only from one of our own can the agent setns
    back after each run's fork."""
    global OWN_PIDNS
    _sys("unshare", CLONE_NEWPID)
    agent = os.fork()
    if agent:
        os.close(REQ_FD)
        os.close(REP_FD)
        status = _wait_for(agent)
        os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)
    OWN_PIDNS = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)


def fresh_namespaces(req):
    """In a zygote's child, PID 1 of a new pid namespace: new mount and IPC namespaces,
    a fresh tmpfs workspace and /tmp and a /proc of its own, the request's files, then
    the action forked. Returns only in the action's process, with no capability and no
    way back to the data pipe. This init waits for the action, reports its status,
    whether the workspace filled up and the fetched files, then exits, which kills
    whatever the action left in its pid namespace."""
    fresh = req["fresh"]
    _sys("unshare", CLONE_NEWNS | CLONE_NEWIPC)  # the copied mounts are private (see main)
    owner = f"uid={os.getuid()},gid={os.getgid()}"
    _mount("tmpfs", WORKSPACE, "tmpfs", MS_NOSUID | MS_NODEV, f"size={fresh['ws_mb']}m,mode=755,{owner}")
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=1777")
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if fresh["shm_mb"]:
        # The zygote's /dev is read-only (nodes bound in, links fixed); what a run can
        # write there is its own: a /dev/shm sized from its memory (its pages charged to
        # the zygote's cgroup, under the run's limit) and a devpts instance, both gone with
        # the run's mount namespace.
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={fresh['shm_mb']}m,mode=1777")
        _mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620")
    modes = fresh.get("modes") or {}  # path -> 0o755 for the executables of a build
    for path, data in fresh["files"].items():
        full = _inside(path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        mode = 0o755 if modes.get(path, 0o644) & 0o111 else 0o644
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    started = time.monotonic()
    action = os.fork()
    if action == 0:
        os.close(DATA_FD)
        drop_capabilities()
        return
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)  # the action's pipes close when the action's processes do
    status = _wait_for(action)
    took = time.monotonic() - started  # the action's own run time: from its fork to its exit
    if fresh["kill"]:
        kill_namespace()  # the action's orphans cannot change what is fetched below
    st = os.statvfs(WORKSPACE)
    full = int(st.f_bavail == 0 or st.f_favail == 0)
    report = struct.pack("<iBd", status, full, took) + _fetch(fresh["fetch"], fresh["fetch_max"])
    view = memoryview(report)
    while view:
        view = view[os.write(DATA_FD, view) :]
    os._exit(0)


def run(req):
    cap = req["out_cap"]
    deadline = time.monotonic() + req["wall"]
    rin, win = os.pipe()
    rout, wout = os.pipe()
    rerr, werr = os.pipe()
    rdat, wdat = os.pipe() if ZYGOTE else (-1, -1)
    t0 = time.monotonic()
    pid = fork_into_new_pid_namespace() if ZYGOTE else os.fork()
    if pid == 0:
        child(req, rin, wout, werr, wdat)
    os.close(rin)
    os.close(wout)
    os.close(werr)
    stdin = req.get("stdin") or b""
    if not stdin:
        os.close(win)
        win = -1
    bufs = {rout: bytearray(), rerr: bytearray()}
    trunc = {rout: 0, rerr: 0}
    caps = {rout: cap, rerr: cap}
    poller = select.poll()
    poller.register(rout, select.POLLIN)
    poller.register(rerr, select.POLLIN)
    if rdat >= 0:
        os.close(wdat)
        bufs[rdat] = bytearray()
        trunc[rdat] = 0
        caps[rdat] = req["fresh"]["fetch_max"] + (1 << 16)  # the init keeps within it
        poller.register(rdat, select.POLLIN)
    if win >= 0:
        os.set_blocking(win, False)
        poller.register(win, select.POLLOUT)
    # Once the pipes are closed, a pidfd (readable the moment the main process exits)
    # wakes the loop instead of polling for the exit: a process's pipes close a little
    # before it can be reaped. While the pipes are open, the loop keeps its pace.
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = -1
    open_fds = {rout, rerr, *([rdat] if rdat >= 0 else [])}
    reason = ""
    status = None
    idle_ms = 1
    while True:
        if status is None:
            reap_all()
            status = children.pop(pid, None)
        if status is not None and (not open_fds or not PIDNS):
            break
        if status is not None:
            # The main process is gone but something still holds its pipes: an orphan.
            # Give it no more time; what it wrote so far is drained below.
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            reason = "timeout"
            break
        wait_ms = min(remaining * 1000, idle_ms if not open_fds and pidfd < 0 else 50)
        events = poller.poll(max(1, int(wait_ms)))
        if not events:
            idle_ms = min(idle_ms * 2, 20)
        for fd, _ev in events:
            if fd == pidfd:
                continue  # reaped at the top of the loop
            if fd == win:
                try:
                    n = os.write(win, stdin[:CHUNK])
                    stdin = stdin[n:]
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    stdin = b""
                if not stdin:
                    poller.unregister(win)
                    os.close(win)
                    win = -1
                continue
            try:
                chunk = os.read(fd, CHUNK)
            except (BlockingIOError, InterruptedError):
                continue
            if not chunk:
                poller.unregister(fd)
                open_fds.discard(fd)
                if not open_fds and pidfd >= 0:
                    poller.register(pidfd, select.POLLIN)
                continue
            room = caps[fd] - len(bufs[fd])
            if room > 0:
                bufs[fd] += chunk[:room]
            if len(chunk) > room:
                trunc[fd] += len(chunk) - max(room, 0)
                reason = "output"
        if reason:
            break
    kill_all(pid)
    if pidfd >= 0:
        os.close(pidfd)
    if status is None:
        reap_all()
        status = children.pop(pid, None)
    wall = time.monotonic() - t0
    # Everything that could write is dead: drain what is left without blocking.
    for fd in list(open_fds):
        os.set_blocking(fd, False)
        while True:
            try:
                chunk = os.read(fd, CHUNK)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            room = caps[fd] - len(bufs[fd])
            if room > 0:
                bufs[fd] += chunk[:room]
            if len(chunk) > room:
                trunc[fd] += len(chunk) - max(room, 0)
    for fd in (rout, rerr, win, rdat):
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
    children.clear()
    head = {
        "ok": 1,
        "wall": f"{wall:.6f}",
        "reason": reason,
        "otr": int(trunc[rout] > 0),
        "etr": int(trunc[rerr] > 0),
    }
    data = b""
    if rdat >= 0:
        # The namespace's init reports the action's own wait status (its own exit says
        # nothing of a signal: an init cannot die of a signal sent from inside).
        data = bytes(bufs[rdat])
        if len(data) >= 13:
            status, full, took = struct.unpack_from("<iBd", data)
            head["full"] = full
            head["took"] = f"{took:.6f}"
            data = data[13:]
    if status is not None:
        if os.WIFSIGNALED(status):
            head["sig"] = os.WTERMSIG(status)
        else:
            head["exit"] = os.WEXITSTATUS(status)
    send(head, bytes(bufs[rout]), bytes(bufs[rerr]), data)
    return len(bufs[rout]) + len(bufs[rerr]) + len(data)  # bytes sent back


def op_write(req):
    path = resolve(req["path"])
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, req.get("mode", 0o644))
    try:
        view = memoryview(req["data"])
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    send({"ok": 1})


def op_read(req):
    path = resolve(req["path"])
    limit = req["max"]
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    send({"ok": 1, "dtr": int(len(data) > limit)}, data=data[:limit])


def op_list(req):
    root = resolve(req.get("path"))
    entries = []
    limit = req.get("max", 10000)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames) + sorted(filenames):
            full = os.path.join(dirpath, name)
            try:
                st = os.lstat(full)
            except OSError:
                continue
            kind = "d" if os.path.isdir(full) and not os.path.islink(full) else "f"
            entries.append(f"{kind}{st.st_size}\t{os.path.relpath(full, root)}")
            if len(entries) >= limit:
                break
        if len(entries) >= limit or not req.get("recursive", True):
            break
    send({"ok": 1}, data="\0".join(entries).encode("utf-8", "surrogateescape"))


def start_kept(target):
    """Fork ``target()`` as the leader of a new, kept session; returns its pid."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGXCPU, signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            target()
        finally:
            os._exit(126)
    KEPT.add(pid)
    return pid


def op_service(req):
    """Start a service: ``/bin/sh -c command`` in a kept session, output to its log."""

    def service():
        null = os.open("/dev/null", os.O_RDONLY)
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, 65536)
        _limit_self(req)
        os.execve("/bin/sh", ["/bin/sh", "-c", req["command"]], req["env"])

    send({"ok": 1, "pid": start_kept(service)})


def forwarder(listener):
    """Relay each connection to 127.0.0.1:3128 to the worker's proxy socket (a child
    per connection): tools in the sandbox speak HTTP(S)_PROXY over TCP, not Unix sockets."""
    import _socket

    os.closerange(3, listener.fileno())
    os.closerange(listener.fileno() + 1, 65536)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # connection children reap themselves
    while True:
        try:
            fd, _addr = listener._accept()
        except OSError:
            continue
        if os.fork() == 0:
            listener.close()
            client = _socket.socket(fileno=fd)
            upstream = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            try:
                upstream.connect(PROXY_SOCKET)
                relay(client, upstream)
            finally:
                os._exit(0)
        os.close(fd)


def relay(a, b):
    poller = select.poll()
    peers = {a.fileno(): b, b.fileno(): a}
    for s in (a, b):
        poller.register(s.fileno(), select.POLLIN)
    while peers:
        for fd, _ev in poller.poll():
            src = a if fd == a.fileno() else b
            try:
                data = src.recv(CHUNK)
            except OSError:
                data = b""
            if data:
                try:
                    peers[fd].sendall(data)
                    continue
                except OSError:
                    return
            poller.unregister(fd)
            try:
                peers.pop(fd).shutdown(1)  # SHUT_WR: pass the EOF on
            except OSError:
                pass


def op_fetch(req):
    """Files read back after a one-shot run on a sandbox of its own, as a zygote's are."""
    send({"ok": 1}, data=_fetch(req["paths"], req["max"]))


OPS = {
    "exec": run, "write": op_write, "read": op_read, "list": op_list, "service": op_service,
    "fetch": op_fetch,
}  # fmt: skip
if ZYGOTE:
    OPS = {"exec": run}  # its own workspace is never an action's: only fresh runs


def main():
    if sys.argv[0].endswith(".pyc"):
        sys.path[0] = ""  # as with ``-c``: not the directory the compiled agent is bound in
    # Keep the protocol on fds 3/4 and give stdio to /dev/null, so nothing a child
    # inherits by accident can reach the worker.
    os.dup2(0, REQ_FD)
    os.dup2(1, REP_FD)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    _set_dumpable(0)
    if ZYGOTE:
        _sys("prctl", 4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0, and libc loaded once, not per run
        # Once: a mount namespace of this user namespace (bwrap's belongs to the one above),
        # every mount in it private, so no run's mounts can propagate to another's.
        _sys("unshare", CLONE_NEWNS)
        _mount("none", "/", None, MS_REC | MS_PRIVATE)
        become_pid1_of_own_namespace()
    os.chdir(WORKSPACE)
    if PROXY:
        # Listening before the first action: a connection waits in the backlog until
        # the forwarder accepts it.
        import _socket

        listener = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", PROXY_PORT))
        listener.listen(64)
        fwd = start_kept(lambda: forwarder(listener))
        listener.close()
        send({"ok": 1, "pid": os.getpid(), "fwd": fwd})
    else:
        send({"ok": 1, "pid": os.getpid()})
    while True:
        try:
            (n,) = struct.unpack("<I", read_exact(4))
            req = marshal.loads(read_exact(n))
        except EOFError:
            os._exit(0)
        try:
            moved = n + (OPS[req["op"]](req) or 0)
        except Exception as e:
            moved = n
            send({"ok": 0}, data=f"{type(e).__name__}: {e}".encode("utf-8", "replace"))
        del req
        if moved > TRIM_BYTES:
            # Large buffers stay in malloc's heap once freed (glibc raises its mmap
            # threshold after the first): give them back, so that the agent's memory comes
            # back to its baseline (a zygote above it is replaced).
            _lib().malloc_trim(0)


main()
