//! The worker control protocol on arbitrary bytes, as a hostile peer on the control
//! socket could send them: a stream of frames read as requests (the worker's side) or
//! as responses (the client's side), its first header on its own, and the bytes as a
//! bare payload.
//!
//! Nothing may panic; whatever is accepted re-encodes to a frame, no longer than the
//! one read, that decodes to the same message; a header announcing more than
//! MAX_FRAME is refused before anything of that size is allocated or read.
//!
//! Byte 0 picks the side (bit 0: responses); the rest is the stream.

#![no_main]

use std::alloc::{GlobalAlloc, Layout, System};
use std::fmt::Debug;
use std::io::{self, Cursor, Read};
use std::sync::atomic::{AtomicUsize, Ordering};

use libfuzzer_sys::fuzz_target;
use serde::de::DeserializeOwned;
use serde::Serialize;
use sprout_worker::protocol::{
    decode, encode, parse_header, read_frame, FrameError, Request, Response, HEADER_LEN, MAX_FRAME,
};

/// The system allocator, noting the largest single allocation since the last reset.
struct Largest;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every method forwards to the system allocator unchanged; the only
// addition is an atomic maximum, which allocates nothing.
unsafe impl GlobalAlloc for Largest {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LARGEST.fetch_max(l.size(), Ordering::Relaxed);
        // SAFETY: forwarded as is.
        unsafe { System.alloc(l) }
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        LARGEST.fetch_max(l.size(), Ordering::Relaxed);
        // SAFETY: forwarded as is.
        unsafe { System.alloc_zeroed(l) }
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: forwarded as is.
        unsafe { System.dealloc(p, l) }
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LARGEST.fetch_max(new, Ordering::Relaxed);
        // SAFETY: forwarded as is.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Largest = Largest;

/// A peer that sends one header and then nothing: reading past it is a bug.
struct HeaderOnly<'a>(&'a [u8]);

impl Read for HeaderOnly<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        assert!(
            !self.0.is_empty(),
            "read past a header announcing more than MAX_FRAME"
        );
        let n = buf.len().min(self.0.len());
        buf[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        Ok(n)
    }
}

/// Reads frames from `data` until the stream ends or a frame is refused, as a
/// connection does; checks every message read.
fn stream<T: Serialize + DeserializeOwned + PartialEq + Debug>(data: &[u8]) {
    let mut r = Cursor::new(data);
    loop {
        let at = r.position() as usize;
        match read_frame::<T>(&mut r) {
            Ok(Some(msg)) => {
                let used = r.position() as usize - at;
                assert!((HEADER_LEN..=HEADER_LEN + MAX_FRAME).contains(&used));
                let again = encode(&msg).expect("an accepted message re-encodes");
                // Postcard's own encoding is the shortest (varints are minimal).
                assert!(again.len() <= used, "{} > {used}", again.len());
                let back = read_frame::<T>(&mut again.as_slice())
                    .expect("a re-encoded frame decodes")
                    .expect("a whole frame");
                assert_eq!(back, msg);
                let len = parse_header(again.first_chunk().expect("header")).expect("header");
                assert_eq!(len, again.len() - HEADER_LEN);
            }
            Ok(None) => {
                assert_eq!(at, data.len());
                break;
            }
            Err(_) => break,
        }
    }
}

/// The first header on its own: checked, and refused early if oversized.
fn header(data: &[u8]) {
    let Some(h) = data.first_chunk::<HEADER_LEN>() else {
        return;
    };
    let announced = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
    match parse_header(h) {
        Ok(len) => {
            assert_eq!(len, announced);
            assert!(len <= MAX_FRAME);
        }
        Err(FrameError::TooLarge(n)) => {
            assert_eq!(n, announced as u64);
            assert!(announced > MAX_FRAME);
            LARGEST.store(0, Ordering::Relaxed);
            let e = read_frame::<Request>(&mut HeaderOnly(h)).expect_err("oversized frame");
            assert!(matches!(e, FrameError::TooLarge(_)), "{e:?}");
            let largest = LARGEST.load(Ordering::Relaxed);
            assert!(
                largest < 4096,
                "{largest}-byte allocation for a refused frame"
            );
        }
        Err(FrameError::BadMagic(_) | FrameError::Version(_)) => {}
        Err(e) => panic!("header refused with {e:?}"),
    }
}

/// The bytes as a bare payload: what decodes re-encodes to the same bytes (a payload
/// that decodes without trailing bytes is a canonical one or a longer spelling of it).
fn payload<T: Serialize + DeserializeOwned + PartialEq + Debug>(data: &[u8]) {
    if let Ok(msg) = decode::<T>(data) {
        let again = encode(&msg).expect("re-encode");
        assert!(again.len() - HEADER_LEN <= data.len());
        assert_eq!(decode::<T>(&again[HEADER_LEN..]).expect("decode"), msg);
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&side, rest)) = data.split_first() else {
        return;
    };
    if side & 1 == 0 {
        stream::<Request>(rest);
        payload::<Request>(rest);
    } else {
        stream::<Response>(rest);
        payload::<Response>(rest);
    }
    header(rest);
});
