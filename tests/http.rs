//! HTTP proxying (docs/http.md) and HTTP-aware draining (docs/lifecycle.md) on the real
//! binary: requests in flight finish, idle connections close, targets that fail are answered
//! honestly, hostile clients are bounded; and protocol detection on `auto` routes.

mod support;

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use support::backend::{Backend, get, proxy_for, read_response, send_raw};
use support::process::rss_kib;
use support::*;

fn wait_seen(backend: &Backend, path: &str) {
    wait_until(&format!("the backend sees {path}"), PATIENCE, || {
        backend.seen_paths().iter().any(|seen| seen == path)
    });
}

/// A `Connection` header may name other headers as hop-by-hop, but never `Host`: the app sees
/// the client's Host, never the proxy's idea of the target (`127.0.0.1:port`), whichever
/// engine forwards the request.
#[test]
fn connection_naming_host_never_replaces_the_clients_host() {
    let backend = Backend::start();
    let proxy = proxy_for(&backend, &[]);
    for (request, what) in [
        (&b"GET /a HTTP/1.1\r\nHost: app.local\r\nConnection: host\r\n\r\n"[..], "bodiless"),
        (
            &b"POST /b HTTP/1.1\r\nHost: app.local\r\nConnection: Host, keep-alive\r\nContent-Length: 2\r\n\r\nhi"[..],
            "with a body",
        ),
    ] {
        let mut client = send_raw(proxy.inbound[0], request);
        let response = read_response(&mut client).unwrap();
        assert_eq!(response.status, 200, "{what}");
        let seen = backend.seen().pop().unwrap();
        assert_eq!(seen.header("host"), Some("app.local"), "{what}: {seen:?}");
    }
}

