//! HTTP/2 through the proxy and its drain, asserted frame by frame (GOAWAY, streams that
//! finish or are refused, rapid reset and CONTINUATION floods).

mod support;

use std::io::ErrorKind;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use hyper_util::rt::{TokioExecutor, TokioIo};

use support::backend::{Backend, proxy_for};
use support::h2raw::*;
use support::process::cpu_total;
use support::*;

/// How a connection's frames ended.
#[derive(Debug, PartialEq, Eq)]
enum End {
    Eof,
    Reset,
}

/// Reads frames until the connection ends, answering SETTINGS and (when `ack_pings`) PINGs.
fn read_to_end(h2: &mut H2, ack_pings: bool, frames: &mut Vec<Frame>) -> End {
    loop {
        match h2.read_frame() {
            Ok(frame) => {
                if frame.kind == SETTINGS && frame.flags & ACK == 0 {
                    let _ = h2.try_send(SETTINGS, ACK, 0, &[]);
                }
                if ack_pings && frame.kind == PING && frame.flags & ACK == 0 {
                    let _ = h2.try_send(PING, ACK, 0, &frame.payload);
                }
                frames.push(frame);
            }
            Err(error) if error.kind() == ErrorKind::UnexpectedEof => return End::Eof,
            Err(error) if error.kind() == ErrorKind::ConnectionReset => return End::Reset,
            Err(error) => panic!("reading frames: {error}"),
        }
    }
}

