//! HTTP/1 framing as strict as the RFCs: each rule on the wire, with the status the
//! client gets and what the target received.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};

use support::backend::{Backend, WireResponse, read_response, send_raw};
use support::{PATIENCE, Proxy, skip, wait_until};

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
            "CONNECT a.test:443 HTTP/1.1\r\nHost: b.test:443\r\n\r\n",
            400,
            "a Host that names another than the CONNECT target (HAProxy's 400)",
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

/// HAProxy in `mode http` in front of `target`, listening on the returned address.
struct Haproxy {
    child: std::process::Child,
    addr: SocketAddr,
    _dir: std::path::PathBuf,
}

impl Haproxy {
    fn start(target: SocketAddr) -> Haproxy {
        let port = support::port_for_another_process();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let dir =
            std::env::temp_dir().join(format!("lameduck-haproxy-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("haproxy.cfg");
        std::fs::write(
            &config,
            format!(
                "global\n    nbthread 1\ndefaults\n    mode http\n    timeout connect 5s\n    \
                 timeout client 5s\n    timeout server 5s\nfrontend reference\n    bind {addr}\n    \
                 default_backend app\nbackend app\n    server app {target}\n"
            ),
        )
        .unwrap();
        let child = std::process::Command::new("haproxy")
            .args(["-db", "-f"])
            .arg(&config)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start haproxy");
        wait_until("haproxy listening", PATIENCE, || {
            std::net::TcpStream::connect(addr).is_ok()
        });
        Haproxy {
            child,
            addr,
            _dir: dir,
        }
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self._dir);
    }
}

/// What one forwarder did with one hostile request: the status the client got first (0 for
/// none), and the paths of the requests that reached the app whole (a request whose body was
/// cut short or malformed on the way is not one).
fn outcome(addr: SocketAddr, backend: &Backend, raw: &[u8]) -> (u16, Vec<String>) {
    let before = backend.seen().len();
    let mut client = send_raw(addr, raw);
    client
        .set_read_timeout(Some(std::time::Duration::from_secs(2)))
        .unwrap();
    let mut answers = Vec::new();
    let _ = client.read_to_end(&mut answers);
    std::thread::sleep(std::time::Duration::from_millis(100));
    let text = String::from_utf8_lossy(&answers);
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let paths = backend.seen()[before..]
        .iter()
        .filter(|seen| seen.complete)
        .map(|seen| seen.path.clone())
        .collect();
    (status, paths)
}

/// The request-smuggling vectors, each followed by a request that must never reach the app as
/// a request of its own unless both forwarders read it as a pipelined one: every one that
/// HAProxy refuses, lameduck refuses too (no request reaches the app whole: bodies are
/// streamed, so the head and the valid chunks before a malformed one may, never the body's
/// end), and lameduck never lets the follower through where HAProxy does not. The table of
/// both forwarders' answers is printed.
#[test]
fn every_smuggling_vector_haproxy_refuses_is_refused_too() {
    let installed = std::process::Command::new("haproxy")
        .arg("-v")
        .output()
        .is_ok_and(|output| output.status.success());
    if !installed {
        return skip(
            "every_smuggling_vector_haproxy_refuses_is_refused_too",
            "haproxy (the reference) is not installed",
        );
    }
    let follower = "GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n";
    // The first four are requests without a body as the fast lane sees them first.
    let vectors: [(&str, &str); 26] = [
        (
            "GET, bare LF line ends",
            "GET /v HTTP/1.1\nHost: x\nX-A: b\n\n",
        ),
        (
            "GET, a folded header line",
            "GET /v HTTP/1.1\r\nHost: x\r\nX-Folded: a\r\n b\r\n\r\n",
        ),
        (
            "GET, a space before the colon",
            "GET /v HTTP/1.1\r\nHost : x\r\n\r\n",
        ),
        (
            "GET, Content-Length and Transfer-Encoding",
            "GET /v HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        ),
        (
            "Content-Length then Transfer-Encoding",
            "POST /v HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        ),
        (
            "Transfer-Encoding then Content-Length",
            "POST /v HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\n",
        ),
        (
            "chunked, identity",
            "POST /v HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
        ),
        (
            "xchunked",
            "POST /v HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
        ),
        (
            "a space before the colon",
            "POST /v HTTP/1.1\r\nHost: x\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
        ),
        (
            "a vertical tab before the value",
            "POST /v HTTP/1.1\r\nHost: x\r\nTransfer-Encoding:\x0bchunked\r\n\r\n0\r\n\r\n",
        ),
        (
            "Transfer-Encoding folded (obs-fold)",
            "POST /v HTTP/1.1\r\nHost: x\r\nTransfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n",
        ),
        (
            "a folded header line",
            "POST /v HTTP/1.1\r\nHost: x\r\nX-Folded: a\r\n b\r\nContent-Length: 0\r\n\r\n",
        ),
        (
            "Transfer-Encoding twice, unknown last",
            "POST /v HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: x\r\n\r\n0\r\n\r\n",
        ),
        (
            "Content-Length with a sign",
            "POST /v HTTP/1.1\r\nHost: x\r\nContent-Length: +3\r\n\r\nabc",
        ),
        (
            "Content-Length in hex",
            "POST /v HTTP/1.1\r\nHost: x\r\nContent-Length: 0x3\r\n\r\nabc",
        ),
        (
            "two different Content-Lengths",
            "POST /v HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 40\r\n\r\nabc",
        ),
        (
            "a list of different lengths",
            "POST /v HTTP/1.1\r\nHost: x\r\nContent-Length: 3, 40\r\n\r\nabc",
        ),
        (
            "a bare LF ending a header line",
            "POST /v HTTP/1.1\r\nHost: x\r\nContent-Length: 3\n\r\nabc",
        ),
        (
            "a bare CR in a header line",
            "POST /v HTTP/1.1\r\nHost: x\r\nX: a\rb\r\nContent-Length: 3\r\n\r\nabc",
        ),
        (
            "a NUL in a header value",
            "POST /v HTTP/1.1\r\nHost: x\r\nX: a\0b\r\nContent-Length: 3\r\n\r\nabc",
        ),
        (
            "a chunk size that overflows",
            "POST /v HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff1\r\n\r\n",
        ),
        (
            "a chunk size with 0x",
            "POST /v HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0x0\r\n\r\n",
        ),
        (
            "a bare LF after a chunk size",
            "POST /v HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\n\r\n",
        ),
        (
            "more chunk data than its size",
            "POST /v HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nab\r\n0\r\n\r\n",
        ),
        (
            "a space inside the method",
            "G ET /v HTTP/1.1\r\nHost: x\r\n\r\n",
        ),
        (
            "HTTP/1.0 with Transfer-Encoding",
            "POST /v HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        ),
    ];
    let (ours, theirs) = (Backend::start(), Backend::start());
    let proxy = proxy_to(&ours);
    let haproxy = Haproxy::start(theirs.addr);
    let mut table = String::new();
    for (what, request) in vectors {
        let raw = format!("{request}{follower}");
        let (their_status, their_paths) = outcome(haproxy.addr, &theirs, raw.as_bytes());
        let (our_status, our_paths) = outcome(proxy.inbound[0], &ours, raw.as_bytes());
        table.push_str(&format!(
            "{what:40} haproxy {their_status:3} {their_paths:?}, lameduck {our_status:3} {our_paths:?}\n"
        ));
        if their_paths.is_empty() {
            assert!(
                our_paths.is_empty() && our_status >= 400,
                "{what}: HAProxy refused it, lameduck answered {our_status} and the app saw \
                 {our_paths:?}\n{table}"
            );
        }
        if our_paths.iter().any(|path| path == "/smuggled") {
            assert!(
                their_paths.iter().any(|path| path == "/smuggled"),
                "{what}: the follower reached the app through lameduck only\n{table}"
            );
        }
    }
    eprintln!("{table}");
}

/// Every test above, again with the fast lane off: both HTTP/1 engines keep this file's promises.
#[test]
fn the_same_through_hyper_alone() {
    support::run_again_through_hyper("the_same_through_hyper_alone");
}
