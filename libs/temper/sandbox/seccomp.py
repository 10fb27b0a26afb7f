"""The system-call filter every bwrap sandbox runs under (docs/sandbox.md, "System calls").

Built once per worker on the host with libseccomp (through ctypes: ``libseccomp.so.2``
ships with Debian's ``libseccomp2``, which apt itself depends on) and handed to bubblewrap
as a BPF program (``bwrap --seccomp FD``), which installs it just before it execs the
sandbox's agent. Every process of the sandbox inherits it: a zygote's runs, a session's
actions, the task's services. A filter cannot be removed or loosened by the processes
under it (another one can only add refusals).

Refused calls fail with ``EPERM``; the program sees an ordinary error and goes on. So do
calls of the i386 (``int 0x80``) and x32 ABIs: the filter knows only x86_64's numbers, and
another ABI's numbers would mean other calls.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

# Refused calls, by why. Names libseccomp does not know on this architecture are skipped.
REFUSED: dict[str, tuple[str, ...]] = {
    # Keyrings are kernel state per host uid, not per namespace: every sandbox runs as
    # the same uid, so keys, and the key quota, would be shared between tenants.
    "keyrings": ("add_key", "keyctl", "request_key"),
    # Large kernel surfaces with a record of privilege escalations, which no task needs.
    "kernel surface": (
        "bpf",
        "perf_event_open",
        "userfaultfd",
        "io_uring_setup",
        "io_uring_enter",
        "io_uring_register",
    ),
    # Loading, removing or replacing kernel code.
    "kernel code": (
        "init_module",
        "finit_module",
        "delete_module",
        "create_module",
        "query_module",
        "get_kernel_syms",
        "kexec_load",
        "kexec_file_load",
    ),
    # Reading or changing another process (the agent, the run's init).
    "other processes": ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp"),
    # Host administration: refused without capabilities already; here before the kernel
    # looks at them.
    "host administration": (
        "acct",
        "swapon",
        "swapoff",
        "reboot",
        "settimeofday",
        "clock_settime",
        "clock_adjtime",
        "adjtimex",
        "syslog",
        "iopl",
        "ioperm",
        "quotactl",
        "lookup_dcookie",
        "open_by_handle_at",
        "nfsservctl",
        "uselib",
        "vhangup",
    ),
}

_ACT_ALLOW = 0x7FFF0000
_ACT_ERRNO = 0x00050000
_ATTR_ACT_BADARCH = 2  # the action for a call of an ABI the filter does not list


class SeccompUnavailable(RuntimeError):
    """libseccomp cannot be loaded or refused to build the filter."""


def _libseccomp() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError as e:
        raise SeccompUnavailable(
            f"libseccomp.so.2 not found ({e}): install Debian's libseccomp2 (scripts/setup_system.sh run)"
        ) from e
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def refused_calls() -> list[str]:
    return [name for names in REFUSED.values() for name in names]


def build_filter() -> bytes:
    """The filter as a BPF program (what ``bwrap --seccomp`` reads): every call allowed
    but the refused ones, which fail with EPERM, as does any call of another ABI."""
    if platform.machine() != "x86_64":
        raise SeccompUnavailable(f"the sandbox filter is written for x86_64, not {platform.machine()}")
    lib = _libseccomp()
    refuse = _ACT_ERRNO | errno.EPERM
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if not ctx:
        raise SeccompUnavailable("seccomp_init failed")
    try:
        if lib.seccomp_attr_set(ctx, _ATTR_ACT_BADARCH, refuse) != 0:
            raise SeccompUnavailable("libseccomp refused EPERM as the action for other ABIs")
        for name in refused_calls():
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                continue  # unknown, or not a call of this architecture (a pseudo number)
            rc = lib.seccomp_rule_add(ctx, refuse, nr, 0)
            if rc != 0:
                raise SeccompUnavailable(f"seccomp_rule_add({name}) failed: {os.strerror(-rc)}")
        read, write = os.pipe()
        try:
            rc = lib.seccomp_export_bpf(ctx, write)
            os.close(write)
            write = -1
            if rc != 0:
                raise SeccompUnavailable(f"seccomp_export_bpf failed: {os.strerror(-rc)}")
            program = b""
            while chunk := os.read(read, 1 << 16):
                program += chunk
        finally:
            os.close(read)
            if write >= 0:
                os.close(write)
    finally:
        lib.seccomp_release(ctx)
    if not program or len(program) % 8:
        raise SeccompUnavailable(f"libseccomp exported {len(program)} bytes, not a BPF program")
    return program
