"""The seccomp profile for container sandboxes.

Docker's default profile (20.10) still allows ``io_uring``. Containers here also drop every
capability, run as uid 65534 with ``no-new-privileges``, so most privileged calls fail anyway;
this profile refuses, with EPERM, the syscalls that reach kernel attack surface without any
capability: io_uring, keyrings, bpf, perf events, userfaultfd, new namespaces, mounting,
ptrace and cross-process memory access, module and kexec loading. It also refuses, with
EAFNOSUPPORT, a socket of any address family but Unix, IPv4, IPv6 and netlink: the network
namespace isolates those, but not every family (AF_VSOCK reaches the hypervisor and shares the
VM's port space from inside any namespace).
"""

from __future__ import annotations

import errno
import json
import tempfile

import pyseccomp

DENIED = (
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen",
    "fsmount", "fspick", "mount_setattr",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "lookup_dcookie", "nfsservctl",
    "personality", "vhangup", "syslog",
)  # fmt: skip

# clone/clone3 with CLONE_NEWUSER (0x10000000) would create a user namespace; refused by flag.
_CLONE_NEWUSER = 0x10000000
# socket(domain, ...): the families a tool may open (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK); every
# other domain is refused, as the values between them and any from AF_PACKET (17) up. A domain
# with bits set above its 32 is past 17 as well (seccomp compares all 64).
_FAMILIES_KEPT = (1, 2, 10, 16)
_FAMILIES_REFUSED = tuple(family for family in range(17) if family not in _FAMILIES_KEPT)
_FIRST_FAMILY_PAST = 17
# socketpair creates its two sockets before it asks the family for a pair: it reaches each family too.
_SOCKET_CALLS = ("socket", "socketpair")


def docker_profile() -> str:
    """The profile as the JSON string Docker's ``seccomp=`` security option takes."""
    profile = {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": [
            {"names": list(DENIED), "action": "SCMP_ACT_ERRNO", "errnoRet": 1},
            {"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1,
             "args": [{"index": 0, "value": _CLONE_NEWUSER, "valueTwo": _CLONE_NEWUSER, "op": "SCMP_CMP_MASKED_EQ"}]},
            # clone3 passes flags in a struct seccomp cannot read: refuse it, libc falls back to clone.
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38},
            {"names": list(_SOCKET_CALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EAFNOSUPPORT,
             "args": [{"index": 0, "value": _FIRST_FAMILY_PAST, "op": "SCMP_CMP_GE"}]},
            *({"names": list(_SOCKET_CALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EAFNOSUPPORT,
               "args": [{"index": 0, "value": family, "op": "SCMP_CMP_EQ"}]} for family in _FAMILIES_REFUSED),
        ],
    }  # fmt: skip
    return json.dumps(profile, separators=(",", ":"))


def bpf_program() -> bytes:
    """The same refusals as a BPF program, for bubblewrap's ``--seccomp FD`` (built with
    pyseccomp over the system's libseccomp). Syscalls this libseccomp does not know are skipped."""
    seccomp_filter = pyseccomp.SyscallFilter(defaction=pyseccomp.ALLOW)
    for name in DENIED:
        try:
            seccomp_filter.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
        except OSError:
            continue  # not a syscall on this kernel's libseccomp
    seccomp_filter.add_rule(
        pyseccomp.ERRNO(errno.EPERM), "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, _CLONE_NEWUSER, _CLONE_NEWUSER)
    )
    seccomp_filter.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
    refused = pyseccomp.ERRNO(errno.EAFNOSUPPORT)
    for call in _SOCKET_CALLS:
        seccomp_filter.add_rule(refused, call, pyseccomp.Arg(0, pyseccomp.GE, _FIRST_FAMILY_PAST))
        for family in _FAMILIES_REFUSED:
            seccomp_filter.add_rule(refused, call, pyseccomp.Arg(0, pyseccomp.EQ, family))
    with tempfile.TemporaryFile() as handle:
        seccomp_filter.export_bpf(handle)
        handle.seek(0)
        return handle.read()
