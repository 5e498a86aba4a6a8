//! The HTTP/1 fast lane (docs/http.md, "The fast lane") on the wire: every way a target may
//! frame a response reaches the client whole on a connection that serves on, a target's
//! connection is reused only after a response that ends where its framing says, bad responses
//! get a 502 or a cut connection (never a body that looks complete), requests the lane does
//! not take are served by hyper in between, and a client that gives up cancels its request.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::thread;
use std::time::Duration;

use support::backend::{Backend, WireResponse, get, proxy_for, read_response, send_raw};
use support::scripted::{After, Scripted};
use support::*;

const DATE: &str = "date: Thu, 01 Jan 2026 00:00:00 GMT\r\n";

/// The raw answer to each path, and what the target does after it.
fn script(path: &str) -> (String, After) {
    let after = match path {
        "/hang" => After::Hang,
        "/close-delimited" | "/bad-chunk" | "/cut-length" => After::Close,
        _ => After::KeepServing,
    };
    (answer(path), after)
}

fn answer(path: &str) -> String {
    let ok = |rest: &str| format!("HTTP/1.1 200 OK\r\n{DATE}{rest}");
    match path {
        "/length" => ok("content-length: 5\r\n\r\nhello"),
        "/chunked" => ok(
            "transfer-encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: t\r\n\r\n",
        ),
        "/both" => {
            ok("transfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
        }
        "/early" => format!(
            "HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n{}",
            ok("content-length: 5\r\n\r\nearly")
        ),
        "/list" => ok("content-length: 4, 4\r\n\r\nlist"),
        "/nodate" => "HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nnodate".into(),
        "/hop" => ok(
            "connection: x-hop\r\nx-hop: 1\r\nkeep-alive: timeout=5\r\nx-kept: 2\r\ncontent-length: 3\r\n\r\nhop",
        ),
        "/reason" => format!("HTTP/1.1 299 Quite Fine\r\n{DATE}content-length: 0\r\n\r\n"),
        "/204" => format!("HTTP/1.1 204 No Content\r\n{DATE}\r\n"),
        "/304" => format!("HTTP/1.1 304 Not Modified\r\n{DATE}etag: \"x\"\r\n\r\n"),
        "/head" => ok("content-length: 42\r\n\r\n"),
        "/close-delimited" => ok("\r\nuntil the target closes"),
        "/two-lengths" => ok("content-length: 2\r\ncontent-length: 3\r\n\r\nok"),
        "/switch" => "HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\n\r\n".into(),
        "/099" => format!("HTTP/1.1 099 Too Early\r\n{DATE}content-length: 0\r\n\r\n"),
        "/204-length" => format!("HTTP/1.1 204 No Content\r\n{DATE}content-length: 5\r\n\r\n"),
        "/304-bad-length" => {
            format!("HTTP/1.1 304 Not Modified\r\n{DATE}content-length: nope\r\n\r\n")
        }
        "/bad-chunk" => ok("transfer-encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n"),
        "/cut-length" => ok("content-length: 10\r\n\r\nhello"),
        _ => ok("content-length: 0\r\n\r\n"),
    }
}

fn proxy_to(addr: SocketAddr) -> Proxy {
    Proxy::start(&["--inbound", &format!("127.0.0.1:0={addr}/http")])
}

fn request(client: &mut TcpStream, method: &str, path: &str) {
    let raw = format!("{method} {path} HTTP/1.1\r\nHost: app.test\r\n\r\n");
    client.write_all(raw.as_bytes()).unwrap();
}

/// A response head alone (to a HEAD request: a length, but no body).
fn read_head(client: &mut TcpStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(client.read(&mut byte).unwrap(), 1, "closed in the head");
        head.push(byte[0]);
    }
    String::from_utf8(head).unwrap()
}

