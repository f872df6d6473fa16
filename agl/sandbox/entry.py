"""The first process of a sandbox's namespaces: it builds what the command may see, then
runs the command as a user who owns nothing, and watches it to its end.

Started by :mod:`agl.sandbox.launch` as ``python -I -S entry.py SPEC_FD STATUS_FD``
inside ``unshare``'s new mount, PID, IPC and UTS namespaces (network and user ones when
asked), holding every capability of those namespaces. ``-I -S`` and the standard library
alone: nothing on ``sys.path`` but the interpreter's own library, no ``site`` (so no
``.pth`` file of any site-packages runs here), nothing imported from agl. The spec (JSON,
:class:`agl.sandbox.spec.Spec`) is read from ``SPEC_FD`` and closed: it is on no command
line, so ``/proc/1/cmdline`` tells the command nothing of what is hidden. One JSON line
goes to ``STATUS_FD`` at the end: ``{"exit": N}``, with ``"limit"`` and ``"message"``
when a limit ended the command, or ``{"error": ...}`` (exit 125) when the sandbox could
not be built.

How the tree is built, bubblewrap's way: a tmpfs (the *base*) is mounted over ``/tmp``
and made the root with the machine's tree under ``/old``; the command's tree is built at
``/new`` from ``/old``; then ``/new`` becomes the root and the base, ``/old`` with it, is
detached: nothing of the machine remains reachable but what was bound into ``/new``.
Two views (``spec["view"]``):

- ``"jail"``: ``/new`` is an empty tmpfs holding only the ``binds`` (read-only unless
  marked writable), the host's ``/bin``-style links, a ``/proc`` of the namespace
  (``/proc/sys`` read-only) and a ``/dev`` of the harmless devices. Homes, ``/opt``,
  ``/srv``, other checkouts, run folders, caches, package indexes: none of it exists.
- ``"host"``: ``/new`` is the machine's whole tree with **every mount read-only**.

Then, in both: one scratch tmpfs of ``scratch_mib`` serves ``/tmp``, ``/var/tmp`` and
``/dev/shm`` (and a fresh ``/dev/mqueue`` for the IPC namespace); each ``hidden`` folder
is covered by an empty tmpfs no one may enter, except the ``kept`` (read-only) and
``writable`` paths inside it, bound back where they were (the folders on their way may
be passed through, not listed); a hidden file is covered by an empty file of mode 000;
each ``refuse`` program is replaced by a script that prints why and fails. The command
then runs

- as ``uid``/``gid`` (a user who owns nothing of the trainer's) without supplementary
  groups, or as it is (in the user namespace of an unprivileged trainer), with **every
  capability dropped and no_new_privs** (``setpriv``): no mount can be undone;
- in ``cwd``, with exactly ``env`` as its environment;
- under ``limits``: rlimits on processes (counted per uid: a uid per sandbox makes it
  the sandbox's), address space, file size and open files, no core files; and this
  process, the namespace's init, which sees every process in it, ends the sandbox when
  they are more than ``processes``, hold more than ``memory_mib`` resident, or the
  writable paths grow past ``disk_mib``, and says which in the status line;
- with ``output_limit``: its stdout and stderr merged and read here, at most that many
  bytes passed on (the head, a line saying how much was left out, the tail), so a
  command that prints gigabytes costs its caller nothing.

When this process ends, the kernel kills every process left in the PID namespace.
"""