#[test]
fn http1_requests_reach_the_app_with_their_host_and_without_hop_by_hop_headers() {
    let backend = Backend::start();
    let mut proxy = proxy_for(&backend, &[]);
    let mut client = send_raw(
        proxy.inbound[0],
        b"GET /echo HTTP/1.1\r\nHost: app.local\r\nConnection: x-foo, keep-alive\r\nConnection: x-bar\r\n\
          X-Foo: 1\r\nX-Bar: 2\r\nKeep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nTE: gzip\r\n\
          Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\nX-Kept: yes\r\n\r\n",
    );
    let response = read_response(&mut client).unwrap();
    assert_eq!(response.status, 200);
    let seen = &backend.seen()[0];
    assert_eq!(
        seen.header("host"),
        Some("app.local"),
        "the client's Host reaches the app"
    );
    assert_eq!(seen.header("x-kept"), Some("yes"));
    for hop in [
        "connection",
        "x-foo",
        "x-bar",
        "keep-alive",
        "proxy-connection",
        "te",
        "upgrade",
        "http2-settings",
    ] {
        assert_eq!(seen.header(hop), None, "{hop} reached the app: {seen:?}");
    }

    // And the app's hop-by-hop headers do not reach the client (same keep-alive connection).
    client.write_all(&get("/hop")).unwrap();
    let response = read_response(&mut client).unwrap();
    assert_eq!(response.status, 200);
    assert_eq!(response.header("x-kept"), Some("yes"));
    for hop in ["x-secret", "keep-alive", "proxy-connection"] {
        assert_eq!(
            response.header(hop),
            None,
            "{hop} reached the client: {:?}",
            response.headers
        );
    }
    assert_ne!(response.header("connection"), Some("x-secret"));

    let conns = proxy.get("/connections").body;
    assert!(conns.contains("\"protocol\": \"http1\""), "{conns}");
    assert_eq!(
        proxy.metric("lameduck_requests_total{direction=\"inbound\",status_class=\"2xx\"}"),
        2.0
    );
    assert_eq!(
        proxy.metric("lameduck_request_duration_seconds_count{direction=\"inbound\"}"),
        2.0
    );
    assert_eq!(
        proxy.metric("lameduck_connections_total{direction=\"inbound\",protocol=\"http1\"}"),
        1.0
    );
    drop(client);
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

/// Requests reach the app in origin form, always with a `Host`: the client's, else the
/// absolute-form URI's authority, else the target; a `Host` that is no authority gets 400.
#[test]
fn http1_requests_reach_the_app_in_origin_form_with_a_host() {
    let backend = Backend::start();
    let mut proxy = proxy_for(&backend, &[]);
    let exchange = |raw: &[u8]| {
        let mut client = send_raw(proxy.inbound[0], raw);
        read_response(&mut client).unwrap().status
    };
    let absolute = b"GET http://app.local/echo?x=1 HTTP/1.1\r\nHost: app.local\r\n\r\n";
    assert_eq!(exchange(absolute), 200);
    assert_eq!(exchange(b"GET /echo?y=2 HTTP/1.0\r\n\r\n"), 200);
    let seen = backend.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[0].uri, "/echo?x=1");
    assert_eq!(seen[0].header("host"), Some("app.local"));
    assert_eq!(seen[1].uri, "/echo?y=2");
    assert_eq!(
        seen[1].header("host"),
        Some(backend.addr.to_string().as_str()),
        "a request without Host names the target"
    );

    assert_eq!(exchange(b"GET /echo HTTP/1.1\r\nHost: a b\r\n\r\n"), 400);
    assert_eq!(
        backend.seen().len(),
        2,
        "the bad request never reached the app"
    );
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

/// A keep-alive connection to the app serves request after request, whichever client sends
/// them, once each response has been read to its end; a response cut short by its client
/// leaves its connection unusable, and it is never reused.
#[test]
fn connections_to_the_app_are_reused_only_after_a_whole_response() {
    let backend = Backend::start();
    let mut proxy = proxy_for(&backend, &[]);
    let exchange = |path: &str| {
        let mut client = send_raw(proxy.inbound[0], &get(path));
        let response = read_response(&mut client).unwrap();
        assert_eq!(response.status, 200);
        response.body.len()
    };
    exchange("/");
    exchange("/");
    assert_eq!(exchange("/slow?chunks=5&size=1000&interval=10"), 5000);
    exchange("/");
    let connections = |seen: &[support::backend::Seen]| -> Vec<usize> {
        seen.iter().map(|seen| seen.connection).collect()
    };
    assert_eq!(
        connections(&backend.seen()),
        [0, 0, 0, 0],
        "one connection to the app for one client at a time"
    );

    // A client that goes away in the middle of a streamed response.
    let mut cut = send_raw(
        proxy.inbound[0],
        &get("/slow?chunks=100&size=1000&interval=20"),
    );
    let mut head = [0u8; 64];
    assert!(cut.read(&mut head).unwrap() > 0);
    drop(cut);
    // The proxy notices at its next write, and lets the cut connection go.
    proxy.wait_open_connections(0);
    exchange("/");
    let seen = connections(&backend.seen());
    assert_eq!(seen[4], 0, "the cut response had the pooled connection");
    assert_ne!(
        seen[5], 0,
        "a connection with a response cut short was reused"
    );
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn http1_inflight_request_completes_with_connection_close() {
    let backend = Backend::start();
    let mut proxy = proxy_for(&backend, &[]);
    let mut client = send_raw(proxy.inbound[0], &get("/delay?ms=1000&size=1048576"));
    wait_seen(&backend, "/delay");
    proxy.signal(libc::SIGTERM);
    wait_until("new connections refused", PATIENCE, || {
        try_connect(proxy.inbound[0]) == Attempt::Refused
    });
    let response = read_response(&mut client).unwrap();
    let done = Instant::now();
    assert_eq!(response.status, 200);
    assert_eq!(response.body.len(), 1_048_576);
    assert_eq!(response.header("connection"), Some("close"));
    assert_eq!(
        wait_close(&mut client, PATIENCE).0,
        Close::Eof,
        "a clean FIN after the response"
    );
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    let exit = done.elapsed();
    assert!(
        exit < Duration::from_secs(1),
        "exit {exit:?} after the response"
    );
    eprintln!("exit {exit:?} after the last response");
}

/// Once the listeners have closed, an idle keep-alive connection is closed (FIN) when it has
/// been idle for a second: at once for one idle longer, a second after its last response for one
/// just answered, whose client may be about to send its next request.
#[test]
fn idle_keepalive_connections_are_closed_once_idle_for_a_second() {
    let backend = Backend::start();
    let mut proxy = proxy_for(&backend, &[]);
    let mut idle = send_raw(proxy.inbound[0], &get("/"));
    assert_eq!(read_response(&mut idle).unwrap().status, 200);
    thread::sleep(Duration::from_millis(1500));
    let mut client = send_raw(proxy.inbound[0], &get("/"));
    assert_eq!(read_response(&mut client).unwrap().status, 200);
    let sent = Instant::now();
    proxy.signal(libc::SIGTERM);
    assert_eq!(
        wait_close(&mut idle, PATIENCE).0,
        Close::Eof,
        "FIN, not RST"
    );
    let idle_closed = sent.elapsed();
    assert!(
        idle_closed < Duration::from_millis(500),
        "the connection idle for 1.5 s closed after {idle_closed:?}"
    );
    let (close, _) = wait_close(&mut client, PATIENCE);
    let closed = sent.elapsed();
    assert_eq!(close, Close::Eof, "FIN, not RST");
    assert!(
        closed > Duration::from_millis(700) && closed < Duration::from_millis(2500),
        "the connection just answered closed after {closed:?}"
    );
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    eprintln!(
        "idle keep-alive closed {idle_closed:?} after SIGTERM, the one just answered {closed:?}, exit {:?}",
        sent.elapsed()
    );
}

/// A client reusing its keep-alive connection as the drain begins (no lame duck: the listeners
/// close at once) gets its next request answered, with `connection: close`, instead of finding
/// the connection closed under it.
#[test]
fn a_request_on_a_keepalive_connection_just_after_sigterm_is_answered() {
    let backend = Backend::start();
    let mut proxy = proxy_for(&backend, &[]);
    let mut client = send_raw(proxy.inbound[0], &get("/"));
    assert_eq!(read_response(&mut client).unwrap().status, 200);
    proxy.signal(libc::SIGTERM);
    thread::sleep(Duration::from_millis(100));
    client.write_all(&get("/after")).unwrap();
    let response = read_response(&mut client).expect("the request after SIGTERM was answered");
    assert_eq!(response.status, 200);
    assert_eq!(response.header("connection"), Some("close"));
    assert_eq!(wait_close(&mut client, PATIENCE).0, Close::Eof);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

/// A response whose head went out before the drain began ends as its head said: the connection
/// is not closed under the client (its head promised keep-alive), and its next request is
/// answered with `connection: close`.
#[test]
fn a_response_begun_before_the_drain_keeps_its_connection_as_its_head_said() {
    let backend = Backend::start();
    let mut proxy = proxy_for(&backend, &[]);
    let mut client = send_raw(
        proxy.inbound[0],
        &get("/slow?chunks=5&size=10&interval=100"),
    );
    client.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut received = Vec::new();
    let mut buf = [0u8; 1024];
    let head_end = loop {
        let n = client.read(&mut buf).unwrap();
        assert!(n > 0, "closed in the head");
        received.extend_from_slice(&buf[..n]);
        if let Some(end) = received.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
    };
    let head = String::from_utf8_lossy(&received[..head_end]).to_lowercase();
    assert!(!head.contains("connection: close"), "{head}");
    proxy.signal(libc::SIGTERM);
    while received.len() < head_end + 50 {
        let n = client.read(&mut buf).unwrap();
        assert!(n > 0, "closed in the body");
        received.extend_from_slice(&buf[..n]);
    }
    assert_eq!(received.len(), head_end + 50, "bytes after the body");
    client.write_all(&get("/next")).unwrap();
    let response = read_response(&mut client).expect("the next request was answered");
    assert_eq!(response.status, 200);
    assert_eq!(response.header("connection"), Some("close"));
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

/// A parked keep-alive connection is reset, like every other, when a second signal stops the
/// drain while the lame-duck period still keeps it open.
#[test]
fn parked_keepalive_connection_is_reset_by_a_second_signal() {
    let backend = Backend::start();
    let mut proxy = proxy_for(
        &backend,
        &["--lame-duck-period=30s", "--shutdown-grace-period=60s"],
    );
    let mut parked = send_raw(proxy.inbound[0], &get("/"));
    assert_eq!(read_response(&mut parked).unwrap().status, 200);
    thread::sleep(Duration::from_millis(200));
    proxy.signal(libc::SIGTERM);
    wait_until("/ready turns 503", PATIENCE, || {
        proxy.get("/ready").status == 503
    });
    thread::sleep(Duration::from_millis(100));
    assert!(proxy.is_running(), "the lame-duck period keeps it open");
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(143));
    assert_eq!(wait_close(&mut parked, PATIENCE).0, Close::Reset);
}

#[test]
fn connections_that_never_sent_a_byte_are_closed_at_once() {
    let backend = Backend::start();
    let outbound = backend.route("127.0.0.1:0");
    let mut proxy = proxy_for(
        &backend,
        &["--outbound", &outbound, "--shutdown-grace-period=3s"],
    );
    let mut silent_in = TcpStream::connect(proxy.inbound[0]).unwrap();
    let mut silent_out = TcpStream::connect(proxy.outbound[0]).unwrap();
    let mut partial = send_raw(proxy.inbound[0], b"GET");
    // All three accepted, not waiting in a listen queue when the signal comes.
    proxy.wait_open_connections(3);
    let sent = Instant::now();
    proxy.signal(libc::SIGTERM);
    for silent in [&mut silent_in, &mut silent_out] {
        let (close, _) = wait_close(silent, PATIENCE);
        assert_eq!(close, Close::Eof);
        assert!(
            sent.elapsed() < Duration::from_millis(500),
            "a silent connection held the drain for {:?}",
            sent.elapsed()
        );
    }
    // The partial request is forwarded as TCP after the detection timeout and cut at grace.
    let _ = wait_close(&mut partial, PATIENCE);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    assert!(
        sent.elapsed() < Duration::from_secs(4),
        "exit at {:?}, grace is 3s",
        sent.elapsed()
    );
}

#[test]
fn pipelined_requests_behind_the_inflight_one_are_not_forwarded() {
    let backend = Backend::start();
    let mut proxy = proxy_for(&backend, &[]);
    let mut pipelined = get("/delay?ms=300&size=4194304&id=1");
    pipelined.extend(get("/delay?id=2"));
    pipelined.extend(get("/delay?id=3"));
    let mut client = send_raw(proxy.inbound[0], &pipelined);
    wait_seen(&backend, "/delay?id=1");
    proxy.signal(libc::SIGTERM);
    thread::sleep(Duration::from_millis(500));
    // Read slowly: the proxy must not reset while our unread bytes and its FIN are in flight.
    let mut head = [0u8; 1024];
    client.read_exact(&mut head).unwrap();
    thread::sleep(Duration::from_millis(300));
    let mut rest = Vec::new();
    let outcome = client.read_to_end(&mut rest);
    assert!(outcome.is_ok(), "the connection was reset: {outcome:?}");
    let mut raw = head.to_vec();
    raw.extend(rest);
    let text_end = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    let head = String::from_utf8_lossy(&raw[..text_end]).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("connection: close"), "{head}");
    assert_eq!(
        raw.len() - text_end,
        4_194_304,
        "the first response is complete and nothing follows it"
    );
    assert_eq!(
        backend.seen_paths(),
        vec!["/delay?id=1"],
        "pipelined requests reached the app"
    );
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn grace_expiry_cuts_a_streaming_response_and_a_websocket() {
    let backend = Backend::start();
    // No close-spread window: what is still open at the deadline is reset (the window's ends
    // are tests/close_spread.rs').
    let mut proxy = proxy_for(
        &backend,
        &["--shutdown-grace-period=2s", "--close-spread-window=0s"],
    );
    let mut streaming = send_raw(proxy.inbound[0], &get("/forever"));
    let mut first = [0u8; 64];
    streaming.read_exact(&mut first).unwrap();
    let mut ws = websocket(proxy.inbound[0]);
    let sent = Instant::now();
    proxy.signal(libc::SIGTERM);
    let (close, _) = wait_close(&mut streaming, PATIENCE);
    let at = sent.elapsed();
    assert_ne!(close, Close::Open);
    assert!(
        at >= Duration::from_millis(1900) && at < Duration::from_secs(4),
        "cut at {at:?}, grace 2s"
    );
    let (ws_close, _) = wait_close(&mut ws, PATIENCE);
    assert_eq!(ws_close, Close::Reset, "the tunnel is reset at grace");
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    let logs = proxy.logs.text();
    assert!(
        logs.contains("protocol=websocket"),
        "the WebSocket is named as a survivor:\n{logs}"
    );
    assert!(logs.contains("protocol=http1"), "{logs}");
}

/// Opens a WebSocket through `addr` and checks the 101.
fn websocket(addr: std::net::SocketAddr) -> TcpStream {
    let mut ws = send_raw(
        addr,
        b"GET /ws HTTP/1.1\r\nHost: app.local\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
          Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
    );
    let response = read_response(&mut ws).unwrap();
    assert_eq!(response.status, 101);
    assert_eq!(response.header("upgrade"), Some("websocket"));
    assert!(
        response
            .header("connection")
            .is_some_and(|c| c.eq_ignore_ascii_case("upgrade"))
    );
    echo_round_trip(&mut ws, b"\x81\x05hello");
    ws
}

#[test]
fn websocket_keeps_flowing_while_draining() {
    let backend = Backend::start();
    let mut proxy = proxy_for(&backend, &[]);
    let mut ws = websocket(proxy.inbound[0]);
    let conns = proxy.get("/connections").body;
    assert!(conns.contains("\"protocol\": \"websocket\""), "{conns}");
    assert_eq!(backend.seen()[0].header("upgrade"), Some("websocket"));
    proxy.signal(libc::SIGTERM);
    wait_until("refused", PATIENCE, || {
        try_connect(proxy.inbound[0]) == Attempt::Refused
    });
    for round in 0..10u8 {
        echo_round_trip(&mut ws, &[0x81, 1, round]);
        thread::sleep(Duration::from_millis(100));
    }
    assert!(proxy.is_running());
    drop(ws);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn target_dying_mid_body_never_looks_complete() {
    let backend = Backend::start();
    let mut proxy = proxy_for(&backend, &[]);
    let mut client = send_raw(proxy.inbound[0], &get("/die?chunks=40&length=1000000"));
    let outcome = read_response(&mut client);
    match outcome {
        Err(error) => assert!(
            matches!(
                error.kind(),
                ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset
            ),
            "{error}"
        ),
        Ok(response) => panic!(
            "a truncated body was delivered as complete: {} bytes",
            response.body.len()
        ),
    }
    // The proxy keeps serving.
    let mut next = send_raw(proxy.inbound[0], &get("/"));
    assert_eq!(read_response(&mut next).unwrap().status, 200);
    proxy.signal(libc::SIGTERM);
    drop(next);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn unreachable_target_answers_502_and_slow_target_504() {
    let closed = closed_port();
    let mut proxy = Proxy::start(&["--inbound", &format!("127.0.0.1:0={closed}/http")]);
    for _ in 0..20 {
        let started = Instant::now();
        let mut client = send_raw(proxy.inbound[0], &get("/"));
        let response = read_response(&mut client).unwrap();
        assert_eq!(response.status, 502);
        assert_eq!(
            String::from_utf8_lossy(&response.body),
            format!("bad gateway: cannot connect to {closed}\n")
        );
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "502 took {:?}",
            started.elapsed()
        );
    }
    assert_eq!(
        proxy.metric("lameduck_requests_total{direction=\"inbound\",status_class=\"5xx\"}"),
        20.0
    );
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));

    let backend = Backend::start();
    let mut proxy = proxy_for(&backend, &["--http-response-timeout=500ms"]);
    let started = Instant::now();
    let mut client = send_raw(proxy.inbound[0], &get("/hang"));
    let response = read_response(&mut client).unwrap();
    assert_eq!(response.status, 504);
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(3),
        "504 after {took:?}"
    );
    proxy.signal(libc::SIGTERM);
    drop(client);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn hanging_target_is_cut_at_grace() {
    let backend = Backend::start();
    // No close-spread window: the request is cut at the deadline (with one, its connection
    // closes at its time in the window: tests/close_spread.rs).
    let mut proxy = proxy_for(
        &backend,
        &["--shutdown-grace-period=2s", "--close-spread-window=0s"],
    );
    let mut client = send_raw(proxy.inbound[0], &get("/hang"));
    wait_seen(&backend, "/hang");
    let sent = Instant::now();
    proxy.signal(libc::SIGTERM);
    let (close, _) = wait_close(&mut client, PATIENCE);
    assert_ne!(close, Close::Open);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    let at = sent.elapsed();
    assert!(
        at >= Duration::from_millis(1900) && at < Duration::from_secs(3),
        "exit at {at:?}"
    );
}

#[test]
fn malformed_requests_get_400_and_never_reach_the_app() {
    let backend = Backend::start();
    let route = format!("{}/http", backend.route("127.0.0.1:0"));
    let mut proxy = Proxy::start(&["--inbound", &route]);
    let malformed: &[&[u8]] = &[
        b"GE T / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: foo\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nX-Bad: a\0b\r\n\r\n",
        b"G@T / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /\x01 HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    ];
    for bytes in malformed {
        let mut client = send_raw(proxy.inbound[0], bytes);
        let response = read_response(&mut client).unwrap();
        assert_eq!(response.status, 400, "{:?}", String::from_utf8_lossy(bytes));
        assert_eq!(
            wait_close(&mut client, PATIENCE).0,
            Close::Eof,
            "{:?}",
            String::from_utf8_lossy(bytes)
        );
    }
    assert!(
        backend.seen().is_empty(),
        "malformed requests reached the app: {:?}",
        backend.seen()
    );
    assert!(proxy.is_running());
    let mut ok = send_raw(proxy.inbound[0], &get("/"));
    assert_eq!(read_response(&mut ok).unwrap().status, 200);
}

#[test]
fn smuggling_attempts_never_desynchronise_proxy_and_app() {
    let backend = Backend::start();
    let mut proxy = proxy_for(&backend, &[]);
    let smuggled = "GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n";
    // (request, whether the trailing GET is legitimately a second pipelined request)
    let attempts = [
        (
            format!(
                "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n{smuggled}"
            ),
            false,
        ),
        (
            format!(
                "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\n{smuggled}"
            ),
            false,
        ),
        (
            format!(
                "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n{smuggled}"
            ),
            false,
        ),
        (
            format!("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: +3\r\n\r\nabc{smuggled}"),
            false,
        ),
        (
            format!(
                "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 40\r\n\r\nabc{smuggled}"
            ),
            false,
        ),
        (
            format!(
                "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff1\r\n\r\n{smuggled}"
            ),
            false,
        ),
        // Trailing whitespace is optional whitespace (RFC 9110): this is plain chunked, and the
        // GET is a second request that both the proxy and the app see as one.
        (
            format!(
                "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\t\r\n\r\n0\r\n\r\n{smuggled}"
            ),
            true,
        ),
    ];
    for (request, pipelined) in &attempts {
        let before = backend.seen().len();
        let mut client = send_raw(proxy.inbound[0], request.as_bytes());
        client
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        let mut answers = Vec::new();
        let _ = client.read_to_end(&mut answers);
        thread::sleep(Duration::from_millis(100));
        let seen = backend.seen()[before..].to_vec();
        let responses = String::from_utf8_lossy(&answers)
            .matches("HTTP/1.1 ")
            .count();
        assert!(
            seen.len() <= responses,
            "the app saw {} requests, the client got {responses} responses: {request:?}",
            seen.len()
        );
        assert_eq!(
            seen.iter().any(|s| s.path == "/smuggled"),
            *pipelined,
            "{request:?} -> {:?}",
            String::from_utf8_lossy(&answers)
        );
        for seen in &seen {
            let framing = ["content-length", "transfer-encoding"]
                .iter()
                .filter(|h| seen.header(h).is_some())
                .count();
            assert!(framing <= 1, "the app got two framing headers: {seen:?}");
        }
    }
    assert!(proxy.is_running());
}

#[test]
fn oversized_headers_get_431_without_growing_memory() {
    let backend = Backend::start();
    let mut proxy = proxy_for(&backend, &["--http-max-header-size=16KiB"]);
    let long_name = format!(
        "GET / HTTP/1.1\r\nHost: x\r\n{}: 1\r\n\r\n",
        "a".repeat(64 * 1024)
    );
    let many = format!(
        "GET / HTTP/1.1\r\nHost: x\r\n{}\r\n",
        (0..101)
            .map(|i| format!("x-h{i}: v\r\n"))
            .collect::<String>()
    );
    let huge = format!(
        "GET / HTTP/1.1\r\nHost: x\r\nx-big: {}\r\n\r\n",
        "b".repeat(1024 * 1024)
    );
    let rss_before = rss_kib(proxy.pid());
    for round in 0..200 {
        for request in [&long_name, &many, &huge] {
            let mut client = TcpStream::connect(proxy.inbound[0]).unwrap();
            client.set_read_timeout(Some(PATIENCE)).unwrap();
            let _ = client.write_all(request.as_bytes());
            let mut response = Vec::new();
            let _ = client.read_to_end(&mut response);
            if round == 0 {
                let text = String::from_utf8_lossy(&response);
                assert!(
                    text.starts_with("HTTP/1.1 431"),
                    "{}",
                    &text[..text.len().min(100)]
                );
            }
        }
    }
    let growth = rss_kib(proxy.pid()).saturating_sub(rss_before);
    eprintln!("RSS grew {growth} KiB over 600 oversized requests");
    assert!(growth < 10 * 1024, "RSS grew {growth} KiB");
    assert!(backend.seen().is_empty());
    assert!(proxy.is_running());
}

#[test]
fn slow_headers_are_cut_at_the_header_read_timeout() {
    let backend = Backend::start();
    let route = format!("{}/http", backend.route("127.0.0.1:0"));
    let proxy = Proxy::start(&["--inbound", &route, "--http-header-read-timeout=1s"]);
    let silent_start = Instant::now();
    let mut silent = TcpStream::connect(proxy.inbound[0]).unwrap();
    let trickle_start = Instant::now();
    let mut trickle = TcpStream::connect(proxy.inbound[0]).unwrap();
    let trickler = thread::spawn(move || {
        for byte in b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ".iter().cycle() {
            if trickle.write_all(&[*byte]).is_err() {
                return (trickle, trickle_start.elapsed());
            }
            thread::sleep(Duration::from_millis(200));
            if trickle_start.elapsed() > PATIENCE {
                return (trickle, trickle_start.elapsed());
            }
        }
        unreachable!()
    });
    let (close, _) = wait_close(&mut silent, PATIENCE);
    let silent_at = silent_start.elapsed();
    assert_ne!(close, Close::Open);
    assert!(
        silent_at >= Duration::from_millis(900) && silent_at < Duration::from_secs(3),
        "silent client cut at {silent_at:?}"
    );
    let (_, trickle_at) = trickler.join().unwrap();
    assert!(
        trickle_at < Duration::from_secs(3),
        "a byte-a-time client was cut only at {trickle_at:?}"
    );
    eprintln!("silent client cut at {silent_at:?}, trickling client at {trickle_at:?}");

    // Hundreds of clients stuck in their headers do not slow the others down.
    let stuck: Vec<TcpStream> = (0..500)
        .map(|_| send_raw(proxy.inbound[0], b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: "))
        .collect();
    let mut latencies: Vec<Duration> = (0..100)
        .map(|_| {
            let started = Instant::now();
            let mut client = send_raw(proxy.inbound[0], &get("/"));
            assert_eq!(read_response(&mut client).unwrap().status, 200);
            started.elapsed()
        })
        .collect();
    latencies.sort();
    let p99 = latencies[98];
    eprintln!(
        "with 500 stuck clients, p50 {:?}, p99 {p99:?}",
        latencies[50]
    );
    assert!(
        p99 < Duration::from_millis(250),
        "p99 {p99:?} with 500 slowloris clients"
    );
    drop(stuck);
    let mut ok = send_raw(proxy.inbound[0], &get("/"));
    assert_eq!(read_response(&mut ok).unwrap().status, 200);
    assert!(
        backend
            .seen()
            .iter()
            .all(|seen| seen.header("x-slow").is_none())
    );
}

#[test]
fn auto_routes_forward_other_protocols_byte_for_byte() {
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&["--inbound", &echo.route("127.0.0.1:0")]);
    let tls_client_hello: Vec<u8> = [
        &[
            0x16u8, 0x03, 0x01, 0x00, 0xf4, 0x01, 0x00, 0x00, 0xf0, 0x03, 0x03,
        ][..],
        &[0x5a; 240],
    ]
    .concat();
    let postgres_startup: Vec<u8> = [
        &[0u8, 0, 0, 41, 0, 3, 0, 0][..],
        b"user\0postgres\0database\0postgres\0\0",
    ]
    .concat();
    let random: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    for payload in [tls_client_hello, postgres_startup, random] {
        let mut client = TcpStream::connect(proxy.inbound[0]).unwrap();
        client.set_read_timeout(Some(PATIENCE)).unwrap();
        echo_round_trip(&mut client, &payload);
    }
    let conns = proxy.get("/connections").body;
    assert!(!conns.contains("http1"), "{conns}");
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn server_speaks_first_works_on_tcp_routes_and_on_auto_after_the_detection_timeout() {
    let greeter = TcpListener::bind("127.0.0.1:0").unwrap();
    let greeter_addr = greeter.local_addr().unwrap();
    thread::spawn(move || {
        for stream in greeter.incoming() {
            let Ok(mut stream) = stream else { continue };
            thread::spawn(move || {
                stream.write_all(b"220 smtp.local ESMTP ready\r\n").unwrap();
                let mut buf = [0u8; 64];
                if let Ok(n) = stream.read(&mut buf) {
                    let _ = stream.write_all(&buf[..n]);
                }
            });
        }
    });
    let mut proxy = Proxy::start(&[
        "--inbound",
        &format!("127.0.0.1:0={greeter_addr}/tcp"),
        "--inbound",
        &format!("127.0.0.1:0={greeter_addr}"),
        "--detect-timeout=300ms",
    ]);
    for (addr, min_wait) in [
        (proxy.inbound[0], Duration::ZERO),
        (proxy.inbound[1], Duration::from_millis(250)),
    ] {
        let started = Instant::now();
        let mut client = TcpStream::connect(addr).unwrap();
        client.set_read_timeout(Some(PATIENCE)).unwrap();
        let mut greeting = [0u8; 28];
        client.read_exact(&mut greeting).unwrap();
        assert_eq!(&greeting, b"220 smtp.local ESMTP ready\r\n");
        assert!(started.elapsed() >= min_wait);
        echo_round_trip(&mut client, b"EHLO me\r\n");
    }
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn lame_duck_asks_every_http_connection_to_go_away_and_still_serves_new_ones() {
    let backend = Backend::start();
    let mut proxy = proxy_for(
        &backend,
        &["--lame-duck-period=1500ms", "--shutdown-grace-period=10s"],
    );
    let mut old = send_raw(proxy.inbound[0], &get("/"));
    assert_eq!(read_response(&mut old).unwrap().status, 200);
    let sent = Instant::now();
    proxy.signal(libc::SIGTERM);
    wait_until("/ready turns 503", PATIENCE, || {
        proxy.get("/ready").status == 503
    });

    // An existing keep-alive connection is not cut, but its next response says close.
    thread::sleep(Duration::from_millis(100));
    old.write_all(&get("/")).unwrap();
    let response = read_response(&mut old).unwrap();
    assert_eq!(
        (response.status, response.header("connection")),
        (200, Some("close"))
    );
    assert_eq!(wait_close(&mut old, PATIENCE).0, Close::Eof);

    // A new HTTP/1 connection is accepted and served once, with connection: close.
    let mut new = send_raw(proxy.inbound[0], &get("/"));
    let response = read_response(&mut new).unwrap();
    assert_eq!(
        (response.status, response.header("connection")),
        (200, Some("close"))
    );

    // A new HTTP/2 connection is served its first request, then gets GOAWAY.
    let mut h2 = support::h2raw::H2::connect(proxy.inbound[0]);
    h2.get(1, "/");
    let (mut goaway, mut done) = (false, false);
    let frames = h2
        .read_until(|frame| {
            goaway |= frame.kind == support::h2raw::GOAWAY;
            done |= support::h2raw::ended(std::slice::from_ref(frame), 1);
            goaway && done
        })
        .unwrap();
    assert!(
        frames.iter().any(|f| f.stream == 1 && f.is_status_200()),
        "{frames:?}"
    );
    assert!(
        sent.elapsed() < Duration::from_millis(1500),
        "the machine was too slow to test inside the period"
    );

    wait_until("refused after the lame-duck period", PATIENCE, || {
        try_connect(proxy.inbound[0]) == Attempt::Refused
    });
    assert!(sent.elapsed() >= Duration::from_millis(1400));
    drop(h2);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn expect_100_continue_passes_through() {
    let backend = Backend::start();
    let mut proxy = proxy_for(&backend, &[]);
    let mut client = send_raw(
        proxy.inbound[0],
        b"POST /echo HTTP/1.1\r\nHost: app.local\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n",
    );
    let interim = read_response(&mut client).unwrap();
    assert_eq!(
        interim.status, 100,
        "the client is told to continue before it sends the body"
    );
    client.write_all(b"hello").unwrap();
    let response = read_response(&mut client).unwrap();
    assert_eq!(
        (response.status, response.body.as_slice()),
        (200, &b"hello"[..])
    );
    assert_eq!(backend.seen()[0].body, b"hello");
    drop(client);
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

/// The keep-alive race replayed goes on a new connection, never on another idle one: a
/// target that closes idle connections after a timeout closes those last used together at
/// once. Deterministic: this target answers the first request of each connection only and
/// closes at any later one, and the proxy holds two idle connections to it; the third request
/// meets the close on one, and its replay would meet it on the other.
#[test]
fn a_replay_after_the_keep_alive_race_goes_on_a_new_connection() {
    let target = TcpListener::bind("127.0.0.1:0").unwrap();
    let target_addr = target.local_addr().unwrap();
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = accepted.clone();
    thread::spawn(move || {
        for stream in target.incoming() {
            let Ok(mut stream) = stream else { continue };
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            thread::spawn(move || {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                let mut served = 0;
                while let Ok(1) = stream.read(&mut byte) {
                    head.push(byte[0]);
                    if !head.ends_with(b"\r\n\r\n") {
                        continue;
                    }
                    head.clear();
                    if served > 0 {
                        // A later request: closed, unanswered.
                        return;
                    }
                    served += 1;
                    // Slow enough that two requests at once take two connections.
                    thread::sleep(Duration::from_millis(300));
                    if stream
                        .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    let mut proxy = Proxy::start(&["--inbound", &format!("127.0.0.1:0={target_addr}/http")]);
    let mut clients: Vec<TcpStream> = (0..2)
        .map(|_| TcpStream::connect(proxy.inbound[0]).unwrap())
        .collect();
    for client in &mut clients {
        client.set_read_timeout(Some(PATIENCE)).unwrap();
        client.write_all(&get("/first")).unwrap();
    }
    for client in &mut clients {
        assert_eq!(read_response(client).unwrap().status, 200);
    }
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
    // Both connections idle in the proxy's pool; the next request meets a close on either.
    clients[0].write_all(&get("/third")).unwrap();
    let response = read_response(&mut clients[0]).unwrap();
    assert_eq!(
        response.status,
        200,
        "the replay went on another idle connection: {:?}",
        String::from_utf8_lossy(&response.body)
    );
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 3);
    drop(clients);
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn target_closing_idle_keepalive_connections_costs_no_request() {
    // A target that closes every keep-alive connection after exactly 300 ms of idleness,
    // while the client sends a request every 300 ms: the pooled connection races its close.
    let target = TcpListener::bind("127.0.0.1:0").unwrap();
    let target_addr = target.local_addr().unwrap();
    let request_lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let recorded = request_lines.clone();
    thread::spawn(move || {
        for stream in target.incoming() {
            let Ok(mut stream) = stream else { continue };
            let recorded = recorded.clone();
            thread::spawn(move || {
                stream
                    .set_read_timeout(Some(Duration::from_millis(300)))
                    .unwrap();
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                loop {
                    match stream.read(&mut byte) {
                        Ok(1) => head.push(byte[0]),
                        _ => return,
                    }
                    if head.ends_with(b"\r\n\r\n") {
                        let text = String::from_utf8_lossy(&head).into_owned();
                        recorded
                            .lock()
                            .unwrap()
                            .push(text.lines().next().unwrap_or("").to_string());
                        // Bodies here are 4 bytes: read them.
                        if text.to_ascii_lowercase().contains("content-length: 4") {
                            let mut body = [0u8; 4];
                            if stream.read_exact(&mut body).is_err() {
                                return;
                            }
                        }
                        head.clear();
                        if stream
                            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                            .is_err()
                        {
                            return;
                        }
                    }
                }
            });
        }
    });
    let mut proxy = Proxy::start(&["--inbound", &format!("127.0.0.1:0={target_addr}/http")]);
    let mut client = TcpStream::connect(proxy.inbound[0]).unwrap();
    client.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut statuses = Vec::new();
    for _ in 0..30 {
        client.write_all(&get("/")).unwrap();
        statuses.push(read_response(&mut client).unwrap().status);
        thread::sleep(Duration::from_millis(300));
    }
    let failed = statuses.iter().filter(|&&status| status != 200).count();
    eprintln!(
        "{failed} of {} requests failed as the target closed idle connections",
        statuses.len()
    );
    assert_eq!(failed, 0, "{statuses:?}");

    // A POST is never replayed, even when its connection races the close: it may fail (502),
    // but the target sees each at most once.
    for i in 0..10 {
        let post =
            format!("POST /post-{i} HTTP/1.1\r\nHost: app.local\r\nContent-Length: 4\r\n\r\nbody");
        client.write_all(post.as_bytes()).unwrap();
        let status = read_response(&mut client).unwrap().status;
        assert!(status == 200 || status == 502, "{status}");
        thread::sleep(Duration::from_millis(300));
    }
    let lines = request_lines.lock().unwrap().clone();
    for i in 0..10 {
        let line = format!("POST /post-{i} HTTP/1.1");
        assert!(
            lines.iter().filter(|l| **l == line).count() <= 1,
            "{line} was replayed: {lines:?}"
        );
    }
    drop(client);
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

/// Between requests an idle HTTP/1 keep-alive connection is parked (hyper's connection and its
/// buffers dropped, the socket kept): the next request, a request whose head arrives in
/// pieces, and a pipelined request cut in the middle all still get their answers.
#[test]
fn parked_keepalive_connections_serve_split_and_pipelined_requests() {
    let backend = Backend::start();
    let proxy = proxy_for(&backend, &[]);
    let park = Duration::from_millis(300);
    let mut client = send_raw(proxy.inbound[0], &get("/a"));
    assert_eq!(read_response(&mut client).unwrap().status, 200);
    thread::sleep(park);

    // The next request's head in two pieces, with a pause between them.
    client.write_all(b"GET /b HTTP/1.1\r\nHo").unwrap();
    thread::sleep(park);
    client.write_all(b"st: app.local\r\n\r\n").unwrap();
    assert_eq!(read_response(&mut client).unwrap().status, 200);
    thread::sleep(park);

    // A request and the first half of the next one in one write.
    let mut both = get("/c");
    both.extend_from_slice(b"GET /d HTTP/1.1\r\nHo");
    client.write_all(&both).unwrap();
    assert_eq!(read_response(&mut client).unwrap().status, 200);
    thread::sleep(park);
    client.write_all(b"st: app.local\r\n\r\n").unwrap();
    assert_eq!(read_response(&mut client).unwrap().status, 200);
    thread::sleep(park);

    client.write_all(&get("/e")).unwrap();
    assert_eq!(read_response(&mut client).unwrap().status, 200);
    assert_eq!(backend.seen_paths(), ["/a", "/b", "/c", "/d", "/e"]);
}

/// An app that answers before reading the request body: the rest of the body that the client
/// keeps sending is never taken for a request, on a connection that stays quiet in between.
#[test]
fn an_unread_request_body_is_never_taken_for_the_next_request() {
    let backend = Backend::start();
    let proxy = proxy_for(&backend, &[]);
    let mut client = send_raw(
        proxy.inbound[0],
        b"POST /early HTTP/1.1\r\nHost: app.local\r\nContent-Length: 20000\r\n\r\n",
    );
    client.write_all(&[b'x'; 1000]).unwrap();
    let response = read_response(&mut client).unwrap();
    assert_eq!(response.status, 200);
    assert_eq!(response.body, b"early");
    thread::sleep(Duration::from_millis(300));
    // The rest of the body, shaped like a request, then a real one.
    let mut rest = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
    rest.resize(19_000, b'x');
    rest.extend_from_slice(&get("/after"));
    let _ = client.write_all(&rest);
    // The connection either serves /after or closes; it never answers anything else.
    match read_response(&mut client) {
        Ok(response) => assert_eq!(response.status, 200, "{response:?}"),
        Err(error) => eprintln!("the proxy closed the connection after the early answer: {error}"),
    }
    thread::sleep(Duration::from_millis(100));
    let paths = backend.seen_paths();
    assert!(!paths.iter().any(|path| path == "/smuggled"), "{paths:?}");
    assert!(
        paths
            .iter()
            .all(|path| path == "/early" || path == "/after"),
        "{paths:?}"
    );
}

/// A keep-alive connection that stays idle is closed after the header read timeout (parked or
/// not), with a FIN.
#[test]
fn idle_keepalive_connection_is_closed_after_the_header_read_timeout() {
    let backend = Backend::start();
    let proxy = proxy_for(&backend, &["--http-header-read-timeout=1s"]);
    let mut client = send_raw(proxy.inbound[0], &get("/"));
    assert_eq!(read_response(&mut client).unwrap().status, 200);
    let idle = Instant::now();
    let (close, _) = wait_close(&mut client, PATIENCE);
    let closed = idle.elapsed();
    assert_eq!(close, Close::Eof, "FIN, not RST");
    assert!(
        closed >= Duration::from_millis(900) && closed < Duration::from_secs(3),
        "closed after {closed:?}"
    );
}

/// Idle keep-alive connections hold no HTTP buffers: hyper's 8 KiB read and write buffers are
/// released while a connection waits for its next request.
#[test]
fn idle_keepalive_connections_hold_no_http_buffers() {
    let backend = Backend::start();
    let proxy = proxy_for(&backend, &[]);
    let warm = send_raw(proxy.inbound[0], &get("/"));
    drop(warm);
    proxy.wait_open_connections(0);
    let before = rss_kib(proxy.pid());
    let held: Vec<TcpStream> = (0..1000)
        .map(|_| {
            let mut client = send_raw(proxy.inbound[0], &get("/"));
            assert_eq!(read_response(&mut client).unwrap().status, 200);
            client
        })
        .collect();
    thread::sleep(Duration::from_secs(1));
    let per_connection = rss_kib(proxy.pid()).saturating_sub(before) as f64 / held.len() as f64;
    eprintln!("{per_connection:.1} KiB per idle keep-alive connection (debug build)");
    assert!(
        per_connection < 8.0,
        "{per_connection:.1} KiB per idle keep-alive connection"
    );
}

/// Every test above, again with the fast lane off: both HTTP/1 engines keep this file's promises.
#[test]
fn the_same_through_hyper_alone() {
    support::run_again_through_hyper("the_same_through_hyper_alone");
}