#[test]
fn h2_goaway_lets_every_open_stream_finish() {
    let backend = Backend::start();
    let mut proxy = proxy_for(&backend, &[]);
    let mut h2 = H2::connect(proxy.inbound[0]);
    let streams: Vec<u32> = (0..50).map(|i| 1 + 2 * i).collect();
    for &id in &streams {
        h2.get(id, "/slow?chunks=16&size=1024&interval=50");
    }
    let mut heads = 0;
    let mut frames = h2
        .read_until(|frame| {
            heads += usize::from(frame.is_status_200());
            heads == 50
        })
        .unwrap();
    proxy.signal(libc::SIGTERM);
    let end = read_to_end(&mut h2, true, &mut frames);
    assert_eq!(end, End::Eof, "the connection ends with a FIN");

    let goaways: Vec<(u32, u32)> = frames
        .iter()
        .filter(|f| f.kind == GOAWAY)
        .map(Frame::goaway)
        .collect();
    assert_eq!(
        goaways.first(),
        Some(&(0x7fff_ffff, 0)),
        "the first GOAWAY announces the shutdown"
    );
    assert_eq!(
        goaways.last(),
        Some(&(99, 0)),
        "the final GOAWAY names the last stream"
    );
    assert!(
        frames.iter().any(|f| f.kind == PING && f.flags & ACK == 0),
        "a PING follows the first GOAWAY"
    );
    for &id in &streams {
        assert_eq!(body_bytes(&frames, id), 16 * 1024, "stream {id}");
        assert!(ended(&frames, id), "stream {id} ended");
    }
    assert!(
        !frames.iter().any(|f| f.kind == RST_STREAM),
        "no stream was reset"
    );
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn h2_stream_opened_after_the_final_goaway_never_reaches_the_app() {
    let backend = Backend::start();
    let mut proxy = proxy_for(&backend, &[]);
    let mut h2 = H2::connect(proxy.inbound[0]);
    h2.get(1, "/delay?ms=1500&id=1");
    wait_until("the backend sees stream 1", PATIENCE, || {
        backend.seen_paths().contains(&"/delay?id=1".to_string())
    });
    proxy.signal(libc::SIGTERM);

    // The first GOAWAY and its PING; the PING is not answered yet.
    let mut ping = None;
    let mut saw_goaway = false;
    let mut frames = h2
        .read_until(|frame| {
            if frame.kind == PING && frame.flags & ACK == 0 {
                ping = Some(frame.payload.clone());
            }
            saw_goaway |= frame.kind == GOAWAY;
            saw_goaway && ping.is_some()
        })
        .unwrap();
    assert_eq!(
        frames.iter().find(|f| f.kind == GOAWAY).unwrap().goaway(),
        (0x7fff_ffff, 0)
    );
    // A stream opened between the two GOAWAYs is still served.
    h2.get(3, "/delay?ms=200&id=3");
    h2.send(PING, ACK, 0, &ping.unwrap());
    frames.extend(
        h2.read_until(|frame| frame.kind == GOAWAY && frame.goaway().0 != 0x7fff_ffff)
            .unwrap(),
    );
    assert_eq!(
        frames
            .iter()
            .rev()
            .find(|f| f.kind == GOAWAY)
            .unwrap()
            .goaway(),
        (3, 0)
    );
    // One opened after the final GOAWAY is refused: it never reaches the app.
    let _ = h2.try_send(
        HEADERS,
        END_HEADERS | END_STREAM,
        5,
        &header_block(&[
            (":method", "GET"),
            (":scheme", "http"),
            (":path", "/delay?id=5"),
            (":authority", "app.local"),
        ]),
    );
    read_to_end(&mut h2, true, &mut frames);
    for id in [1, 3] {
        assert!(
            frames.iter().any(|f| f.stream == id && f.is_status_200()),
            "stream {id} got its 200"
        );
        assert!(ended(&frames, id), "stream {id} completed");
    }
    assert!(
        !frames.iter().any(|f| f.stream == 5 && f.kind == HEADERS),
        "stream 5 got a response"
    );
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    assert!(
        !backend.seen_paths().contains(&"/delay?id=5".to_string()),
        "stream 5 reached the app"
    );
}

#[test]
fn h2_client_that_never_acks_the_ping_is_closed_at_grace() {
    let backend = Backend::start();
    let mut proxy = proxy_for(&backend, &["--shutdown-grace-period=2s"]);
    let mut h2 = H2::connect(proxy.inbound[0]);
    h2.read_until(|frame| frame.kind == SETTINGS).unwrap();
    let sent = Instant::now();
    proxy.signal(libc::SIGTERM);
    let mut frames = Vec::new();
    let end = read_to_end(&mut h2, false, &mut frames);
    let at = sent.elapsed();
    assert!(frames.iter().any(|f| f.kind == GOAWAY));
    assert_eq!(end, End::Reset);
    assert!(
        at >= Duration::from_millis(1900) && at < Duration::from_secs(4),
        "closed at {at:?}"
    );
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    let logs = proxy.logs.text();
    assert!(
        logs.contains("force-closing") && logs.contains("protocol=http2"),
        "{logs}"
    );
}

#[test]
fn h2_rapid_reset_and_continuation_flood_get_goaway() {
    let backend = Backend::start();
    let mut proxy = proxy_for(&backend, &[]);
    let block = header_block(&[
        (":method", "GET"),
        (":scheme", "http"),
        (":path", "/delay?ms=100"),
        (":authority", "x"),
    ]);

    // Rapid reset: open and cancel streams as fast as possible.
    let mut h2 = H2::connect(proxy.inbound[0]);
    let started = Instant::now();
    for i in 0..10_000u32 {
        let id = 1 + 2 * i;
        if h2
            .try_send(HEADERS, END_HEADERS | END_STREAM, id, &block)
            .is_err()
            || h2.try_send(RST_STREAM, 0, id, &8u32.to_be_bytes()).is_err()
        {
            break;
        }
    }
    let mut frames = Vec::new();
    read_to_end(&mut h2, true, &mut frames);
    let goaway = frames.iter().find(|f| f.kind == GOAWAY).map(Frame::goaway);
    eprintln!(
        "rapid reset: {goaway:?} after {:?}, the app saw {} requests",
        started.elapsed(),
        backend.seen().len()
    );
    assert!(
        matches!(goaway, Some((_, 0xb | 0x1))),
        "expected GOAWAY ENHANCE_YOUR_CALM or PROTOCOL_ERROR, got {goaway:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));

    // CONTINUATION flood: a HEADERS frame without END_HEADERS and endless CONTINUATIONs.
    let mut h2 = H2::connect(proxy.inbound[0]);
    h2.send(HEADERS, 0, 1, &block);
    let filler = header_block(&[("x-flood", &"f".repeat(1000))]);
    let started = Instant::now();
    for _ in 0..100_000 {
        if h2.try_send(CONTINUATION, 0, 1, &filler).is_err() {
            break;
        }
    }
    let mut frames = Vec::new();
    read_to_end(&mut h2, true, &mut frames);
    let goaway = frames.iter().find(|f| f.kind == GOAWAY).map(Frame::goaway);
    eprintln!(
        "CONTINUATION flood: {goaway:?} after {:?}",
        started.elapsed()
    );
    assert!(goaway.is_some(), "no GOAWAY for a CONTINUATION flood");
    assert!(started.elapsed() < Duration::from_secs(5));

    // Well-behaved clients are still served, and the proxy is idle again.
    let mut h2 = H2::connect(proxy.inbound[0]);
    h2.get(1, "/");
    let frames = h2
        .read_until(|frame| frame.stream == 1 && frame.flags & END_STREAM != 0)
        .unwrap();
    assert!(frames.iter().any(|f| f.stream == 1 && f.is_status_200()));
    let cpu = cpu_total(proxy.pid());
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        cpu_total(proxy.pid()) - cpu < Duration::from_millis(100),
        "the proxy is still busy"
    );
    proxy.signal(libc::SIGTERM);
    drop(h2);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn h2_requests_keep_te_trailers_and_reach_the_app_over_http2() {
    let backend = Backend::start();
    let mut proxy = proxy_for(&backend, &[]);
    let mut h2 = H2::connect(proxy.inbound[0]);
    let block = header_block(&[
        (":method", "GET"),
        (":scheme", "http"),
        (":path", "/echo"),
        (":authority", "app.local"),
        ("te", "trailers"),
        ("x-kept", "yes"),
    ]);
    h2.send(HEADERS, END_HEADERS | END_STREAM, 1, &block);
    let frames = h2
        .read_until(|frame| frame.stream == 1 && frame.flags & END_STREAM != 0)
        .unwrap();
    assert!(frames.iter().any(|f| f.stream == 1 && f.is_status_200()));
    let seen = &backend.seen()[0];
    assert_eq!(
        seen.version, "HTTP/2.0",
        "the client's version is kept towards the app"
    );
    assert_eq!(seen.header("te"), Some("trailers"));
    assert_eq!(seen.header("x-kept"), Some("yes"));
    let conns = proxy.get("/connections").body;
    assert!(conns.contains("\"protocol\": \"http2\""), "{conns}");
    drop(h2);
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

/// An HTTP/2 app that answers one request per connection, then sends GOAWAY and closes it;
/// returns its address and how many connections it has accepted.
fn one_request_per_connection_app() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let (served, mut answered) = tokio::sync::mpsc::channel::<()>(1);
                    let service = hyper::service::service_fn(move |_request| {
                        let served = served.clone();
                        async move {
                            let _ = served.try_send(());
                            Ok::<_, std::convert::Infallible>(hyper::Response::new(
                                http_body_util::Full::new(bytes::Bytes::from_static(b"ok")),
                            ))
                        }
                    });
                    let connection = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service);
                    tokio::pin!(connection);
                    tokio::select! {
                        _ = connection.as_mut() => return,
                        _ = answered.recv() => connection.as_mut().graceful_shutdown(),
                    }
                    let _ = connection.await;
                });
            }
        });
    });
    (rx.recv().unwrap(), accepted)
}