import contextlib
import ctypes
import errno
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOSYMFOLLOW = 256
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_RELATIME = 1 << 21
MNT_DETACH = 2
# statvfs's flags and the mount flags they stand for: in a user namespace a remount must
# keep the flags its mount was locked with, so they are read back and passed again.
_KEPT_FLAGS = (
    (os.ST_NOSUID, MS_NOSUID),
    (os.ST_NODEV, MS_NODEV),
    (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME),
    (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
    (8192, MS_NOSYMFOLLOW),  # ST_NOSYMFOLLOW
)
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
DROP_PRIVILEGES = (
    "--no-new-privs",
    "--inh-caps=-all",
    "--ambient-caps=-all",
    "--bounding-set=-all",
)
SETUP_FAILED = 125
LIMIT_EXIT = 137  # what a kill would say; the status line says which limit
BASE = "/tmp"  # covered by this namespace's base tmpfs while the tree is built
SCRATCH = {"tmp": "/tmp", "var-tmp": "/var/tmp", "shm": "/dev/shm"}
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
WATCH_S = 0.1  # how often the limits are checked
DISK_EVERY_S = 1.0  # how often the writable paths are measured
CHUNK = 65536

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """The sandbox could not be built as its spec says."""


def _check(result, what):
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _b(text):
    return None if text is None else os.fsencode(text)


def mount(source, target, fstype=None, flags=0, data=None):
    call = _libc.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data))
    _check(call, f"mount {target}")


def umount(target):
    _check(_libc.umount2(_b(target), MNT_DETACH), f"umount {target}")


def pivot_root(new_root, put_old):
    machine = os.uname().machine
    number = _PIVOT_ROOT.get(machine)
    if number is None:
        raise SetupError(f"pivot_root: unknown system call number on {machine}")
    _check(_libc.syscall(number, _b(new_root), _b(put_old)), f"pivot_root {new_root}")


def _kept_flags(path):
    found = os.statvfs(path).f_flag
    return sum(ms for st, ms in _KEPT_FLAGS if found & st)


def read_only(path):
    """The mount at ``path`` made read-only (a bind of it, or the mount itself)."""
    mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _kept_flags(path))


def writable(path):
    mount(None, path, None, MS_REMOUNT | MS_BIND | _kept_flags(path))


def tmpfs(target, mode, size, flags=0):
    mount("agl", target, "tmpfs", MS_NOSUID | MS_NODEV | flags, f"mode={mode:o},size={size}")


def bind(source, target, flags=0):
    mount(source, target, None, MS_BIND | flags)


def mount_points(*roots):
    """The mount points of this namespace at or below any of ``roots``, shallowest
    first."""
    # While the tree is built, the namespace's /proc is the machine tree's, under /old.
    proc = "/old/proc" if os.path.isdir("/old/proc/self") else "/proc"
    with open(f"{proc}/self/mountinfo", "rb") as f:
        lines = f.read().decode("utf-8", "surrogateescape").splitlines()
    # The fifth field, with space, tab, newline and backslash escaped in octal.
    points = {_unescape(line.split(" ")[4]) for line in lines if line.strip()}
    inside = (p for p in points if any(p == r or _below(p, r) for r in roots))
    return sorted(inside, key=len)


def _unescape(field):
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _below(path, folder):
    return path != folder and os.path.commonpath([path, folder]) == folder


def all_read_only(*roots, keep=()):
    """Every mount at or below each of ``roots`` read-only, but for those at or below
    ``keep``. A mount that cannot be reached (covered by another, or behind a folder this
    process may not enter, which the command may not either) is left; one that refuses
    is an error: the command must not write there."""
    for point in mount_points(*roots):
        if any(point == k or _below(point, k) for k in keep):
            continue
        try:
            read_only(point)
        except OSError as error:
            if error.errno not in (errno.EINVAL, errno.ENOENT, errno.EACCES, errno.ENOTDIR):
                raise SetupError(f"cannot make {point} read-only: {error.strerror}") from None


def make_point(path, is_dir, parents=0o755):
    """An empty folder or file at ``path`` for a mount to cover, its missing parents made
    with mode ``parents`` (0711 under a cover: passed through, not listed; a jail's are
    listed, as Python's imports list the folders on their path)."""
    missing, parent = [], os.path.dirname(path)
    while not os.path.isdir(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for folder in reversed(missing):  # makedirs would give them the umask's mode
        os.mkdir(folder)
        os.chmod(folder, parents)
    if is_dir:
        if not os.path.isdir(path):
            os.mkdir(path, 0o755)
    elif not os.path.lexists(path):
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o000))


