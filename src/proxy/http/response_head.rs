//! What hyper's client connection has read of the response head in progress, for the one
//! failure hyper names alike for three causes: its "too large" parse error comes from a head
//! that filled its buffer, from more header fields than it reads, and from a `Content-Length` it
//! cannot hold (2^64 - 2 and above). The policy answers each with its own reason, as the fast
//! lane does (`policy::BadResponse`); the connection's socket ([`HeadSeen::read`]) counts the
//! head's bytes and lines as they arrive, so that the failure can be told apart afterwards.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::policy::{BadResponse, MAX_RESPONSE_FIELDS, MAX_RESPONSE_HEAD};

/// The counts of the head in progress, shared by the socket that reads it and the pool entry
/// whose request failed.
#[derive(Default)]
pub struct HeadCounts {
    bytes: AtomicUsize,
    fields: AtomicUsize,
}

impl HeadCounts {
    /// Why hyper found the head "too large".
    pub fn why_too_large(&self) -> BadResponse {
        if self.bytes.load(Ordering::Relaxed) >= MAX_RESPONSE_HEAD {
            BadResponse::HeadTooLarge
        } else if self.fields.load(Ordering::Relaxed) > MAX_RESPONSE_FIELDS {
            BadResponse::TooManyFields
        } else {
            // Neither its size nor its fields: the length hyper cannot hold, which the
            // policy's bound refuses too.
            BadResponse::Length
        }
    }
}

/// The socket's side: a scan of the bytes read since the request went out, up to the end of
/// the final head (an interim head's end starts the next). Each byte of a head is looked at
/// once; the body's bytes are not looked at.
#[derive(Default)]
pub struct HeadSeen {
    counts: Arc<HeadCounts>,
    /// Scanning: a request went out, and its final head has not ended yet.
    scanning: bool,
    bytes: usize,
    /// Lines ended in this head, the status line included.
    lines: usize,
    /// Bytes in the current line, CRs left out.
    line: usize,
    /// The status line says `1xx`.
    interim: bool,
}

impl HeadSeen {
    pub fn counts(&self) -> Arc<HeadCounts> {
        self.counts.clone()
    }

    /// A request is going out: its response's head comes next.
    pub fn request_sent(&mut self) {
        *self = HeadSeen {
            counts: self.counts.clone(),
            scanning: true,
            ..HeadSeen::default()
        };
        self.publish();
    }

    /// Bytes read from the target.
    pub fn read(&mut self, bytes: &[u8]) {
        if !self.scanning {
            return;
        }
        for &byte in bytes {
            self.bytes += 1;
            match byte {
                b'\n' if self.line == 0 && self.lines > 0 => {
                    if !self.interim {
                        self.scanning = false;
                        break;
                    }
                    // An interim head ended; the next is scanned afresh.
                    (self.bytes, self.lines, self.interim) = (0, 0, false);
                }
                b'\n' => {
                    self.lines += 1;
                    self.line = 0;
                }
                b'\r' => {}
                _ => {
                    // "HTTP/1.1 1": the status code's first digit.
                    if self.lines == 0 && self.line == 9 {
                        self.interim = byte == b'1';
                    }
                    self.line += 1;
                }
            }
        }
        self.publish();
    }

    fn publish(&self) {
        self.counts.bytes.store(self.bytes, Ordering::Relaxed);
        let fields = self.lines.saturating_sub(1);
        self.counts.fields.store(fields, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn why(chunks: &[&[u8]]) -> BadResponse {
        let mut seen = HeadSeen::default();
        seen.request_sent();
        for chunk in chunks {
            seen.read(chunk);
        }
        seen.counts().why_too_large()
    }

    #[test]
    fn the_cause_of_a_too_large_head_is_told_apart() {
        let fields: String = (0..101).map(|i| format!("x-f{i}: v\r\n")).collect();
        let many = format!("HTTP/1.1 200 OK\r\n{fields}\r\n");
        assert_eq!(why(&[many.as_bytes()]), BadResponse::TooManyFields);
        // However the reads cut it, and after an interim head.
        let (a, b) = many.as_bytes().split_at(500);
        let interim = b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n";
        assert_eq!(why(&[interim, a, b]), BadResponse::TooManyFields);
        // A length: the body's lines are not looked at.
        let body: String = (0..200).map(|_| "line\r\n").collect();
        let length =
            format!("HTTP/1.1 200 OK\r\ncontent-length: 18446744073709551615\r\n\r\n{body}");
        assert_eq!(why(&[length.as_bytes()]), BadResponse::Length);
        // A hundred fields are hyper's, a hundred and one too many.
        let hundred: String = (0..99).map(|i| format!("x-f{i}: v\r\n")).collect();
        let length =
            format!("HTTP/1.1 200 OK\r\n{hundred}content-length: 18446744073709551615\r\n\r\n");
        assert_eq!(why(&[length.as_bytes()]), BadResponse::Length);
        let big = format!(
            "HTTP/1.1 200 OK\r\nx-big: {}",
            "b".repeat(MAX_RESPONSE_HEAD)
        );
        assert_eq!(why(&[big.as_bytes()]), BadResponse::HeadTooLarge);
    }
}
