//! The bound on an HTTP/2 header block in progress.
//!
//! A header block (HEADERS or PUSH_PROMISE, then CONTINUATION frames until one carries
//! END_HEADERS) is not a stream yet, so neither the idle bound (no open stream) nor a body's
//! bound sees a client that starts one and never finishes it; h2 keeps the half-read block for
//! as long as the connection lives. [`HeaderBlockWatch`] follows the frame boundaries of what
//! the client sends, as it is read, and fails the read once a block has been open for the
//! header read timeout: the connection then closes, as HTTP/1's does on a head left unfinished.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

/// The client connection preface (RFC 9113 §3.4) comes before the first frame.
const PREFACE_LEN: u32 = 24;
const FRAME_HEADER_LEN: usize = 9;
const HEADERS: u8 = 0x1;
const PUSH_PROMISE: u8 = 0x5;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;

/// Follows the client's HTTP/2 frames, bounding each header block.
pub struct HeaderBlockWatch {
    limit: Duration,
    /// Bytes still to skip: the rest of the preface, or of the current frame's payload.
    skip: u32,
    /// The frame header being read.
    head: [u8; FRAME_HEADER_LEN],
    head_len: usize,
    /// Set while a header block is open: fires at its bound.
    timer: Option<Pin<Box<Sleep>>>,
}

impl HeaderBlockWatch {
    pub fn new(limit: Duration) -> HeaderBlockWatch {
        HeaderBlockWatch {
            limit,
            skip: PREFACE_LEN,
            head: [0; FRAME_HEADER_LEN],
            head_len: 0,
            timer: None,
        }
    }

    /// Follows bytes the client sent, in order.
    pub fn read(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.skip > 0 {
                let n = bytes.len().min(self.skip as usize);
                self.skip -= n as u32;
                bytes = &bytes[n..];
                continue;
            }
            let n = bytes.len().min(FRAME_HEADER_LEN - self.head_len);
            self.head[self.head_len..self.head_len + n].copy_from_slice(&bytes[..n]);
            self.head_len += n;
            bytes = &bytes[n..];
            if self.head_len == FRAME_HEADER_LEN {
                self.head_len = 0;
                self.frame(self.head);
            }
        }
    }

    fn frame(&mut self, head: [u8; FRAME_HEADER_LEN]) {
        self.skip = u32::from_be_bytes([0, head[0], head[1], head[2]]);
        let (kind, flags) = (head[3], head[4]);
        let ends_block = flags & END_HEADERS != 0;
        match kind {
            HEADERS | PUSH_PROMISE if !ends_block => {
                let deadline = Instant::now() + self.limit;
                match &mut self.timer {
                    Some(timer) => timer.as_mut().reset(deadline),
                    None => self.timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
                }
            }
            // Any other frame inside a block is a protocol error that h2 answers itself.
            CONTINUATION if ends_block => self.timer = None,
            HEADERS | PUSH_PROMISE => self.timer = None,
            _ => {}
        }
    }

    /// Whether a header block has been open for longer than the limit; otherwise the task is
    /// woken when it will have been.
    pub fn poll_expired(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let Some(timer) = &mut self.timer else {
            return Poll::Pending;
        };
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.timer = None;
                Poll::Ready(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "an HTTP/2 header block unfinished for {}",
                        humantime::format_duration(self.limit)
                    ),
                ))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
        let len = (payload.len() as u32).to_be_bytes();
        let mut bytes = vec![len[1], len[2], len[3], kind, flags, 0, 0, 0, 1];
        bytes.extend_from_slice(payload);
        bytes
    }

    fn open(watch: &HeaderBlockWatch) -> bool {
        watch.timer.is_some()
    }

    #[tokio::test]
    async fn a_block_is_open_from_headers_without_end_headers_to_the_continuation_that_ends_it() {
        let mut watch = HeaderBlockWatch::new(Duration::from_secs(10));
        let mut wire = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        wire.extend(frame(0x4, 0, &[0; 6])); // SETTINGS
        wire.extend(frame(HEADERS, 0, b"abc"));
        // Byte by byte, so that frame headers and payloads split across reads.
        for byte in &wire {
            watch.read(std::slice::from_ref(byte));
        }
        assert!(open(&watch));
        watch.read(&frame(CONTINUATION, 0, b"de"));
        assert!(open(&watch));
        watch.read(&frame(CONTINUATION, END_HEADERS, b"f"));
        assert!(!open(&watch));
        // A payload that looks like a frame header is skipped as payload.
        watch.read(&frame(0x0, 0, &frame(HEADERS, 0, b"")));
        assert!(!open(&watch));
        watch.read(&frame(HEADERS, END_HEADERS, b"complete"));
        assert!(!open(&watch));
    }

    #[tokio::test(start_paused = true)]
    async fn an_open_block_expires_at_the_limit() {
        let mut watch = HeaderBlockWatch::new(Duration::from_secs(10));
        watch.read(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
        watch.read(&frame(HEADERS, 0, b"abc"));
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert!(std::future::poll_fn(|cx| Poll::Ready(watch.poll_expired(cx).is_pending())).await);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let error = std::future::poll_fn(|cx| watch.poll_expired(cx)).await;
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
    }
}
