//! WebSocket frame boundaries (RFC 6455 section 5.2), followed as a tunnel forwards bytes, so
//! that the close-spread window can end a WebSocket between two frames with a Close frame of
//! its own: status 1001 (going away) to the client, and a masked one, as a client sends it, to
//! the app.
//!
//! Only frame heads are read (two to fourteen bytes each); payloads are counted, never looked
//! at or copied, so following a tunnel costs a few instructions per frame.

use std::hash::{BuildHasher, Hasher};

/// "Going away" (RFC 6455 section 7.4.1): the endpoint is going down.
const GOING_AWAY: u16 = 1001;
/// The reason sent with it.
const REASON: &[u8] = b"proxy shutting down";
const OPCODE_CLOSE: u8 = 0x8;

/// Where one direction of a WebSocket stands: in a frame's head, in its payload, or between two
/// frames.
#[derive(Clone, Copy, Debug, Default)]
pub struct Frames {
    /// The head of the frame being read, as far as it has come.
    head: [u8; 14],
    head_len: u8,
    /// Payload bytes of the current frame still to come, once its head is whole.
    payload_left: u64,
    in_payload: bool,
    opcode: u8,
    /// A whole Close frame has gone this way.
    closed: bool,
}

impl Frames {
    /// Between two frames: a frame of the proxy's own may go here.
    pub fn at_boundary(&self) -> bool {
        !self.in_payload && self.head_len == 0
    }

    /// Whether a whole Close frame has gone this way.
    pub fn closed(&self) -> bool {
        self.closed
    }

    /// Follows `bytes`, the next ones of this direction. With `to_boundary`, stops at the first
    /// frame boundary reached after at least one byte (or at once when `bytes` is empty) and
    /// returns how many bytes come before it; otherwise follows them all and returns their
    /// length.
    pub fn follow(&mut self, bytes: &[u8], to_boundary: bool) -> usize {
        let mut at = 0;
        while at < bytes.len() {
            if self.in_payload {
                let take = usize::try_from(self.payload_left)
                    .unwrap_or(usize::MAX)
                    .min(bytes.len() - at);
                at += take;
                self.payload_left -= take as u64;
                if self.payload_left > 0 {
                    break;
                }
                self.frame_done();
                if to_boundary {
                    return at;
                }
                continue;
            }
            self.head[usize::from(self.head_len)] = bytes[at];
            self.head_len += 1;
            at += 1;
            if let Some(payload) = self.head_complete() {
                self.opcode = self.head[0] & 0x0f;
                self.head_len = 0;
                self.payload_left = payload;
                self.in_payload = true;
                if payload == 0 {
                    self.frame_done();
                    if to_boundary {
                        return at;
                    }
                }
            }
        }
        at
    }

    fn frame_done(&mut self) {
        self.in_payload = false;
        if self.opcode == OPCODE_CLOSE {
            self.closed = true;
        }
    }

    /// The payload length, once the head read so far is whole.
    fn head_complete(&self) -> Option<u64> {
        let len = usize::from(self.head_len);
        if len < 2 {
            return None;
        }
        let short = self.head[1] & 0x7f;
        let extended = match short {
            126 => 2,
            127 => 8,
            _ => 0,
        };
        let mask = if self.head[1] & 0x80 != 0 { 4 } else { 0 };
        if len < 2 + extended + mask {
            return None;
        }
        Some(match extended {
            0 => u64::from(short),
            2 => u64::from(u16::from_be_bytes([self.head[2], self.head[3]])),
            // The most significant bit must be 0 (RFC 6455 section 5.2); a peer that sets it
            // only makes the frame longer.
            _ => u64::from_be_bytes(self.head[2..10].try_into().expect("8 bytes")),
        })
    }
}

