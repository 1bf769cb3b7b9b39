//! The syscalls each thread kind of a jailed worker may make.
//!
//! Found by running every worker path (boot, pause/resume, full and diff
//! snapshots, fork layers written and restored, mmap and uffd restores into
//! a ready shell, metrics, mailbox, vsock traffic, stop) under these filters
//! with the trap action: a missing syscall ends the worker with a message
//! naming its thread kind and syscall (see `seccomp.rs`). To add one, put it
//! in the list of the thread kind the message names (or in [`COMMON`] if
//! every kind needs it) and say in a comment which path needs it.
//!
//! Filters stack and a new thread inherits its creator's: the owner thread
//! creates the vCPU, event-loop, uffd and exit-watch threads after its own
//! filter is in place, so the owner's filter is the union of every kind's
//! (see [`owner`]); each of those threads then narrows itself to its own.

use libc::c_long;

/// Every thread: memory allocation, locks and channels, the SIGSYS message
/// and exit, thread exit (its stack and signal stack unmapped), logging.
pub const COMMON: &[c_long] = &[
    libc::SYS_futex,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigprocmask,
    libc::SYS_sigaltstack,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_brk,
    libc::SYS_sched_yield,
    libc::SYS_getrandom,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_close,
    // Seen as vCPU and uffd threads end at stop (a descriptor checked or
    // duplicated while dropping what the thread held).
    libc::SYS_fcntl,
];

/// `sprout-vcpuN`: KVM_RUN and the vCPU state it reads for a snapshot
/// (ioctl: those request numbers only, `ioctls::VCPU`), the exits it handles
/// (serial console writes, eventfd notifications).
pub const VCPU: &[c_long] = &[
    libc::SYS_ioctl,
    // Needed from boot on (refused, the first boot fails): device reads
    // done in the exit handlers.
    libc::SYS_read,
];

/// `sprout-events`: epoll, block I/O on the disk images and tops, the vsock
/// Unix sockets, eventfds.
pub const EVENTS: &[c_long] = &[
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_ctl,
    libc::SYS_read,
    libc::SYS_readv,
    libc::SYS_pread64,
    libc::SYS_preadv,
    libc::SYS_pwrite64,
    libc::SYS_pwritev,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_lseek,
    libc::SYS_fcntl,
    libc::SYS_accept4,
    libc::SYS_connect,
    libc::SYS_socket,
    libc::SYS_recvfrom,
    libc::SYS_recvmsg,
    libc::SYS_sendto,
    libc::SYS_sendmsg,
    libc::SYS_shutdown,
    libc::SYS_unlink,
    // FIONBIO on accepted vsock connections (`ioctls::SOCKETS`).
    libc::SYS_ioctl,
    // The devices' rate and retry timers.
    libc::SYS_timerfd_settime,
    libc::SYS_timerfd_gettime,
];

/// `sprout-uffd`: reads the faults off the userfaultfd, answers them with
/// UFFDIO_COPY/ZEROPAGE/WAKE and unregisters guest RAM as it ends (ioctl:
/// those request numbers only, `ioctls::UFFD`), reads pages from the layer
/// files.
pub const UFFD: &[c_long] = &[
    libc::SYS_ioctl,
    libc::SYS_read,
    libc::SYS_pread64,
    libc::SYS_poll,
    libc::SYS_ppoll,
];

/// `sprout-ctl`, `sprout-conn` (created by `sprout-ctl`, so they start under
/// its filter and keep it) and `sprout-exitwatch`: accept, frames in and
/// out, starting a connection thread.
pub const CONTROL: &[c_long] = &[
    libc::SYS_accept4,
    libc::SYS_read,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_poll,
    libc::SYS_fcntl,
    libc::SYS_ioctl,
    // Starting a connection thread: clone3 (or clone), then in the new
    // thread its robust list, rseq, name and signal stack.
    libc::SYS_clone3,
    libc::SYS_clone,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_prctl,
    libc::SYS_sched_getaffinity,
];

/// The owner (main) thread's own needs: building, restoring, snapshotting
/// and stopping VMs (files, mappings, KVM and uffd ioctls, leases),
/// starting the VM's threads and their filters, signalling vCPUs, metrics.
const OWNER_OWN: &[c_long] = &[
    libc::SYS_openat,
    libc::SYS_open,
    libc::SYS_read,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_lseek,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_stat,
    libc::SYS_lstat,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_rmdir,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_getdents64,
    libc::SYS_flock,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_ftruncate,
    libc::SYS_fallocate,
    libc::SYS_eventfd2,
    libc::SYS_timerfd_create,
    libc::SYS_epoll_create1,
    // Resolving /proc/self/fd links (fd counts, image paths).
    libc::SYS_readlink,
    libc::SYS_epoll_ctl,
    libc::SYS_fcntl,
    libc::SYS_ioctl,
    libc::SYS_socket,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_connect,
    libc::SYS_tgkill,
    libc::SYS_rt_sigaction,
    // Each new thread installs its filter.
    libc::SYS_seccomp,
    libc::SYS_prctl,
    // A restore's check of a snapshot's seal: whose it may trust.
    libc::SYS_geteuid,
    // A boot's debug log counts its page faults per step (RUSAGE_SELF).
    libc::SYS_getrusage,
];

/// The owner's filter: its own calls and every kind of thread it creates
/// (which inherit it).
pub fn owner() -> Vec<c_long> {
    let mut v: Vec<c_long> = [OWNER_OWN, VCPU, EVENTS, UFFD, CONTROL].concat();
    v.sort_unstable();
    v.dedup();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The owner's children inherit its filter: each kind's calls must
    /// pass it, or that kind could never run them.
    #[test]
    fn the_owner_allows_what_every_kind_it_starts_needs() {
        let owner = owner();
        for (kind, list) in [
            ("vcpu", VCPU),
            ("events", EVENTS),
            ("uffd", UFFD),
            ("control", CONTROL),
        ] {
            for nr in list {
                assert!(
                    owner.contains(nr),
                    "{kind}: syscall {nr} not in the owner's filter"
                );
            }
        }
        // Starting and confining a child.
        for nr in [libc::SYS_clone3, libc::SYS_seccomp, libc::SYS_prctl] {
            assert!(owner.contains(&nr));
        }
    }

    #[test]
    fn the_test_syscall_is_in_no_list() {
        let all = [COMMON, VCPU, EVENTS, UFFD, CONTROL, OWNER_OWN].concat();
        assert!(!all.contains(&libc::SYS_getppid));
    }
}