#[test]
fn every_response_framing_reaches_the_client_whole_on_a_connection_that_serves_on() {
    let target = Scripted::start(script);
    let proxy = proxy_to(target.addr);
    let mut client = TcpStream::connect(proxy.inbound[0]).unwrap();
    client.set_read_timeout(Some(PATIENCE)).unwrap();
    // The final response, past interim ones (which `/early` checks apart).
    let fetch = |client: &mut TcpStream, path: &str| -> WireResponse {
        request(client, "GET", path);
        loop {
            let response = read_response(client).unwrap_or_else(|error| panic!("{path}: {error}"));
            if !(100..200).contains(&response.status) {
                return response;
            }
        }
    };
    let cases: [(&str, u16, &str); 9] = [
        ("/length", 200, "hello"),
        ("/chunked", 200, "hello world"),
        ("/both", 200, "hello"),
        ("/early", 200, "early"),
        ("/list", 200, "list"),
        ("/nodate", 200, "nodate"),
        ("/hop", 200, "hop"),
        ("/reason", 299, ""),
        ("/204", 204, ""),
    ];
    for (path, status, body) in cases {
        let response = fetch(&mut client, path);
        assert_eq!(response.status, status, "{path}: {response:?}");
        assert_eq!(String::from_utf8_lossy(&response.body), body, "{path}");
        assert!(response.header("date").is_some(), "{path}: no date");
        assert_eq!(response.header("connection"), None, "{path}");
    }
    let chunked = fetch(&mut client, "/chunked");
    assert_eq!(chunked.header("transfer-encoding"), Some("chunked"));
    assert_eq!(
        chunked.header("x-trailer"),
        None,
        "a trailer became a header"
    );
    request(&mut client, "GET", "/early");
    let early = read_response(&mut client).unwrap();
    assert_eq!(
        (early.status, early.header("link")),
        (103, Some("</a>")),
        "the 103 did not come first"
    );
    assert_eq!(read_response(&mut client).unwrap().body, b"early");
    let both = fetch(&mut client, "/both");
    assert_eq!(both.header("content-length"), None, "chunked and a length");
    let hop = fetch(&mut client, "/hop");
    assert_eq!(hop.header("x-kept"), Some("2"));
    for name in ["x-hop", "keep-alive", "connection"] {
        assert_eq!(hop.header(name), None, "{name} passed: {hop:?}");
    }
    assert_eq!(
        fetch(&mut client, "/list").header("content-length"),
        Some("4")
    );
    let nodate = fetch(&mut client, "/nodate");
    assert!(
        nodate.header("date").unwrap().ends_with(" GMT"),
        "{nodate:?}"
    );
    assert_eq!(
        fetch(&mut client, "/length").header("date"),
        Some("Thu, 01 Jan 2026 00:00:00 GMT"),
        "the target's date replaced"
    );

    // Heads without bodies: the length announced stays, nothing follows.
    request(&mut client, "GET", "/304");
    let head = read_head(&mut client);
    assert!(head.starts_with("HTTP/1.1 304 Not Modified\r\n"), "{head}");
    request(&mut client, "HEAD", "/head");
    let head = read_head(&mut client);
    assert!(head.contains("content-length: 42\r\n"), "{head}");
    assert_eq!(
        fetch(&mut client, "/length").body,
        b"hello",
        "a body followed a head"
    );
    assert_eq!(
        target.accepted.load(Ordering::SeqCst),
        1,
        "the target's connection was not reused after whole responses"
    );

    // A body that ends when the target closes: chunked to the client, whose connection
    // serves on; the target's connection is not reused.
    let response = fetch(&mut client, "/close-delimited");
    assert_eq!(response.body, b"until the target closes");
    assert_eq!(response.header("transfer-encoding"), Some("chunked"));
    assert_eq!(fetch(&mut client, "/length").body, b"hello");
    assert_eq!(target.accepted.load(Ordering::SeqCst), 2);

    // The target got each request once, rewritten as hyper writes it.
    let heads = target.heads.lock().unwrap().clone();
    assert_eq!(heads.len(), cases.len() + 12, "{heads:#?}");
    assert_eq!(heads[0], "GET /length HTTP/1.1\r\nhost: app.test\r\n\r\n");
}

