//! HTTP/1 framing as strict as the RFCs: each rule on the wire, with the status the
//! client gets and what the target received.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};

use support::Proxy;
use support::backend::{Backend, WireResponse, read_response, send_raw};

fn proxy_to(backend: &Backend) -> Proxy {
    Proxy::start(&["--inbound", &format!("127.0.0.1:0={}/http", backend.addr)])
}

fn exchange(addr: SocketAddr, raw: &str) -> WireResponse {
    let mut stream = send_raw(addr, raw.as_bytes());
    read_response(&mut stream).unwrap_or_else(|error| panic!("{raw:?}: {error}"))
}

#[test]
fn requests_framed_against_the_rfcs_are_refused_and_never_reach_the_target() {
    let backend = Backend::start();
    let proxy = proxy_to(&backend);
    let addr = proxy.inbound[0];
    let cases = [
        (
            "GET /two-hosts HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n",
            400,
            "more than one Host (RFC 9112 section 3.2)",
        ),
        (
            "POST /te-list HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: x, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            501,
            "an unknown transfer coding (RFC 9112 section 6.1)",
        ),
        (
            "POST /te-lines HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            501,
            "an unknown transfer coding on a line of its own",
        ),
        (
            "POST /te-twice HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            400,
            "chunked twice",
        ),
        (
            "CONNECT exampl,e.tes,t:443 HTTP/1.1\r\nHost: exampl,e.tes,t:443\r\n\r\n",
            400,
            "a CONNECT target that is no host name",
        ),
        (
            "CONNECT a.test HTTP/1.1\r\nHost: a.test\r\n\r\n",
            400,
            "a CONNECT target without a port",
        ),
        (
            "CONNECT user@a.test:443 HTTP/1.1\r\nHost: a.test:443\r\n\r\n",
            400,
            "a CONNECT target with user information",
        ),
    ];
    for (raw, status, what) in cases {
        let response = exchange(addr, raw);
        assert_eq!(response.status, status, "{what}: {response:?}");
        assert_eq!(
            response.header("connection"),
            Some("close"),
            "{what}: what follows cannot be trusted"
        );
    }
    assert!(
        backend.seen().is_empty(),
        "the target received {:?}",
        backend.seen_paths()
    );
    // Good requests of the same shapes still pass.
    let response = exchange(
        addr,
        "POST /chunked HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    );
    assert_eq!(response.status, 200);
    assert_eq!(backend.seen()[0].body, b"hello");
}

#[test]
fn an_absolute_form_target_names_the_host_whatever_host_says() {
    let backend = Backend::start();
    let proxy = proxy_to(&backend);
    let addr = proxy.inbound[0];
    for (raw, host, path) in [
        (
            "GET http://a.test/x HTTP/1.1\r\nHost: b.test\r\n\r\n",
            "a.test",
            "/x",
        ),
        (
            "GET http://user@a.test:8080/y?q=1 HTTP/1.1\r\nHost: b.test\r\n\r\n",
            "a.test:8080",
            "/y",
        ),
        ("GET http://a.test/z HTTP/1.1\r\n\r\n", "a.test", "/z"),
    ] {
        assert_eq!(exchange(addr, raw).status, 200, "{raw:?}");
        let seen = backend
            .seen()
            .into_iter()
            .find(|seen| seen.path == path)
            .unwrap();
        assert_eq!(seen.header("host"), Some(host), "{raw:?}");
        assert!(
            !seen.uri.starts_with("http://"),
            "origin form: {}",
            seen.uri
        );
        assert_eq!(
            seen.headers
                .iter()
                .filter(|(name, _)| name == "host")
                .count(),
            1
        );
    }
}

/// RFC 9110 section 9.3.6: a 2xx answer to CONNECT has no body, whatever `Content-Length` or
/// `Transfer-Encoding` it carries; the tunnel starts right after its head.
#[test]
fn a_connect_answered_with_a_content_length_still_opens_the_tunnel() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let target = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            stream.read_exact(&mut byte).unwrap();
            head.push(byte[0]);
        }
        stream
            .write_all(b"HTTP/1.1 200 Connection established\r\nContent-Length: 5\r\n\r\n")
            .unwrap();
        let mut buf = [0u8; 64];
        loop {
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => stream.write_all(&buf[..n]).unwrap(),
            }
        }
    });
    let proxy = Proxy::start(&["--inbound", &format!("127.0.0.1:0={target}/http")]);
    let mut client = send_raw(
        proxy.inbound[0],
        b"CONNECT t.test:443 HTTP/1.1\r\nHost: t.test:443\r\n\r\n",
    );
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        client.read_exact(&mut byte).expect("a response head");
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(!head.contains("content-length"), "{head}");
    client.write_all(b"through the tunnel").unwrap();
    let mut echoed = [0u8; 18];
    client.read_exact(&mut echoed).unwrap();
    assert_eq!(&echoed, b"through the tunnel");
}

