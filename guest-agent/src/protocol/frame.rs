//! The frame: header layout, encoding, and an incremental decoder that bounds every
//! length before it waits for or allocates the bytes.

use super::{Message, ProtocolError, HEADER_LEN, MAGIC, MAX_PAYLOAD, VERSION};

/// The fixed header in front of every payload (little endian):
///
/// | offset | size | field |
/// | --- | --- | --- |
/// | 0 | 4 | magic `SPAG` |
/// | 4 | 2 | version |
/// | 6 | 2 | kind |
/// | 8 | 8 | request id |
/// | 16 | 4 | payload length |
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: u16,
    pub request_id: u64,
    pub len: u32,
}

impl Header {
    /// Parses and checks a header: magic, then version, then the length bound. The
    /// payload length is known to be at most [`MAX_PAYLOAD`] once this returns.
    pub fn parse(b: &[u8; HEADER_LEN]) -> Result<Header, ProtocolError> {
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(ProtocolError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(ProtocolError::UnsupportedVersion { got: version });
        }
        let kind = u16::from_le_bytes([b[6], b[7]]);
        let mut id = [0u8; 8];
        id.copy_from_slice(&b[8..16]);
        let len = u32::from_le_bytes([b[16], b[17], b[18], b[19]]);
        if len > MAX_PAYLOAD {
            return Err(ProtocolError::TooLarge {
                len: u64::from(len),
            });
        }
        Ok(Header {
            kind,
            request_id: u64::from_le_bytes(id),
            len,
        })
    }

    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&self.kind.to_le_bytes());
        b[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        b[16..20].copy_from_slice(&self.len.to_le_bytes());
        b
    }
}

/// A decoded frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub request_id: u64,
    pub msg: Message,
}

/// Appends the frame for `msg` to `out`. A payload over [`MAX_PAYLOAD`] fails with
/// [`ProtocolError::TooLarge`] and leaves `out` as it was; an encoding failure (which
/// the protocol's own types never cause) leaves it empty.
pub fn encode_into(out: &mut Vec<u8>, request_id: u64, msg: &Message) -> Result<(), ProtocolError> {
    let start = out.len();
    out.extend_from_slice(&[0u8; HEADER_LEN]);
    let mut buf = msg.encode_payload(std::mem::take(out))?;
    let len = buf.len() - start - HEADER_LEN;
    if len > MAX_PAYLOAD as usize {
        buf.truncate(start);
        *out = buf;
        return Err(ProtocolError::TooLarge { len: len as u64 });
    }
    let hdr = Header {
        kind: msg.kind(),
        request_id,
        len: len as u32,
    };
    buf[start..start + HEADER_LEN].copy_from_slice(&hdr.to_bytes());
    *out = buf;
    Ok(())
}

/// The frame for `msg`.
pub fn encode(request_id: u64, msg: &Message) -> Result<Vec<u8>, ProtocolError> {
    let mut out = Vec::new();
    encode_into(&mut out, request_id, msg)?;
    Ok(out)
}

/// Decodes the payload of a frame whose header is `hdr`.
pub fn decode_message(hdr: &Header, payload: &[u8]) -> Result<Message, ProtocolError> {
    Message::decode_payload(hdr.kind, payload)
}