/// A Close frame, status 1001, as a server sends it (unmasked).
pub fn close_frame_to_client() -> Vec<u8> {
    let mut frame = vec![0x80 | OPCODE_CLOSE, (2 + REASON.len()) as u8];
    frame.extend_from_slice(&GOING_AWAY.to_be_bytes());
    frame.extend_from_slice(REASON);
    frame
}

/// A Close frame, status 1001, as a client sends it (masked with a fresh key).
pub fn close_frame_to_server() -> Vec<u8> {
    // Unpredictable enough for a mask (std's hasher keys are random per process and per
    // instance); the key only keeps intermediaries from reading the payload as something else.
    let key = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
        .to_be_bytes();
    let mut frame = vec![0x80 | OPCODE_CLOSE, 0x80 | (2 + REASON.len()) as u8];
    frame.extend_from_slice(&key[..4]);
    let payload = GOING_AWAY
        .to_be_bytes()
        .into_iter()
        .chain(REASON.iter().copied());
    frame.extend(payload.enumerate().map(|(i, byte)| byte ^ key[i % 4]));
    frame
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame with `payload`, masked or not.
    fn frame(opcode: u8, payload: &[u8], masked: bool) -> Vec<u8> {
        let mut out = vec![0x80 | opcode];
        let mask_bit = if masked { 0x80 } else { 0 };
        match payload.len() {
            len @ 0..=125 => out.push(mask_bit | len as u8),
            len @ 126..=65535 => {
                out.push(mask_bit | 126);
                out.extend_from_slice(&(len as u16).to_be_bytes());
            }
            len => {
                out.push(mask_bit | 127);
                out.extend_from_slice(&(len as u64).to_be_bytes());
            }
        }
        if masked {
            out.extend_from_slice(&[1, 2, 3, 4]);
        }
        out.extend_from_slice(payload);
        out
    }

    #[test]
    fn boundaries_are_found_whatever_the_reads_cut() {
        let mut stream = frame(0x1, b"hello", false);
        let second = frame(0x2, &vec![7; 300], true);
        let third = frame(0x2, &vec![7; 70_000], false);
        stream.extend_from_slice(&second);
        stream.extend_from_slice(&third);
        let ends = [5 + 2, 5 + 2 + 300 + 8, stream.len()];
        for chunk in [1, 3, 7, 100, 4096, stream.len()] {
            let mut frames = Frames::default();
            let mut seen = Vec::new();
            for (i, piece) in stream.chunks(chunk).enumerate() {
                let mut at = 0;
                while at < piece.len() {
                    at += frames.follow(&piece[at..], true);
                    if frames.at_boundary() {
                        seen.push(i * chunk + at);
                    }
                }
            }
            assert_eq!(seen, ends, "reads of {chunk} bytes");
        }
    }

    #[test]
    fn a_close_frame_is_noticed_once_whole() {
        let mut frames = Frames::default();
        let close = frame(OPCODE_CLOSE, &[0x03, 0xe8], true);
        frames.follow(&close[..close.len() - 1], false);
        assert!(!frames.closed());
        frames.follow(&close[close.len() - 1..], false);
        assert!(frames.closed() && frames.at_boundary());
    }

    #[test]
    fn the_proxys_close_frames_are_well_formed() {
        let to_client = close_frame_to_client();
        assert_eq!(to_client[..4], [0x88, 21, 0x03, 0xe9]);
        assert_eq!(&to_client[4..], REASON);
        let to_server = close_frame_to_server();
        assert_eq!(to_server[0], 0x88);
        assert_eq!(to_server[1], 0x80 | 21);
        let key = &to_server[2..6];
        let payload: Vec<u8> = to_server[6..]
            .iter()
            .enumerate()
            .map(|(i, byte)| byte ^ key[i % 4])
            .collect();
        assert_eq!(payload[..2], [0x03, 0xe9]);
        assert_eq!(&payload[2..], REASON);
        let mut frames = Frames::default();
        assert_eq!(frames.follow(&to_server, false), to_server.len());
        assert!(frames.closed());
    }
}
