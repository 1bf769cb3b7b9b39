//! Guest reset ends the VM, and a VM's teardown leaves no thread or file
//! descriptor behind. Alone in its test binary: it counts process-wide.

use guest_abi::mailbox as mb;
use sprout_tests::{boot, config, fd_count, thread_count, TIMEOUT};
use vmm::ExitReason;

#[test]
fn guest_reset_ends_the_vm_without_leaks() {
    // Warm up once so lazily created process-wide state (signal handler, KVM
    // module state, allocator arenas) is not counted as a leak.
    {
        let (cfg, console) = config(2, 128);
        let vm = boot(cfg, &console);
        drop(vm);
    }
    let fds = fd_count();
    let threads = thread_count();
    for _ in 0..3 {
        let (cfg, console) = config(2, 128);
        let vm = boot(cfg, &console);
        vm.mailbox()
            .unwrap()
            .call(
                0,
                mb::CMD_RESET,
                [0; 4],
                std::time::Duration::from_millis(1),
            )
            .ok();
        assert_eq!(vm.wait(Some(TIMEOUT)), Some(ExitReason::Reset));
        drop(vm);
    }
    assert_eq!(fd_count(), fds, "file descriptors leaked");
    assert_eq!(thread_count(), threads, "threads leaked");
}