/// A malformed chunk gets the client a 400 (the client sent it), not a 502 as if the target
/// had failed; the connection closes, since what follows cannot be framed. The target never
/// gets a complete request: when the bad chunk comes with the head, nothing at all; when it
/// comes after chunks already forwarded, the request stays unfinished and its connection is
/// closed.
#[test]
fn a_malformed_chunk_is_the_clients_fault() {
    let target = TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy = Proxy::start(&[
        "--inbound",
        &format!("127.0.0.1:0={}/http", target.local_addr().unwrap()),
    ]);
    let (received, connections) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for stream in target.incoming() {
            let mut stream = stream.unwrap();
            let received = received.clone();
            std::thread::spawn(move || {
                stream.set_read_timeout(Some(support::PATIENCE)).unwrap();
                let mut bytes = Vec::new();
                // Ends at the proxy's FIN or reset; a timeout would mean the request was left
                // open on the target's side.
                let ended = loop {
                    let mut buf = [0u8; 4096];
                    match stream.read(&mut buf) {
                        Ok(0) => break true,
                        Ok(n) => bytes.extend_from_slice(&buf[..n]),
                        Err(error) => break error.kind() == std::io::ErrorKind::ConnectionReset,
                    }
                };
                let _ = received.send((bytes, ended));
            });
        }
    });
    let cases = [
        ("0x5\r\nhello\r\n0\r\n\r\n", "a size with a 0x prefix", ""),
        ("5\nhello\r\n0\r\n\r\n", "a bare LF after the size", ""),
        (
            "fffffffffffffffff\r\nx\r\n0\r\n\r\n",
            "a size that overflows",
            "",
        ),
        // The first 3 bytes are a good chunk, forwarded before the rest is read.
        (
            "3\r\nhello\r\n0\r\n\r\n",
            "more data than the size",
            "3\r\nhel\r\n",
        ),
    ];
    for (chunked, what, forwarded) in cases {
        let head = "POST /echo HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n";
        let response = exchange(proxy.inbound[0], &format!("{head}{chunked}"));
        assert_eq!(response.status, 400, "{what}: {response:?}");
        assert_eq!(response.header("connection"), Some("close"), "{what}");
        let Ok((bytes, ended)) = connections.recv_timeout(support::PATIENCE) else {
            panic!("{what}: the proxy never connected to the target");
        };
        let bytes = String::from_utf8_lossy(&bytes).to_ascii_lowercase();
        assert!(
            ended,
            "{what}: the target's connection was left open after {bytes:?}"
        );
        // Whether the good chunks went before the bad one was read depends on when the
        // target's connection was ready: some or none of them, never more.
        let valid = format!("{head}{forwarded}").to_ascii_lowercase();
        assert!(
            valid.starts_with(&bytes),
            "{what}: the target got {bytes:?}, more than the valid part {valid:?}"
        );
    }
}
