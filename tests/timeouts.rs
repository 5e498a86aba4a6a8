//! Every state in which nothing moves has a bound: a raw socket stalls exactly there, the proxy
//! closes it within its bound plus a small slack, a good request on another connection
//! succeeds meanwhile, and the metric counts the timeout.

mod support;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use support::backend::{Backend, get, read_response, send_raw};
use support::h2raw::{
    self, CONTINUATION, END_HEADERS, END_STREAM, GOAWAY, H2, HEADERS, PREFACE, SETTINGS,
};
use support::{PATIENCE, Proxy, shutdown_write, silent_target};

/// The bound under test, and the slack allowed past it (the checks look every quarter of a
/// bound; a stalled HTTP/2 client gets a second to answer the GOAWAY's PING before the reset;
/// this machine is shared).
const BOUND: Duration = Duration::from_secs(1);
const SLACK: Duration = Duration::from_secs(2);

/// Waits until the proxy closes `stream` (FIN or RST); how long that took from `since`.
fn closed_after(stream: &mut TcpStream, since: Instant) -> Duration {
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return since.elapsed(),
            Ok(_) => continue,
            Err(error) if error.kind() == ErrorKind::WouldBlock => {
                panic!("not closed within {PATIENCE:?}")
            }
            Err(error) if error.kind() == ErrorKind::TimedOut => {
                panic!("not closed within {PATIENCE:?}")
            }
            Err(_) => return since.elapsed(),
        }
    }
}

fn assert_within_bound(took: Duration, what: &str) {
    assert!(
        took >= BOUND - Duration::from_millis(50) && took <= BOUND + SLACK,
        "{what}: closed after {took:?}, the bound is {BOUND:?}"
    );
}

fn good_request(addr: SocketAddr) {
    let mut stream = send_raw(addr, &get("/good"));
    assert_eq!(read_response(&mut stream).unwrap().status, 200);
}

#[test]
fn http2_clients_stalled_before_their_first_request_are_closed_at_the_header_read_timeout() {
    let backend = Backend::start();
    for protocol in ["http", "auto"] {
        let proxy = Proxy::start(&[
            "--inbound",
            &format!("127.0.0.1:0={}/{protocol}", backend.addr),
            "--http-header-read-timeout",
            "1s",
        ]);
        let addr = proxy.inbound[0];
        let settings = [0u8, 0, 0, SETTINGS, 0, 0, 0, 0, 0];
        let mut partial_headers = PREFACE.to_vec();
        partial_headers.extend_from_slice(&settings);
        let block = h2raw::header_block(&[(":method", "GET"), (":scheme", "http")]);
        let len = block.len() as u32;
        partial_headers.extend_from_slice(&[
            (len >> 16) as u8,
            (len >> 8) as u8,
            len as u8,
            HEADERS,
            0, // no END_HEADERS: the block never ends
            0,
            0,
            0,
            1,
        ]);
        partial_headers.extend_from_slice(&block);
        let mut preface_and_settings = PREFACE.to_vec();
        preface_and_settings.extend_from_slice(&settings);
        let stalls: Vec<(&str, Vec<u8>)> = vec![
            ("the whole preface, no SETTINGS", PREFACE.to_vec()),
            ("preface and SETTINGS, no request", preface_and_settings),
            ("a header block without END_HEADERS", partial_headers),
        ];
        let mut stalls = stalls;
        if protocol == "http" {
            // On an `auto` route 6 bytes cannot be told from anything else: after the
            // detection timeout they go to the app as TCP (bounded by the TCP timeouts).
            stalls.insert(0, ("6 bytes of the preface", b"PRI * ".to_vec()));
        }
        let mut stalled: Vec<(&str, TcpStream, Instant)> = stalls
            .into_iter()
            .map(|(what, bytes)| {
                let mut stream = TcpStream::connect(addr).unwrap();
                stream.write_all(&bytes).unwrap();
                (what, stream, Instant::now())
            })
            .collect();
        good_request(addr);
        for (what, stream, since) in &mut stalled {
            let took = closed_after(stream, *since);
            assert_within_bound(took, &format!("{protocol} route, {what}"));
        }
        let counted = proxy.metric("lameduck_timeouts_total{timeout=\"http2_first_request\"}");
        assert_eq!(counted as usize, stalled.len(), "{protocol} route");
        good_request(addr);
    }
}

