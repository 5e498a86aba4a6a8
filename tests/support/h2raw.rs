//! A raw HTTP/2 client that writes and reads frames by hand, to assert what is on the wire:
//! GOAWAY frames and their last stream id, PINGs, resets, and abusive frame sequences.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};

pub const DATA: u8 = 0;
pub const HEADERS: u8 = 1;
pub const RST_STREAM: u8 = 3;
pub const SETTINGS: u8 = 4;
pub const PING: u8 = 6;
pub const GOAWAY: u8 = 7;
pub const WINDOW_UPDATE: u8 = 8;
pub const CONTINUATION: u8 = 9;

pub const END_STREAM: u8 = 0x1;
pub const ACK: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;

pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

#[derive(Debug, Clone)]
pub struct Frame {
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
    pub payload: Vec<u8>,
}

impl Frame {
    /// GOAWAY's last stream id and error code.
    pub fn goaway(&self) -> (u32, u32) {
        let p = &self.payload;
        (
            u32::from_be_bytes([p[0] & 0x7f, p[1], p[2], p[3]]),
            u32::from_be_bytes([p[4], p[5], p[6], p[7]]),
        )
    }

    /// Whether a HEADERS frame starts with `:status 200` (HPACK static index 8).
    pub fn is_status_200(&self) -> bool {
        self.kind == HEADERS && self.payload.first() == Some(&0x88)
    }
}

pub struct H2 {
    pub stream: TcpStream,
}

impl H2 {
    /// Connects, sends the preface and SETTINGS with a large window, and opens the
    /// connection-level window too, so that bodies never wait on flow control.
    pub fn connect(addr: SocketAddr) -> H2 {
        let stream = TcpStream::connect(addr).unwrap();
        stream.set_read_timeout(Some(super::PATIENCE)).unwrap();
        let mut h2 = H2 { stream };
        h2.stream.write_all(PREFACE).unwrap();
        // SETTINGS_INITIAL_WINDOW_SIZE (4) = 2^31 - 1.
        h2.send(SETTINGS, 0, 0, &[0, 4, 0x7f, 0xff, 0xff, 0xff]);
        h2.send(
            WINDOW_UPDATE,
            0,
            0,
            &(0x7fff_ffffu32 - 65_535).to_be_bytes(),
        );
        h2
    }

    /// The server's side of an accepted connection: reads the client's preface and sends
    /// empty SETTINGS.
    pub fn accepted(stream: TcpStream) -> io::Result<H2> {
        stream.set_read_timeout(Some(super::PATIENCE))?;
        let mut h2 = H2 { stream };
        let mut preface = [0u8; 24];
        h2.stream.read_exact(&mut preface)?;
        if preface != PREFACE {
            return Err(io::ErrorKind::InvalidData.into());
        }
        h2.try_send(SETTINGS, 0, 0, &[])?;
        Ok(h2)
    }

    pub fn send(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        self.try_send(kind, flags, stream, payload).unwrap();
    }

    pub fn try_send(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) -> io::Result<()> {
        let len = payload.len() as u32;
        let mut frame = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        frame.extend_from_slice(&stream.to_be_bytes());
        frame.extend_from_slice(payload);
        self.stream.write_all(&frame)
    }

    /// A GET on `stream` for `path` (HPACK literals, no Huffman), END_STREAM set.
    pub fn get(&mut self, stream: u32, path: &str) {
        let block = header_block(&[
            (":method", "GET"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "app.local"),
        ]);
        self.send(HEADERS, END_HEADERS | END_STREAM, stream, &block);
    }

    pub fn read_frame(&mut self) -> io::Result<Frame> {
        let mut head = [0u8; 9];
        self.stream.read_exact(&mut head)?;
        let len = (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
        let mut payload = vec![0u8; len];
        self.stream.read_exact(&mut payload)?;
        let stream = u32::from_be_bytes([head[5] & 0x7f, head[6], head[7], head[8]]);
        Ok(Frame {
            kind: head[3],
            flags: head[4],
            stream,
            payload,
        })
    }

    /// Reads frames, acknowledging SETTINGS, until `stop` says so; returns every frame read.
    pub fn read_until(&mut self, mut stop: impl FnMut(&Frame) -> bool) -> io::Result<Vec<Frame>> {
        let mut frames = Vec::new();
        loop {
            let frame = self.read_frame()?;
            if frame.kind == SETTINGS && frame.flags & ACK == 0 {
                self.send(SETTINGS, ACK, 0, &[]);
            }
            let done = stop(&frame);
            frames.push(frame);
            if done {
                return Ok(frames);
            }
        }
    }
}

/// An HPACK header block of literals without indexing (new names, no Huffman).
pub fn header_block(headers: &[(&str, &str)]) -> Vec<u8> {
    let mut block = Vec::new();
    for (name, value) in headers {
        block.push(0x00);
        push_length(&mut block, name.len());
        block.extend_from_slice(name.as_bytes());
        push_length(&mut block, value.len());
        block.extend_from_slice(value.as_bytes());
    }
    block
}

/// An HPACK integer with a 7-bit prefix and the Huffman bit clear.
fn push_length(block: &mut Vec<u8>, mut len: usize) {
    if len < 127 {
        block.push(len as u8);
        return;
    }
    block.push(127);
    len -= 127;
    while len >= 128 {
        block.push((len % 128) as u8 | 0x80);
        len /= 128;
    }
    block.push(len as u8);
}

/// Body bytes received per stream among `frames`.
pub fn body_bytes(frames: &[Frame], stream: u32) -> usize {
    frames
        .iter()
        .filter(|f| f.kind == DATA && f.stream == stream)
        .map(|f| f.payload.len())
        .sum()
}

/// Whether `stream` ended (END_STREAM on DATA or HEADERS) among `frames`.
pub fn ended(frames: &[Frame], stream: u32) -> bool {
    frames.iter().any(|f| {
        f.stream == stream && (f.kind == DATA || f.kind == HEADERS) && f.flags & END_STREAM != 0
    })
}