#[test]
fn bad_responses_get_a_502_or_a_cut_connection_never_a_body_that_looks_complete() {
    let target = Scripted::start(script);
    let mut proxy = proxy_to(target.addr);
    for path in ["/two-lengths", "/switch"] {
        let mut client = send_raw(proxy.inbound[0], &get(path));
        let response = read_response(&mut client).unwrap();
        assert_eq!(response.status, 502, "{path}: {response:?}");
        let body = String::from_utf8_lossy(&response.body);
        assert!(body.starts_with("bad gateway: "), "{path}: {body}");
        // The client's connection serves on.
        client.write_all(&get("/length")).unwrap();
        assert_eq!(read_response(&mut client).unwrap().body, b"hello", "{path}");
    }
    for path in ["/bad-chunk", "/cut-length"] {
        let mut client = send_raw(proxy.inbound[0], &get(path));
        let outcome = read_response(&mut client);
        assert!(outcome.is_err(), "{path}: looked complete: {outcome:?}");
    }
    assert!(proxy.is_running());
}

#[test]
fn requests_the_lane_does_not_take_are_served_by_hyper_in_between() {
    let backend = Backend::start();
    let proxy = proxy_for(&backend, &[]);
    let mut pipelined = get("/first");
    pipelined.extend(b"POST /echo HTTP/1.1\r\nHost: app.local\r\nContent-Length: 4\r\n\r\nbody");
    pipelined.extend(get("/last"));
    let mut client = send_raw(proxy.inbound[0], &pipelined);
    let bodies: Vec<Vec<u8>> = (0..3)
        .map(|_| read_response(&mut client).unwrap().body)
        .collect();
    assert_eq!(bodies[1], b"body");
    assert_eq!(backend.seen_paths(), ["/first", "/echo", "/last"]);
    // And again, one at a time, on the same connection.
    for path in ["/again", "/echo", "/after"] {
        let raw = match path {
            "/echo" => {
                b"POST /echo HTTP/1.1\r\nHost: app.local\r\nContent-Length: 2\r\n\r\nhi".to_vec()
            }
            _ => get(path),
        };
        client.write_all(&raw).unwrap();
        assert_eq!(read_response(&mut client).unwrap().status, 200, "{path}");
    }
    assert_eq!(backend.seen().len(), 6);
}

#[test]
fn a_head_split_across_writes_is_served() {
    let target = Scripted::start(script);
    let proxy = proxy_to(target.addr);
    let mut client = send_raw(proxy.inbound[0], b"GET /length HTTP/1.1\r\nHo");
    for pause in [Duration::from_millis(1), Duration::from_millis(50)] {
        thread::sleep(pause);
        client.write_all(b"st: app.test\r\n\r\n").unwrap();
        assert_eq!(read_response(&mut client).unwrap().body, b"hello");
        client.write_all(b"GET /length HTTP/1.1\r\nHo").unwrap();
    }
}

#[test]
fn a_client_that_gives_up_cancels_its_request() {
    let target = Scripted::start(script);
    let mut proxy = proxy_to(target.addr);
    let client = send_raw(proxy.inbound[0], &get("/hang"));
    wait_until("the target has the request", PATIENCE, || {
        !target.heads.lock().unwrap().is_empty()
    });
    // A reset: a half-close (FIN) is a client still waiting for its answer
    // (tests/engines.rs).
    reset_close(client);
    wait_until("the target's connection let go", PATIENCE, || {
        target.ended.load(Ordering::SeqCst) == 1
    });
    assert!(proxy.is_running());
}