/// A header block begun after earlier requests and never finished is not a stream, so the idle
/// bound does not see it: the header read timeout does.
#[test]
fn an_http2_header_block_left_unfinished_after_earlier_requests_is_closed_at_the_header_read_timeout()
 {
    let backend = Backend::start();
    let proxy = Proxy::start(&[
        "--inbound",
        &backend.route("127.0.0.1:0"),
        "--http-header-read-timeout",
        "1s",
    ]);
    let addr = proxy.inbound[0];
    let mut h2 = H2::connect(addr);
    for stream in [1, 3] {
        h2.get(stream, "/first");
        h2.read_until(|frame| frame.stream == stream && frame.flags & END_STREAM != 0)
            .unwrap();
        // Served well apart, so that the block below comes long after the accept.
        std::thread::sleep(BOUND);
    }
    let block = h2raw::header_block(&[(":method", "GET"), (":scheme", "http")]);
    h2.send(HEADERS, 0, 5, &block[..block.len() / 2]);
    h2.send(CONTINUATION, 0, 5, &block[block.len() / 2..]);
    let since = Instant::now();
    good_request(addr);
    assert_within_bound(
        closed_after(&mut h2.stream, since),
        "an unfinished header block",
    );
    let counted = proxy.metric("lameduck_timeouts_total{timeout=\"http2_header_block\"}");
    assert_eq!(counted, 1.0);
    assert_eq!(
        proxy.metric("lameduck_timeouts_total{timeout=\"http2_first_request\"}"),
        0.0
    );

    // A block that does end in time, however slowly, is served.
    let mut h2 = H2::connect(addr);
    h2.get(1, "/first");
    h2.read_until(|frame| frame.stream == 1 && frame.flags & END_STREAM != 0)
        .unwrap();
    let block = h2raw::header_block(&[
        (":method", "GET"),
        (":scheme", "http"),
        (":path", "/slow-block"),
        (":authority", "app.local"),
    ]);
    let (head, tail) = block.split_at(block.len() / 2);
    h2.send(HEADERS, END_STREAM, 3, head);
    std::thread::sleep(BOUND / 2);
    h2.send(CONTINUATION, END_HEADERS, 3, tail);
    let frames = h2
        .read_until(|frame| frame.stream == 3 && frame.flags & END_STREAM != 0)
        .unwrap();
    assert!(
        frames
            .iter()
            .any(|frame| frame.stream == 3 && frame.is_status_200())
    );
}

#[test]
fn an_idle_http2_connection_gets_goaway_at_the_idle_timeout_but_a_busy_one_does_not() {
    let backend = Backend::start();
    let proxy = Proxy::start(&[
        "--inbound",
        &backend.route("127.0.0.1:0"),
        "--http2-idle-timeout",
        "1s",
    ]);
    let addr = proxy.inbound[0];
    // Idle after one request.
    let mut idle = H2::connect(addr);
    idle.get(1, "/");
    idle.read_until(|frame| h2raw::ended(std::slice::from_ref(frame), 1))
        .unwrap();
    let since = Instant::now();
    // Busy: one stream streaming for longer than the bound.
    let mut busy = H2::connect(addr);
    busy.get(1, "/slow?chunks=30&interval=100");
    let frames = idle.read_until(|frame| frame.kind == GOAWAY).unwrap();
    assert_eq!(frames.last().unwrap().goaway().1, 0, "GOAWAY with NO_ERROR");
    let took = closed_after(&mut idle.stream, since);
    assert_within_bound(took, "idle HTTP/2 connection");
    // The busy connection's stream ran to its end (3 s, three bounds), and it got no
    // GOAWAY before it.
    let frames = busy
        .read_until(|frame| h2raw::ended(std::slice::from_ref(frame), 1))
        .unwrap();
    assert!(
        frames.iter().all(|frame| frame.kind != GOAWAY),
        "GOAWAY while a stream was open"
    );
    assert_eq!(h2raw::body_bytes(&frames, 1), 30 * 1024);
    assert_eq!(
        proxy.metric("lameduck_timeouts_total{timeout=\"http2_idle\"}"),
        1.0
    );
}

#[test]
fn a_half_closed_tcp_stream_whose_other_side_is_silent_is_reset_at_the_half_close_timeout() {
    let (listener, target) = silent_target();
    let mut proxy = Proxy::start(&[
        "--inbound",
        &format!("127.0.0.1:0={target}/tcp"),
        "--tcp-half-close-timeout",
        "1s",
    ]);
    let addr = proxy.inbound[0];
    // The client says all it has to say and half-closes; the target never answers.
    let mut client = TcpStream::connect(addr).unwrap();
    client.write_all(b"request").unwrap();
    let (mut held, _) = listener.accept().unwrap();
    shutdown_write(&client);
    let since = Instant::now();
    // An unbounded idle stream is not touched meanwhile (the TCP idle timeout is off).
    let mut idle = TcpStream::connect(addr).unwrap();
    let (_idle_target, _) = listener.accept().unwrap();
    let took = closed_after(&mut client, since);
    assert_within_bound(took, "half-closed by the client");
    let took = closed_after(&mut held, since);
    assert!(took <= BOUND + SLACK, "the target side too: {took:?}");
    assert_eq!(
        proxy.metric("lameduck_timeouts_total{timeout=\"tcp_half_close\"}"),
        1.0
    );
    idle.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let read = idle.read(&mut [0u8; 8]);
    assert!(
        matches!(&read, Err(error) if error.kind() == ErrorKind::WouldBlock),
        "the idle stream was closed: {read:?}"
    );

    // The other way round: the target half-closes, the client is silent.
    let mut client = TcpStream::connect(addr).unwrap();
    let (mut held, _) = listener.accept().unwrap();
    shutdown_write(&held);
    let since = Instant::now();
    // The target's FIN is passed on at once; the reset of both sides comes at the bound.
    assert_eq!(client.read(&mut [0u8; 8]).unwrap(), 0);
    let took = closed_after(&mut held, since);
    assert_within_bound(took, "half-closed by the target");

    // A drain waits for no longer than the bound either: a half-closed stalled stream does
    // not hold the pod's deletion for the grace period.
    let client = TcpStream::connect(addr).unwrap();
    let (_held, _) = listener.accept().unwrap();
    shutdown_write(&client);
    drop(idle);
    let since = Instant::now();
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    assert_within_bound(since.elapsed(), "the drain");
}

