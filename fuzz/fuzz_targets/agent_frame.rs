//! The agent's frame decoder on arbitrary bytes: a stream of frames as a hostile peer
//! could send. It must never panic, never accept more than a frame's bounded length,
//! and whatever it accepts must re-encode to a frame that decodes to the same message.

#![no_main]

use guest_agent::protocol::{self, Header, ProtocolError, HEADER_LEN, MAX_PAYLOAD};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut at = 0;
    while at < data.len() {
        match protocol::decode(&data[at..]) {
            Ok(Some((frame, used))) => {
                assert!((HEADER_LEN..=HEADER_LEN + MAX_PAYLOAD as usize).contains(&used));
                let again = protocol::encode(frame.request_id, &frame.msg).expect("re-encode");
                let (back, n) = protocol::decode(&again).expect("decode").expect("whole");
                assert_eq!(n, again.len());
                assert_eq!(back, frame);
                at += used;
            }
            Ok(None) => break,
            Err(
                ProtocolError::UnknownKind(_)
                | ProtocolError::Payload { .. }
                | ProtocolError::TrailingBytes { .. },
            ) => {
                // A well-framed bad frame: skip it, as the agent does.
                let raw = data[at..]
                    .first_chunk::<HEADER_LEN>()
                    .expect("header was read");
                let hdr = Header::parse(raw).expect("header was valid");
                at += HEADER_LEN + hdr.len as usize;
            }
            Err(_) => break,
        }
    }
});