#[test]
fn h2_requests_go_on_a_new_target_connection_after_the_app_closes_its_own() {
    let (app, accepted) = one_request_per_connection_app();
    let route = format!("127.0.0.1:0={app}");
    let mut proxy = Proxy::start(&["--inbound", &route]);
    let mut h2 = H2::connect(proxy.inbound[0]);
    for stream in [1, 3, 5] {
        h2.get(stream, "/");
        let frames = h2
            .read_until(|frame| frame.stream == stream && frame.flags & END_STREAM != 0)
            .unwrap();
        assert!(
            frames
                .iter()
                .any(|f| f.stream == stream && f.is_status_200()),
            "stream {stream}: {frames:?}"
        );
        // The app's GOAWAY reaches the proxy before the next request.
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        3,
        "each request after the app's GOAWAY went on a connection of its own"
    );
    drop(h2);
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn h2_streams_waiting_for_an_unanswering_target_share_one_connect_timeout() {
    let (_blackhole, target, fillers) = blackhole();
    let route = format!("127.0.0.1:0={target}");
    let mut proxy = Proxy::start(&["--inbound", &route, "--connect-timeout=300ms"]);
    let mut h2 = H2::connect(proxy.inbound[0]);
    let streams: Vec<u32> = (0..16).map(|n| 2 * n + 1).collect();
    let started = Instant::now();
    for &stream in &streams {
        h2.get(stream, "/");
    }
    let mut ended = Vec::new();
    let frames = h2
        .read_until(|frame| {
            if matches!(frame.kind, HEADERS | DATA) && frame.flags & END_STREAM != 0 {
                ended.push(frame.stream);
            }
            ended.len() == streams.len()
        })
        .unwrap();
    let took = started.elapsed();
    for &stream in &streams {
        let body: Vec<u8> = frames
            .iter()
            .filter(|f| f.stream == stream && f.kind == DATA)
            .flat_map(|f| f.payload.clone())
            .collect();
        assert!(
            String::from_utf8_lossy(&body).starts_with("gateway timeout"),
            "stream {stream}: {:?} in {:?}",
            String::from_utf8_lossy(&body),
            frames
                .iter()
                .filter(|f| f.stream == stream)
                .collect::<Vec<_>>()
        );
    }
    // One after another, 16 connect timeouts of 300 ms would take 4.8 s.
    assert!(
        took < Duration::from_millis(2500),
        "16 streams answered after {took:?}"
    );
    drop((h2, fillers));
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

/// A client that starts the HTTP/2 preface and gets it wrong is not speaking HTTP/2 (RFC 9113
/// section 3.4: a connection error, and the GOAWAY may be omitted): the connection closes
/// promptly with nothing but HTTP/2 frames on it, and nothing reaches the app. On an `http`
/// route it is not taken for an HTTP/1 request. (On an `auto` route, bytes that are neither
/// protocol are opaque TCP for the app, by design.)
#[test]
fn an_invalid_http2_preface_is_a_connection_error_not_an_http1_request() {
    use std::io::{Read, Write};
    let backend = Backend::start();
    let protocol = "http";
    let proxy = Proxy::start(&[
        "--inbound",
        &format!("127.0.0.1:0={}/{protocol}", backend.addr),
    ]);
    let mut stream = std::net::TcpStream::connect(proxy.inbound[0]).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    stream
        .write_all(b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n")
        .unwrap();
    let mut bytes = Vec::new();
    let since = Instant::now();
    match stream.read_to_end(&mut bytes) {
        Ok(_) => {}
        Err(error) if error.kind() == ErrorKind::ConnectionReset => {}
        Err(error) => panic!("{protocol}: not closed: {error}"),
    }
    assert!(since.elapsed() < PATIENCE, "{protocol}");
    let mut rest = &bytes[..];
    while !rest.is_empty() {
        assert!(rest.len() >= 9, "{protocol}: not HTTP/2 frames: {bytes:?}");
        let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
        let kind = rest[3];
        assert!(
            kind == SETTINGS || kind == GOAWAY,
            "{protocol}: frame type {kind} in {bytes:?}"
        );
        rest = &rest[(9 + len).min(rest.len())..];
    }
    assert!(
        backend.seen().is_empty(),
        "{protocol}: the app got a request"
    );
}