/// Decodes the first frame in `buf`. `Ok(None)` means more bytes are needed; the header
/// is checked as soon as its [`HEADER_LEN`] bytes are there, so a bad magic, another
/// version or an oversized length claim fails before any payload arrives. On success,
/// returns the frame and how many bytes of `buf` it used.
///
/// An error in the header leaves the stream unusable (its frame boundaries are lost); an
/// error in the payload ([`ProtocolError::UnknownKind`], [`ProtocolError::Payload`],
/// [`ProtocolError::TrailingBytes`]) concerns that frame only, which is
/// `HEADER_LEN + len` bytes long: see [`Header::parse`] to skip it.
pub fn decode(buf: &[u8]) -> Result<Option<(Frame, usize)>, ProtocolError> {
    let Some(raw) = buf.first_chunk::<HEADER_LEN>() else {
        return Ok(None);
    };
    let hdr = Header::parse(raw)?;
    let total = HEADER_LEN + hdr.len as usize;
    let Some(payload) = buf.get(HEADER_LEN..total) else {
        return Ok(None);
    };
    let msg = decode_message(&hdr, payload)?;
    Ok(Some((
        Frame {
            request_id: hdr.request_id,
            msg,
        },
        total,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::*;

    fn sample() -> Vec<(u64, Message)> {
        vec![
            (1, Ping {}.into()),
            (
                2,
                Exec {
                    command: "sh".into(),
                    argv: vec!["-c".into(), "echo $A".into()],
                    env: vec![("A".into(), "b".into())],
                    cwd: Some("sub".into()),
                    user: Some(User { uid: 1, gid: 2 }),
                    stdin: StdinMode::Bytes(Bytes::from(vec![0, 159, 255])),
                    timeout_ms: Some(5),
                    output_limit: Some(10),
                    background: true,
                    ..Exec::default()
                }
                .into(),
            ),
            (
                u64::MAX,
                Output {
                    stream: StreamKind::Stderr,
                    data: Bytes::from(vec![0xff; 300]),
                }
                .into(),
            ),
            (
                4,
                Exit {
                    code: None,
                    signal: Some(9),
                    timed_out: true,
                    ..Exit::default()
                }
                .into(),
            ),
            (5, ErrorMsg::new(ErrorCode::PathEscape, "no").into()),
            (
                6,
                Entries {
                    entries: vec![FileInfo {
                        name: "a".into(),
                        raw_name: None,
                        kind: FileKind::Dir,
                        size: 4096,
                        mode: 0o755,
                        mtime_sec: -1,
                        mtime_nsec: 999_999_999,
                    }],
                    more: true,
                }
                .into(),
            ),
            (7, WriteEnd {}.into()),
            (
                8,
                Attach {
                    exec_id: 3,
                    after_seq: Some(41),
                }
                .into(),
            ),
            (
                9,
                ProcStdin {
                    exec_id: 3,
                    data: Bytes::from(vec![1, 2]),
                    close: true,
                }
                .into(),
            ),
            (
                10,
                ProcOutput {
                    seq: 42,
                    stream: StreamKind::Stdout,
                    data: Bytes::from(b"hi".to_vec()),
                }
                .into(),
            ),
            (
                10,
                Gap {
                    first_seq: 1,
                    last_seq: 40,
                    bytes: Some(1 << 20),
                }
                .into(),
            ),
            (
                10,
                ProcExit {
                    seq: 43,
                    exit: Exit {
                        code: Some(0),
                        ..Exit::default()
                    },
                }
                .into(),
            ),
            (
                11,
                Procs {
                    procs: vec![ProcInfo {
                        exec_id: 3,
                        pid: 77,
                        command: "sleep 1".into(),
                        running: true,
                        next_seq: 1,
                        ..ProcInfo::default()
                    }],
                    more: false,
                }
                .into(),
            ),
            (
                12,
                NetConfigure {
                    mac: [0x02, 0, 0, 0, 0, 1],
                    address: [10, 0, 0, 2],
                    prefix_len: 24,
                    gateway: Some([10, 0, 0, 1]),
                    dns: vec![[10, 0, 0, 1], [1, 1, 1, 1]],
                    interface: Some("eth0".into()),
                }
                .into(),
            ),
            (
                12,
                NetConfigured {
                    interface: "eth0".into(),
                }
                .into(),
            ),
            (
                13,
                IdentityAs {
                    identity: Identity {
                        instance_id: "sprout-1".into(),
                        unix_time_ns: 7,
                        entropy: Bytes::from(vec![9; 64]),
                        hostname: Some("box".into()),
                    },
                    machine_id: "0123456789abcdef0123456789abcdef".into(),
                }
                .into(),
            ),
        ]
    }

    #[test]
    fn round_trip_one_by_one_and_concatenated() {
        let mut stream = Vec::new();
        for (id, msg) in sample() {
            let bytes = encode(id, &msg).unwrap();
            let (frame, used) = decode(&bytes).unwrap().unwrap();
            assert_eq!(used, bytes.len());
            assert_eq!(
                frame,
                Frame {
                    request_id: id,
                    msg
                }
            );
            stream.extend_from_slice(&bytes);
        }
        let mut at = 0;
        let mut got = Vec::new();
        while let Some((frame, used)) = decode(&stream[at..]).unwrap() {
            got.push((frame.request_id, frame.msg));
            at += used;
        }
        assert_eq!(at, stream.len());
        assert_eq!(got, sample());
    }

    #[test]
    fn header_layout() {
        let bytes = encode(0x0102_0304_0506_0708, &Ping {}.into()).unwrap();
        assert_eq!(bytes.len(), HEADER_LEN);
        assert_eq!(&bytes[0..4], b"SPAG");
        assert_eq!(&bytes[4..6], &VERSION.to_le_bytes());
        assert_eq!(&bytes[6..8], &kind::Ping.to_le_bytes());
        assert_eq!(&bytes[8..16], &0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(&bytes[16..20], &0u32.to_le_bytes());
    }

    #[test]
    fn truncated_frames_ask_for_more() {
        let msg: Message = ReadData {
            data: Bytes::from(vec![7; 1000]),
        }
        .into();
        let bytes = encode(3, &msg).unwrap();
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut]).unwrap().is_none(), "cut at {cut}");
        }
        assert!(decode(&bytes).unwrap().is_some());
    }

    #[test]
    fn payload_cut_inside_is_malformed() {
        // A header that claims fewer bytes than the message needs: the payload is short.
        let bytes = encode(
            3,
            &List {
                path: "abcdef".into(),
            }
            .into(),
        )
        .unwrap();
        let mut hdr = Header::parse(bytes.first_chunk().unwrap()).unwrap();
        hdr.len -= 2;
        let mut short = hdr.to_bytes().to_vec();
        short.extend_from_slice(&bytes[HEADER_LEN..bytes.len() - 2]);
        assert!(matches!(
            decode(&short),
            Err(ProtocolError::Payload {
                kind: kind::List,
                ..
            })
        ));
        // And one that claims more: trailing bytes are refused.
        hdr.len += 3;
        let mut long = hdr.to_bytes().to_vec();
        long.extend_from_slice(&bytes[HEADER_LEN..]);
        long.push(0);
        assert!(matches!(
            decode(&long),
            Err(ProtocolError::TrailingBytes { extra: 1, .. })
        ));
    }

    #[test]
    fn unknown_version_is_refused_with_a_clear_error() {
        // Version 1 (an agent or host from before background processes) and a later one.
        for other in [1u16, VERSION + 1] {
            let mut bytes = encode(1, &Ping {}.into()).unwrap();
            bytes[4..6].copy_from_slice(&other.to_le_bytes());
            let e = decode(&bytes).unwrap_err();
            assert!(matches!(e, ProtocolError::UnsupportedVersion { got } if got == other));
            assert_eq!(
                e.to_string(),
                format!("Unsupported protocol version {other}: this side speaks version 2")
            );
        }
    }

    #[test]
    fn bad_magic_is_refused() {
        let mut bytes = encode(1, &Ping {}.into()).unwrap();
        bytes[0] = b'X';
        assert!(matches!(
            decode(&bytes),
            Err(ProtocolError::BadMagic(m)) if &m == b"XPAG"
        ));
    }

    #[test]
    fn four_gib_length_claim_is_refused_from_the_header_alone() {
        let hdr = Header {
            kind: kind::WriteData,
            request_id: 1,
            len: 0,
        };
        let mut raw = hdr.to_bytes();
        raw[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        // Only the 20 header bytes exist: the decoder must not wait for (or allocate)
        // 4 GiB before refusing.
        assert!(matches!(
            decode(&raw),
            Err(ProtocolError::TooLarge { len }) if len == u64::from(u32::MAX)
        ));
        // One byte over the bound is refused too; the bound itself is fine.
        raw[16..20].copy_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes());
        assert!(matches!(decode(&raw), Err(ProtocolError::TooLarge { .. })));
        raw[16..20].copy_from_slice(&MAX_PAYLOAD.to_le_bytes());
        assert!(decode(&raw).unwrap().is_none());
    }

    #[test]
    fn oversized_vec_claim_inside_payload_fails_without_allocating() {
        // A Vec<String> (argv) whose length prefix claims u32::MAX elements in a tiny payload.
        let mut payload = vec![0u8]; // empty command string
        payload.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x0f]); // varint u32::MAX
        let hdr = Header {
            kind: kind::Exec,
            request_id: 1,
            len: payload.len() as u32,
        };
        let mut raw = hdr.to_bytes().to_vec();
        raw.extend_from_slice(&payload);
        assert!(matches!(
            decode(&raw),
            Err(ProtocolError::Payload {
                kind: kind::Exec,
                ..
            })
        ));
    }

    #[test]
    fn unknown_kind_is_refused() {
        let hdr = Header {
            kind: 0x7777,
            request_id: 9,
            len: 0,
        };
        assert!(matches!(
            decode(&hdr.to_bytes()),
            Err(ProtocolError::UnknownKind(0x7777))
        ));
    }

    #[test]
    fn encoding_over_the_bound_fails_and_keeps_the_buffer() {
        let mut out = b"keep".to_vec();
        let msg: Message = WriteData {
            data: Bytes::from(vec![0; MAX_PAYLOAD as usize]),
        }
        .into();
        assert!(matches!(
            encode_into(&mut out, 1, &msg),
            Err(ProtocolError::TooLarge { .. })
        ));
        assert_eq!(out, b"keep");
        let ok: Message = WriteData {
            data: Bytes::from(vec![0; MAX_CHUNK]),
        }
        .into();
        encode_into(&mut out, 1, &ok).unwrap();
        assert_eq!(&out[..4], b"keep");
        assert!(decode(&out[4..]).unwrap().is_some());
    }
}