class Builder:
    """The tree at ``/new``, from the machine's at ``/old``, as ``spec`` says."""

    def __init__(self, spec):
        self.spec = spec
        self.kept = [os.path.normpath(p) for p in spec.get("kept", [])]
        self.writable = [os.path.normpath(p) for p in spec.get("writable", [])]
        self.bound = set()  # paths (as the command sees them) bound back writable
        self.binds = list(spec.get("binds", []))
        if spec["view"] == "jail":  # the machine's /bin-style folders that are not links
            places = [f"/{name}" for name in LINKS]
            real = [
                p for p in places if os.path.isdir(self.old(p)) and not os.path.islink(self.old(p))
            ]
            self.binds += [[p, p, False] for p in real]
        # A jail's binds: each target's source; a hidden folder above one binds it back.
        self.sources = {os.path.normpath(t): os.path.normpath(s) for s, t, _ in self.binds}
        self.kept += [t for t in self.sources if t not in self.writable]

    @staticmethod
    def new(path):
        return "/new" + path if path != "/" else "/new"

    @staticmethod
    def old(path):
        return "/old" + path if path != "/" else "/old"

    def build(self):
        os.makedirs("/new", 0o755)
        if self.spec["view"] == "jail":
            self.jail()
        else:
            bind("/old", "/new", MS_REC)
            all_read_only("/new")
            if os.path.isdir("/new/dev/mqueue"):
                self.mqueue()
        self.scratch()
        done: list[str] = []
        for folder in sorted(self.spec.get("hidden", []), key=len):
            folder = os.path.normpath(folder)
            self.hide(folder, under=any(_below(folder, d) for d in done))
            done.append(folder)
        for path in self.writable:
            if path not in self.bound:
                self.bind_back(path, write=True)
        self.refuse()

    def jail(self):
        tmpfs("/new", 0o755, "8m")
        for name in LINKS:
            if os.path.islink(self.old("/" + name)):
                os.symlink(os.readlink(self.old("/" + name)), self.new("/" + name))
        read_only_targets = []
        for source, target, write in self.binds:
            if not os.path.lexists(self.old(source)):
                raise SetupError(f"nothing to bind at {source}")
            make_point(self.new(target), os.path.isdir(self.old(source)))
            bind(self.old(source), self.new(target), MS_REC)
            if write:
                self.bound.add(target)
            else:
                read_only_targets.append(self.new(target))
        writable_targets = [self.new(t) for t in self.bound]
        all_read_only(*read_only_targets, keep=writable_targets)
        self.proc()
        self.dev()

    def proc(self):
        make_point("/new/proc", True)
        mount("proc", "/new/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        bind("/new/proc/sys", "/new/proc/sys")
        read_only("/new/proc/sys")

    def dev(self):
        make_point("/new/dev", True)
        tmpfs("/new/dev", 0o755, "64k", MS_NOEXEC)
        for name in DEVICES:
            if os.path.exists(f"/old/dev/{name}"):
                make_point(f"/new/dev/{name}", False)
                bind(f"/old/dev/{name}", f"/new/dev/{name}")
        for name, target in (
            ("fd", "/proc/self/fd"),
            ("stdin", "/proc/self/fd/0"),
            ("stdout", "/proc/self/fd/1"),
            ("stderr", "/proc/self/fd/2"),
        ):
            os.symlink(target, f"/new/dev/{name}")
        os.mkdir("/new/dev/pts", 0o755)
        with contextlib.suppress(OSError):  # a terminal is a nicety, not a need
            options = "newinstance,ptmxmode=0666,mode=620"
            mount("devpts", "/new/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, options)
            os.symlink("pts/ptmx", "/new/dev/ptmx")
        os.mkdir("/new/dev/mqueue", 0o755)
        self.mqueue()

    @staticmethod
    def mqueue():
        with contextlib.suppress(OSError):  # the IPC namespace's own queues
            mount("mqueue", "/new/dev/mqueue", "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC)

    def scratch(self):
        """One tmpfs for every scratch folder, so that together they hold no more than
        ``scratch_mib``; the kept and writable paths below them bound back."""
        pool = "/scratch"
        os.mkdir(pool, 0o700)
        tmpfs(pool, 0o700, f"{int(self.spec.get('scratch_mib', 256))}m")
        for part, folder in SCRATCH.items():
            if self.spec["view"] == "host" and not os.path.isdir(self.new(folder)):
                continue
            os.mkdir(f"{pool}/{part}", 0o1777)
            os.chmod(f"{pool}/{part}", 0o1777)  # past the umask
            make_point(self.new(folder), True)
            self.covered(folder, lambda f=folder, p=part: bind(f"{pool}/{p}", self.new(f)))

    def hide(self, folder, under=False):
        target = self.new(folder)
        # A link is not covered (a mount would follow it): what it names is hidden apart.
        if os.path.islink(target):
            return
        if not os.path.lexists(target):
            # Not in the jail: where the machine has it, a sealed stand-in, so that a reach
            # for it is refused (and seen) rather than told it does not exist; none inside
            # a folder hidden already (its cover refuses the reach, and is read-only).
            source = self.old(folder)
            if self.spec["view"] != "jail" or under or not os.path.lexists(source):
                return
            make_point(target, os.path.isdir(source), parents=0o711)
        if os.path.isdir(target):
            mode = 0o711 if self.inside(folder) else 0o000
            self.covered(folder, lambda: tmpfs(target, mode, "4k", MS_NOEXEC))
        else:
            bind("/sealed", target)
            read_only(target)

    def inside(self, folder):
        return [p for p in (*self.kept, *self.writable) if _below(p, folder)]

    def covered(self, folder, put_cover):
        """``put_cover()`` over ``folder``, then the kept and writable paths inside it
        bound back from the machine's tree (the folders made on their way hold only
        mount points: they may be passed through, not listed)."""
        put_cover()
        inside = self.inside(folder)
        for path in sorted(inside, key=len):
            self.bind_back(path, write=path in self.writable)
        if folder not in SCRATCH.values():
            read_only(self.new(folder))

    def bind_back(self, path, write):
        source = self.old(self.sources.get(path, path))
        if not os.path.lexists(source):
            return
        make_point(self.new(path), os.path.isdir(source), parents=0o711)
        bind(source, self.new(path), MS_REC)
        if write:
            writable(self.new(path))
            self.bound.add(path)
        else:
            all_read_only(self.new(path))

    def refuse(self):
        for index, (program, message) in enumerate(sorted(self.spec.get("refuse", {}).items())):
            target = self.new(program)
            if not os.path.exists(target):
                continue
            stub = f"/refused-{index}"
            with open(stub, "w") as f:
                f.write(f"#!/bin/sh\necho {_quote(message)} >&2\nexit 126\n")
            os.chmod(stub, 0o555)
            bind(stub, target)
            read_only(target)

    def finish(self):
        """``/new`` the root; the base and the machine's tree gone."""
        if self.spec["view"] == "jail":
            mount(None, "/new", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
            mount(None, "/new/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
        os.chdir("/new")
        pivot_root(".", ".")
        umount(".")
        os.chdir("/")


def _quote(text):
    return "'" + text.replace("'", "'\"'\"'") + "'"


def build(spec):
    """The command's tree, as the root of this process."""
    tmpfs(BASE, 0o755, "16m")
    os.mkdir(f"{BASE}/old", 0o700)
    os.chdir(BASE)
    pivot_root(".", "old")
    os.chdir("/")
    # An empty file no one may open, for hidden files.
    os.close(os.open("/sealed", os.O_CREAT | os.O_WRONLY, 0o000))
    builder = Builder(spec)
    builder.build()
    builder.finish()


def _limit_child(limits):
    """rlimits for the command, set before it drops to its user (and counted as it)."""

    def apply():
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if not limits:
            return
        for which, value in (
            (resource.RLIMIT_NPROC, int(limits["processes"])),
            (resource.RLIMIT_AS, int(limits["memory_mib"]) << 20),
            (resource.RLIMIT_FSIZE, int(limits["file_mib"]) << 20),
            (resource.RLIMIT_NOFILE, int(limits["open_files"])),
        ):
            resource.setrlimit(which, (value, value))

    return apply


class Watch:
    """The namespace's processes and writable paths against the limits."""

    def __init__(self, limits, paths):
        self.limits = limits
        self.paths = paths
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.measured = time.monotonic()

    def exceeded(self, final=False):
        """(limit, message) for the first limit exceeded, else None."""
        if not self.limits:
            return None
        pids = [name for name in os.listdir("/proc") if name.isdigit() and name != "1"]
        processes = int(self.limits["processes"])
        # The kernel refuses the uid's process past the limit: reaching it is the sign.
        if len(pids) >= processes:
            return "processes", f"{processes} processes"
        memory = int(self.limits["memory_mib"])
        if sum(map(self._memory, pids)) > memory << 20:
            return "memory", f"{memory} MiB of memory"
        now = time.monotonic()
        if final or now - self.measured >= DISK_EVERY_S:
            self.measured = now
            disk = int(self.limits["disk_mib"])
            if sum(map(usage, self.paths)) > disk << 20:
                return "disk", f"{disk} MiB of files in {', '.join(self.paths)}"
        return None

    def _memory(self, pid):
        """A process's proportional share of memory (pages shared by a fork counted
        once), or its resident size where that is not reported."""
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
                for line in f:
                    if line.startswith(b"Pss:"):
                        return int(line.split()[1]) << 10
            with open(f"/proc/{pid}/statm", "rb") as f:
                return int(f.read().split()[1]) * self.page
        except (OSError, IndexError, ValueError):
            return 0  # gone meanwhile, or a zombie


def usage(path):
    """Bytes of the files under ``path`` (links not followed; each inode once)."""
    total, seen = 0, set()
    for folder, dirs, files in os.walk(path):
        for name in files + dirs:
            try:
                info = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            if (info.st_dev, info.st_ino) not in seen:
                seen.add((info.st_dev, info.st_ino))
                total += info.st_blocks * 512
    return total


class Output:
    """At most ``limit`` bytes of the command's output passed on to ``out_fd``: the head
    as it comes, then how much was left out, then the tail."""

    def __init__(self, limit, out_fd):
        self.head_left = limit // 2
        self.tail_size = limit - limit // 2
        self.tail = bytearray()
        self.dropped = 0
        self.out_fd = out_fd

    def take(self, chunk):
        head, rest = chunk[: self.head_left], chunk[self.head_left :]
        if head:
            _write_all(self.out_fd, head)
            self.head_left -= len(head)
        if rest:
            self.tail += rest
            extra = len(self.tail) - self.tail_size
            if extra > 0:
                del self.tail[:extra]
                self.dropped += extra

    def close(self):
        if self.dropped:
            note = f"\n[agl sandbox: {self.dropped} bytes of output left out]\n"
            _write_all(self.out_fd, note.encode())
        _write_all(self.out_fd, bytes(self.tail))


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BrokenPipeError:
            return


def supervise(child, pipe, watch, output):
    """Wait for ``child`` (pumping its output from ``pipe`` when there is one), ending
    the namespace when a limit is exceeded; answers (exit code, limit or None, message).
    Once the command has exited, output that pauses ``WATCH_S`` is all of it: what it
    left running would otherwise hold the pipe open, and it ends with the namespace."""
    ended = os.pidfd_open(child.pid)
    code = None
    while True:
        waiting = [ended] if code is None else []
        ready, _, _ = select.select(
            [*waiting, *([pipe] if pipe is not None else [])], [], [], WATCH_S
        )
        if pipe is not None:
            chunk = os.read(pipe, CHUNK) if pipe in ready else b""
            if chunk:
                output.take(chunk)
            elif pipe in ready or code is not None:
                os.close(pipe)
                pipe = None
        code = _reap(child.pid, code)
        found = watch.exceeded(final=code is not None)
        if found is not None:
            _kill_all()
            return LIMIT_EXIT, found[0], found[1]
        if code is not None and pipe is None:
            _kill_all()
            return code, None, None


def _reap(pid, code):
    """Reap every ended process (orphans of the namespace come to its init); the
    command's exit code once it has ended (128 + N for a signal N)."""
    while True:
        try:
            ended, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return code
        if ended == 0:
            return code
        if ended == pid:
            found = os.waitstatus_to_exitcode(status)
            code = 128 - found if found < 0 else found


def _kill_all():
    # From the init of a PID namespace, -1 is every other process in it.
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)


def run(spec):
    """The command, dropped to its user, to its end: (exit code, limit, message)."""
    user = []
    if spec.get("uid") is not None:
        user = [f"--reuid={spec['uid']}", f"--regid={spec['gid']}", "--clear-groups"]
    places = ("/usr/bin/setpriv", "/bin/setpriv", "/usr/sbin/setpriv", "/sbin/setpriv")
    setpriv = next((p for p in places if os.access(p, os.X_OK)), None)
    if setpriv is None:
        raise SetupError("setpriv (util-linux) is not in the sandbox")
    limits = spec.get("limits")
    pump = spec.get("output_limit")
    read_fd, write_fd = os.pipe() if pump else (None, None)
    # Signals sent to the group reach the command; this process only waits (a handler,
    # not SIG_IGN, which the command would inherit).
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(number, lambda *_: None)
    child = subprocess.Popen(
        [setpriv, *user, *DROP_PRIVILEGES, "--", *spec["argv"]],
        env=spec["env"],
        cwd=spec["cwd"],
        preexec_fn=_limit_child(limits),
        pass_fds=spec.get("pass_fds", ()),
        stdout=write_fd,
        stderr=write_fd,
    )
    # The command has its copies: the report key's pipe and the like end with it.
    for fd in (write_fd, *spec.get("pass_fds", ())):
        if fd is not None:
            os.close(fd)
    output = Output(int(pump), 1) if pump else None
    code, limit, message = supervise(
        child, read_fd, Watch(limits, spec.get("writable", [])), output
    )
    if output is not None:
        output.close()
    return code, limit, message


def main(argv):
    if len(argv) != 2 or not all(a.isdigit() for a in argv):
        sys.exit("usage: python -I -S entry.py SPEC_FD STATUS_FD")
    spec_fd, status_fd = map(int, argv)
    with os.fdopen(spec_fd, "rb") as f:
        spec = json.loads(f.read())
    os.set_inheritable(status_fd, False)
    with os.fdopen(status_fd, "w") as status:
        try:
            socket.sethostname(spec.get("hostname") or "sandbox")
            build(spec)
            code, limit, message = run(spec)
        except Exception as error:  # whatever it is, the status line says it
            text = f"agl sandbox: cannot set up: {error}"
            sys.stderr.write(text + "\n")
            status.write(json.dumps({"error": text}) + "\n")
            sys.exit(SETUP_FAILED)
        answer = {"exit": code}
        if limit is not None:
            answer.update(limit=limit, message=f"the sandbox's limit was reached: {message}")
            sys.stderr.write(f"agl sandbox: {answer['message']}\n")
        status.write(json.dumps(answer) + "\n")
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
