//! Restoring a full snapshot with diffs on top, with both backends, checked
//! page by page against the expected RAM image.

mod common;

use std::sync::Arc;

use common::{layered, page, Rng};
use snapshot::{map_private, LayerStack, Page, Snapshot, UffdOptions, UffdRestore, PAGE_SIZE};

fn check_all(ptr: *const u8, ram: &[u8]) {
    let pages = (ram.len() / PAGE_SIZE) as u64;
    for pfn in 0..pages {
        // SAFETY: `ptr` maps `ram.len()` bytes that nothing writes during the check.
        let got =
            unsafe { std::slice::from_raw_parts(ptr.add(pfn as usize * PAGE_SIZE), PAGE_SIZE) };
        assert!(got == page(ram, pfn), "page {pfn} differs");
    }
}

#[test]
fn round_trip_of_a_chain_through_the_loader() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::seeded();
    let (top, ram) = layered(dir.path(), 2048, &mut rng);
    let chain = Snapshot::load_chain(&top).unwrap();
    assert_eq!(chain.len(), 3);
    assert_eq!(chain[0].state(), b"base state");
    assert_eq!(chain[2].state(), b"diff state");
    let stack = LayerStack::open(&chain).unwrap();
    for pfn in 0..stack.pages() {
        match stack.lookup(pfn) {
            Page::Zero => assert!(page(&ram, pfn).iter().all(|&b| b == 0), "page {pfn}"),
            Page::Data(d) => assert!(d == page(&ram, pfn), "page {pfn}"),
        }
    }
}

#[test]
fn diff_on_full_restores_the_later_state_with_mmap() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::seeded();
    let (top, ram) = layered(dir.path(), 4096, &mut rng);
    let stack = LayerStack::open(&Snapshot::load_chain(&top).unwrap()).unwrap();
    let m = map_private(&stack, ram.len() as u64).unwrap();
    drop(stack); // the mapping keeps its files
    eprintln!("{:?}", m.stats());
    check_all(m.as_ptr(), &ram);
    // A second restore is independent of writes to the first.
    // SAFETY: page 0 of a live private mapping only this test uses.
    unsafe { m.as_ptr().write_bytes(0xaa, PAGE_SIZE) };
    let stack = LayerStack::open(&Snapshot::load_chain(&top).unwrap()).unwrap();
    let m2 = map_private(&stack, ram.len() as u64).unwrap();
    check_all(m2.as_ptr(), &ram);
}

#[test]
fn diff_on_full_restores_the_later_state_with_uffd() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::seeded();
    let (top, ram) = layered(dir.path(), 4096, &mut rng);
    let stack = Arc::new(LayerStack::open(&Snapshot::load_chain(&top).unwrap()).unwrap());
    let r = UffdRestore::start(stack, ram.len() as u64, UffdOptions::default()).unwrap();
    // Fault from another thread, then check everything.
    let addr = r.as_ptr() as usize;
    let ram = Arc::new(ram);
    let ram2 = ram.clone();
    std::thread::spawn(move || check_all(addr as *const u8, &ram2))
        .join()
        .unwrap();
    // Stopping joins the server, so its counters are final.
    r.stop();
    let st = r.stats();
    assert_eq!(st.populated, st.pages);
    assert!(st.zero_pages > 0 && st.copied_pages > 0, "{st:?}");
    assert!(!st.failed_closed);
    check_all(r.as_ptr(), &ram);
}