/// The same rules whichever engine forwards: a bodiless GET goes through the fast lane, the
/// same GET with `Content-Length: 0` through hyper. A response with both Transfer-Encoding and
/// Content-Length reaches the client whole, framed by the coding and without the length (RFC
/// 9112 section 6.3); a 101 the client did not ask for, a status below 100 and a length that is
/// no number (even on a 304) are 502s; a 204 goes out without a length (RFC 9110 8.6).
#[test]
fn both_engines_frame_responses_alike_and_refuse_what_is_no_response() {
    let target = Scripted::start(script);
    let proxy = proxy_to(target.addr);
    for (engine, extra) in [("fast lane", ""), ("hyper", "content-length: 0\r\n")] {
        let mut client = TcpStream::connect(proxy.inbound[0]).unwrap();
        client.set_read_timeout(Some(PATIENCE)).unwrap();
        let raw = format!("GET /both HTTP/1.1\r\nHost: app.test\r\n{extra}\r\n");
        client.write_all(raw.as_bytes()).unwrap();
        let response = read_response(&mut client).unwrap();
        assert_eq!(response.status, 200, "{engine}");
        assert_eq!(response.body, b"hello", "{engine}: {:?}", response.headers);
        assert_eq!(response.header("content-length"), None, "{engine}");

        let mut client = TcpStream::connect(proxy.inbound[0]).unwrap();
        client.set_read_timeout(Some(PATIENCE)).unwrap();
        let raw = format!("GET /switch HTTP/1.1\r\nHost: app.test\r\n{extra}\r\n");
        client.write_all(raw.as_bytes()).unwrap();
        let response = read_response(&mut client).unwrap();
        assert_eq!(
            response.status, 502,
            "{engine}: an unasked 101 went through"
        );

        for path in ["/099", "/304-bad-length"] {
            let mut client = TcpStream::connect(proxy.inbound[0]).unwrap();
            client.set_read_timeout(Some(PATIENCE)).unwrap();
            let raw = format!("GET {path} HTTP/1.1\r\nHost: app.test\r\n{extra}\r\n");
            client.write_all(raw.as_bytes()).unwrap();
            let response = read_response(&mut client).unwrap();
            assert_eq!(response.status, 502, "{engine}: {path}");
        }
        let mut client = TcpStream::connect(proxy.inbound[0]).unwrap();
        client.set_read_timeout(Some(PATIENCE)).unwrap();
        let raw = format!("GET /list HTTP/1.1\r\nHost: app.test\r\n{extra}\r\n");
        client.write_all(raw.as_bytes()).unwrap();
        let response = read_response(&mut client).unwrap();
        assert_eq!(response.body, b"list", "{engine}");
        assert_eq!(
            response.header("content-length"),
            Some("4"),
            "{engine}: one length"
        );
        let mut client = TcpStream::connect(proxy.inbound[0]).unwrap();
        client.set_read_timeout(Some(PATIENCE)).unwrap();
        let raw = format!("GET /204-length HTTP/1.1\r\nHost: app.test\r\n{extra}\r\n");
        client.write_all(raw.as_bytes()).unwrap();
        let head = read_head(&mut client);
        assert!(head.starts_with("HTTP/1.1 204"), "{engine}: {head}");
        assert!(
            !head.to_ascii_lowercase().contains("content-length"),
            "{engine}: a 204 with a length: {head}"
        );
    }
}

/// The escape hatch: `--http1-fast-lane=false` sends every HTTP/1 request through hyper, and
/// `lameduck_http1_fast_lane_requests_total` tells an operator which engine served what.
#[test]
fn the_fast_lane_can_be_turned_off_and_the_metric_tells_which_engine_served() {
    let target = Scripted::start(script);
    for (flag, through_lane) in [
        ("--http1-fast-lane=true", 3.0),
        ("--http1-fast-lane=false", 0.0),
    ] {
        let proxy = Proxy::start(&[
            "--inbound",
            &format!("127.0.0.1:0={}/http", target.addr),
            flag,
        ]);
        let mut client = TcpStream::connect(proxy.inbound[0]).unwrap();
        client.set_read_timeout(Some(PATIENCE)).unwrap();
        for _ in 0..3 {
            request(&mut client, "GET", "/length");
            let response = read_response(&mut client).unwrap();
            assert_eq!(
                (response.status, &response.body[..]),
                (200, &b"hello"[..]),
                "{flag}"
            );
        }
        assert_eq!(
            proxy.metric("lameduck_http1_fast_lane_requests_total"),
            through_lane,
            "{flag}"
        );
        assert_eq!(
            proxy.metric("lameduck_requests_total{direction=\"inbound\",status_class=\"2xx\"}"),
            3.0,
            "{flag}"
        );
    }
}

/// Every test above, again with the fast lane off: both HTTP/1 engines keep this file's promises.
#[test]
fn the_same_through_hyper_alone() {
    support::run_again_through_hyper("the_same_through_hyper_alone");
}
