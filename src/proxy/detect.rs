//! Protocol detection: peek at a client's first bytes, without consuming them, and tell
//! HTTP/1 (a known method and a space), HTTP/2 prior knowledge (the connection preface) and
//! anything else (TLS, Postgres, Redis, random bytes) apart.
//!
//! A client that sends nothing is waited for until the detection timeout (then it is opaque
//! TCP on an `auto` route: server-speaks-first protocols) or until its side's listeners close
//! (then it is closed at once: docs/lifecycle.md, draining — unless it was accepted less than
//! [`SILENT_GRACE`] ago: a client whose `connect()` just returned, possibly out of the listen
//! queue as the listener closed, gets until then to write its request).

use std::time::Duration;

use crate::drain::Watch;
use tokio::net::TcpStream;

/// The HTTP/2 connection preface (RFC 9113 section 3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Request-line starts that mean HTTP/1.
const METHODS: &[&[u8]] = &[
    b"GET ",
    b"HEAD ",
    b"POST ",
    b"PUT ",
    b"DELETE ",
    b"CONNECT ",
    b"OPTIONS ",
    b"TRACE ",
    b"PATCH ",
];
/// Enough bytes to decide: the preface is the longest pattern.
const PEEK_LEN: usize = 24;
/// The age, counted from its acceptance, until which a connection that has sent nothing may
/// still send its first bytes once the listeners have closed.
const SILENT_GRACE: Duration = Duration::from_millis(250);
/// Pause between peeks when bytes are there but not enough to decide (peek does not consume,
/// so readiness stays set and an immediate retry would spin).
const PEEK_RETRY: Duration = Duration::from_millis(5);

/// What a connection turned out to carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Detected {
    Http1,
    Http2,
    /// Not HTTP.
    Tcp,
    /// Not enough bytes to decide within the timeout (server-speaks-first, or a slow client).
    Silent,
    /// The client closed before sending anything, or the drain closed a silent connection.
    Closed,
}

/// Decides from the bytes seen so far; `None` while they could still start either protocol.
pub fn classify(bytes: &[u8]) -> Option<Detected> {
    if bytes.is_empty() {
        return None;
    }
    if bytes.starts_with(H2_PREFACE) {
        return Some(Detected::Http2);
    }
    if METHODS.iter().any(|method| bytes.starts_with(method)) {
        return Some(Detected::Http1);
    }
    let could_be = |pattern: &[u8]| pattern.starts_with(bytes);
    if could_be(H2_PREFACE) || METHODS.iter().any(|method| could_be(method)) {
        None
    } else {
        Some(Detected::Tcp)
    }
}

/// On an `http` route only HTTP/1 and HTTP/2 are told apart, from the first bytes: anything
/// that does not start the HTTP/2 preface is HTTP/1 (hyper answers 400 to garbage), so that
/// the header read timeout counts from the first byte.
pub fn classify_http(bytes: &[u8]) -> Option<Detected> {
    match bytes {
        [] | [b'P'] => None,
        [b'P', b'R', ..] => Some(Detected::Http2),
        _ => Some(Detected::Http1),
    }
}

/// Waits for enough bytes to classify the connection, with [`classify`] (`auto` routes) or
/// [`classify_http`] (`http` routes).
///
/// `timeout` is when to give up waiting: `Detected::Silent` then. `listeners_closed` is
/// cancelled when the side's listeners close: a client that has sent nothing by then is closed.
pub async fn detect(
    stream: &TcpStream,
    http_only: bool,
    timeout: Duration,
    listeners_closed: &Watch,
) -> Detected {
    let classify = if http_only { classify_http } else { classify };
    let accepted = tokio::time::Instant::now();
    let mut buf = [0u8; PEEK_LEN];
    let mut seen = 0;
    let deadline = tokio::time::sleep(timeout);
    tokio::pin!(deadline);
    // Set when the listeners close before the first byte: the last moment to send one.
    let last_call = tokio::time::sleep(Duration::MAX);
    tokio::pin!(last_call);
    let mut closing = false;
    loop {
        tokio::select! {
            // The listeners closed while this client had not said a word yet: closed now if it
            // has been silent a while, else once it is SILENT_GRACE old (it is about to write).
            _ = listeners_closed.cancelled(), if seen == 0 && !closing => {
                closing = true;
                let now = tokio::time::Instant::now();
                last_call.as_mut().reset((accepted + SILENT_GRACE).max(now));
            }
            // Still nothing after that moment: close.
            () = &mut last_call, if closing && seen == 0 => return Detected::Closed,
            // The client took too long: a server-speaks-first protocol, or a slow one.
            _ = &mut deadline => return Detected::Silent,
            // The client sent something (or closed).
            peeked = stream.peek(&mut buf) => {
                let n = match peeked {
                    Ok(0) | Err(_) => return Detected::Closed,
                    Ok(n) => n,
                };
                if let Some(detected) = classify(&buf[..n]) {
                    return detected;
                }
                if n == seen {
                    // Nothing new (possibly a FIN after a partial token): wait a little.
                    tokio::time::sleep(PEEK_RETRY).await;
                }
                seen = n;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_and_other_protocols_are_told_apart() {
        assert_eq!(classify(b"GET / HTTP/1.1\r\n"), Some(Detected::Http1));
        assert_eq!(classify(b"OPTIONS * HTTP/1.1"), Some(Detected::Http1));
        assert_eq!(classify(H2_PREFACE), Some(Detected::Http2));
        // A TLS ClientHello, a Postgres startup packet, Redis, random bytes.
        assert_eq!(
            classify(&[0x16, 0x03, 0x01, 0x02, 0x00]),
            Some(Detected::Tcp)
        );
        assert_eq!(classify(&[0, 0, 0, 8, 4, 210, 22, 47]), Some(Detected::Tcp));
        assert_eq!(classify(b"*1\r\n$4\r\nPING\r\n"), Some(Detected::Tcp));
        assert_eq!(classify(b"GETX"), Some(Detected::Tcp));
        assert_eq!(classify(b"get / HTTP/1.1"), Some(Detected::Tcp));
    }

    #[test]
    fn http_routes_decide_on_the_first_bytes() {
        assert_eq!(classify_http(b"G"), Some(Detected::Http1));
        assert_eq!(classify_http(b"\x16\x03"), Some(Detected::Http1));
        assert_eq!(classify_http(b"P"), None);
        assert_eq!(classify_http(b"PO"), Some(Detected::Http1));
        assert_eq!(classify_http(b"PR"), Some(Detected::Http2));
    }

    #[test]
    fn prefixes_wait_for_more() {
        for partial in [
            &b"G"[..],
            b"GE",
            b"GET",
            b"P",
            b"PR",
            b"PRI * HTTP/2.0\r\n",
            b"CONNEC",
        ] {
            assert_eq!(
                classify(partial),
                None,
                "{:?}",
                String::from_utf8_lossy(partial)
            );
        }
    }
}