#[test]
fn the_tcp_idle_timeout_resets_streams_that_move_nothing_when_it_is_set() {
    let (listener, target) = silent_target();
    let proxy = Proxy::start(&[
        "--inbound",
        &format!("127.0.0.1:0={target}/tcp"),
        "--tcp-idle-timeout",
        "1s",
    ]);
    let mut client = TcpStream::connect(proxy.inbound[0]).unwrap();
    let (mut held, _) = listener.accept().unwrap();
    // Bytes moving keep it open past the bound.
    let mut since = Instant::now();
    for _ in 0..6 {
        std::thread::sleep(Duration::from_millis(300));
        client.write_all(b"x").unwrap();
        since = Instant::now();
    }
    let mut got = [0u8; 6];
    held.read_exact(&mut got).unwrap();
    let took = closed_after(&mut client, since);
    assert_within_bound(took, "idle TCP stream");
    assert_eq!(
        proxy.metric("lameduck_timeouts_total{timeout=\"tcp_idle\"}"),
        1.0
    );
}

/// Stalled clients cannot fill the connection limit for free: with a descriptor limit that
/// allows 16 connections, 16 HTTP/2 clients stalled after the preface take every place, a
/// good client waits in the listen queue (not refused, not dropped), and is served once the
/// stalled ones are closed at their bound.
#[test]
fn stalled_clients_fill_the_connection_limit_only_until_their_bound() {
    let backend = Backend::start();
    let mut cmd = support::command_with_fd_limit(64);
    let proxy = Proxy::start_command(
        &mut cmd,
        &[
            "--inbound",
            &format!("127.0.0.1:0={}/http", backend.addr),
            "--http-header-read-timeout",
            "1s",
        ],
    );
    let limit = proxy.metric("lameduck_connection_limit") as usize;
    assert_eq!(limit, (64 - 32) / 2);
    let addr = proxy.inbound[0];
    let stalled: Vec<TcpStream> = (0..limit)
        .map(|_| {
            let mut stream = TcpStream::connect(addr).unwrap();
            stream.write_all(PREFACE).unwrap();
            stream
        })
        .collect();
    support::wait_until("every place is taken", PATIENCE, || {
        proxy.get("/connections").body.matches("\"id\"").count() == limit
    });
    let since = Instant::now();
    let mut good = send_raw(addr, &get("/good"));
    let response = read_response(&mut good).unwrap();
    assert_eq!(response.status, 200);
    let waited = since.elapsed();
    assert!(
        waited <= BOUND + SLACK,
        "the good client waited {waited:?}, longer than the stalled clients' bound"
    );
    assert!(proxy.metric("lameduck_connection_limit_waits_total") >= 1.0);
    assert_eq!(
        proxy.metric("lameduck_timeouts_total{timeout=\"http2_first_request\"}") as usize,
        limit
    );
    drop(stalled);
}

/// A body whose bytes stop coming: the request's (the client gets 408, and the target's
/// pooled connection is not kept) and the response's (the client's response fails before it
/// looks complete), each at `--http-body-timeout`.
#[test]
fn bodies_that_stop_moving_fail_at_the_body_timeout() {
    let backend = Backend::start();
    let proxy = Proxy::start(&[
        "--inbound",
        &backend.route("127.0.0.1:0"),
        "--http-body-timeout",
        "1s",
    ]);
    let addr = proxy.inbound[0];
    let since = Instant::now();
    let mut stalled = send_raw(
        addr,
        b"POST /echo HTTP/1.1\r\nHost: a.test\r\nContent-Length: 10\r\n\r\nab",
    );
    good_request(addr);
    let response = read_response(&mut stalled).unwrap();
    assert_eq!(response.status, 408, "{response:?}");
    assert_within_bound(since.elapsed(), "a request body that stopped");

    // The target sends one chunk, then nothing for 3 s.
    let since = Instant::now();
    let mut stream = send_raw(addr, &get("/slow?chunks=3&interval=3000&size=10"));
    let cut = read_response(&mut stream);
    assert!(cut.is_err(), "a response that looks complete: {cut:?}");
    assert_within_bound(since.elapsed(), "a response body that stopped");
    good_request(addr);
    for body in ["request_body", "response_body"] {
        let counted = proxy.metric(&format!("lameduck_timeouts_total{{timeout=\"{body}\"}}"));
        assert_eq!(counted, 1.0, "{body}");
    }
}

/// Every test above, again with the fast lane off: both HTTP/1 engines keep this file's promises.
#[test]
fn the_same_through_hyper_alone() {
    support::run_again_through_hyper("the_same_through_hyper_alone");
}
