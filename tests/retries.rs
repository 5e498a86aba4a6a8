//! Outbound retries (docs/http.md, "Retries"): a request towards another pod that got no answer
//! goes again when it never reached the app (any method, its body held whole) or when it is
//! idempotent without a body, within the retry budget; inbound requests never do. Each test
//! runs through both HTTP/1 engines where the request is one the fast lane takes.

mod support;

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::Duration;

use support::backend::read_response;
use support::h2raw::{self, H2};
use support::scripted::{After, Scripted, read_request};
use support::*;

/// A target that closes its first `close_first` connections as soon as it has read a request
/// (no answer), and answers `200 ok` on the others.
struct Flaky(Scripted);

impl Flaky {
    fn start(close_first: usize) -> Flaky {
        Flaky(Scripted::start_by_connection(Arc::new(
            move |_, number| match number < close_first {
                true => (String::new(), After::Close),
                false => (
                    "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok".into(),
                    After::KeepServing,
                ),
            },
        )))
    }

    fn addr(&self) -> SocketAddr {
        self.0.addr
    }

    /// The request lines it got, in order.
    fn requests(&self) -> Vec<String> {
        self.0
            .heads
            .lock()
            .unwrap()
            .iter()
            .map(|head| head.lines().next().unwrap_or("").to_string())
            .collect()
    }
}

fn exchange(addr: SocketAddr, raw: &str) -> u16 {
    let mut client = TcpStream::connect(addr).unwrap();
    client.set_read_timeout(Some(PATIENCE)).unwrap();
    client.write_all(raw.as_bytes()).unwrap();
    read_response(&mut client)
        .unwrap_or_else(|error| panic!("{raw:?}: {error}"))
        .status
}

const GET: &str = "GET /get HTTP/1.1\r\nHost: callee.test\r\n\r\n";
/// The same GET, with an empty body hyper's path takes (the lane does not).
const GET_THROUGH_HYPER: &str =
    "GET /get HTTP/1.1\r\nHost: callee.test\r\ncontent-length: 0\r\n\r\n";
const POST: &str = "POST /post HTTP/1.1\r\nHost: callee.test\r\ncontent-length: 5\r\n\r\nhello";

fn outbound_to(target: SocketAddr, extra: &[&str]) -> Proxy {
    let route = format!("127.0.0.1:0={target}/http");
    let mut args = vec!["--outbound", &route];
    args.extend_from_slice(extra);
    Proxy::start(&args)
}

#[test]
fn an_outbound_get_whose_callee_closed_before_answering_is_sent_again() {
    for (engine, request) in [("lane", GET), ("hyper", GET_THROUGH_HYPER)] {
        let callee = Flaky::start(2);
        let proxy = outbound_to(callee.addr(), &[]);
        assert_eq!(exchange(proxy.outbound[0], request), 200, "{engine}");
        assert_eq!(
            callee.requests().len(),
            3,
            "{engine}: {:?}",
            callee.requests()
        );
        assert_eq!(
            proxy.metric(
                "lameduck_http_retries_total{direction=\"outbound\",reason=\"may_have_reached\",outcome=\"retried\"}"
            ),
            2.0,
            "{engine}"
        );
    }
}

/// A Service in a rollout: its address, and a chain of kube-proxy-like DNAT rules
/// (`--mode nth`, deterministic where kube-proxy's are random) that sends the first three new
/// connections to a port where nothing listens (pods gone: refused), and the rest to `callee`.
/// Run inside a network namespace of the test's own.
fn service_refusing_three_then(callee: SocketAddr) -> SocketAddr {
    use support::netns::run;
    let service: SocketAddr = "10.96.0.10:80".parse().unwrap();
    // A pod address where nothing listens, and a route for the ClusterIP (from that address).
    run("ip", &["addr", "add", "10.78.0.9/32", "dev", "lo"]);
    run("ip", &["route", "add", "10.96.0.10/32", "dev", "lo"]);
    let iptables = |rule: &str| run("iptables-nft", &rule.split_whitespace().collect::<Vec<_>>());
    iptables("-t nat -N SVC");
    // Each rule counts the connections that reach it: the first takes connection 0 of every 5,
    // the second connection 1 (the first of the 4 it sees), the third connection 2.
    for every in [5, 4, 3] {
        iptables(&format!(
            "-t nat -A SVC -m statistic --mode nth --every {every} --packet 0 -p tcp \
             -j DNAT --to-destination 10.78.0.9:1"
        ));
    }
    // The scripted callee listens on 127.0.0.1, where a REDIRECT leads.
    iptables(&format!(
        "-t nat -A SVC -p tcp -j REDIRECT --to-ports {}",
        callee.port()
    ));
    iptables("-t nat -A OUTPUT -d 10.96.0.10 -p tcp --dport 80 -j SVC");
    service
}

/// Behind a Service in a rollout, a request may meet several gone endpoints (connects refused)
/// before one that cuts it (an app closing its listener with the connection queued): the
/// refused connects do not use up the tries of a request that may have reached the app. Three
/// refused, then a connection closed before the answer, then a live pod: the GET is answered,
/// through either engine. Before, one count for every reason had reached its bound of 3 and the
/// client got 502 (the rollout harness saw it through a meshed caller).
#[test]
fn refused_connects_do_not_use_up_the_tries_of_a_request_cut_later() {
    for (engine, request) in [("lane", GET), ("hyper", GET_THROUGH_HYPER)] {
        support::netns::in_netns(
            "refused_connects_do_not_use_up_the_tries",
            support::netns::without_iptables(),
            move || {
                let callee = Flaky::start(1);
                let service = service_refusing_three_then(callee.addr());
                let proxy = outbound_to(service, &[]);
                assert_eq!(exchange(proxy.outbound[0], request), 200, "{engine}");
                assert_eq!(callee.requests().len(), 2, "{engine}");
                let retried = |reason: &str| {
                    proxy.metric(&format!(
                        "lameduck_http_retries_total{{direction=\"outbound\",reason=\"{reason}\",outcome=\"retried\"}}"
                    ))
                };
                assert_eq!(retried("not_connected"), 3.0, "{engine}");
                assert_eq!(retried("may_have_reached"), 1.0, "{engine}");
            },
        );
    }
}

#[test]
fn a_post_that_may_have_reached_the_callee_is_not_sent_again() {
    let callee = Flaky::start(1);
    let proxy = outbound_to(callee.addr(), &[]);
    assert_eq!(exchange(proxy.outbound[0], POST), 502);
    assert_eq!(callee.requests(), ["POST /post HTTP/1.1"]);
}

#[test]
fn a_post_that_could_not_connect_is_sent_again_with_its_body() {
    // A port nothing listens on: every connect is refused, so the request (body and all) is
    // sent again up to its share (30 for a refused connect), then the client gets the 502.
    let refused = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = refused.local_addr().unwrap();
    drop(refused);
    for (engine, request) in [("lane", GET), ("hyper", POST)] {
        let proxy = outbound_to(addr, &[]);
        assert_eq!(exchange(proxy.outbound[0], request), 502, "{engine}");
        assert_eq!(
            proxy.metric(
                "lameduck_http_retries_total{direction=\"outbound\",reason=\"not_connected\",outcome=\"retried\"}"
            ),
            30.0,
            "{engine}"
        );
    }
}

#[test]
fn inbound_requests_are_not_retried() {
    let callee = Flaky::start(1);
    let proxy = Proxy::start(&["--inbound", &format!("127.0.0.1:0={}/http", callee.addr())]);
    assert_eq!(exchange(proxy.inbound[0], GET), 502);
    assert_eq!(callee.requests().len(), 1);
}

#[test]
fn retries_can_be_turned_off() {
    for (engine, request) in [("lane", GET), ("hyper", GET_THROUGH_HYPER)] {
        let callee = Flaky::start(1);
        let proxy = outbound_to(callee.addr(), &["--http-retries=false"]);
        assert_eq!(exchange(proxy.outbound[0], request), 502, "{engine}");
        assert_eq!(callee.requests().len(), 1, "{engine}");
    }
}

/// A callee that never answers: retries stop at the budget (here its floor alone: one a second
/// over ten seconds, no share), and the rest fail as they would without retries.
#[test]
fn retries_stop_at_the_budget() {
    let callee = Flaky::start(usize::MAX);
    let proxy = outbound_to(callee.addr(), &["--http-retry-budget=0%+1/s"]);
    for _ in 0..20 {
        assert_eq!(exchange(proxy.outbound[0], GET), 502);
    }
    let retried = proxy.metric(
        "lameduck_http_retries_total{direction=\"outbound\",reason=\"may_have_reached\",outcome=\"retried\"}",
    );
    let refused = proxy.metric(
        "lameduck_http_retries_total{direction=\"outbound\",reason=\"may_have_reached\",outcome=\"budget_exhausted\"}",
    );
    assert_eq!(retried, 10.0);
    assert!(refused >= 10.0, "{refused}");
    assert_eq!(callee.requests().len(), 20 + 10);
    proxy.logs.wait_for("the budget spent, logged", |line| {
        line.contains("retry budget is spent")
    });
}

/// An HTTP/2 callee that refuses the first stream it gets, with `REFUSED_STREAM` or with a GOAWAY
/// whose last stream id is below it (`goaway`), and answers `200` to every later one.
fn refusing_h2_callee(goaway: bool) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let streams = Arc::new(AtomicUsize::new(0));
    let seen = streams.clone();
    thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            let seen = seen.clone();
            thread::spawn(move || {
                let Ok(mut h2) = H2::accepted(stream) else {
                    return;
                };
                while let Ok(frame) = h2.read_frame() {
                    match frame.kind {
                        h2raw::SETTINGS if frame.flags & h2raw::ACK == 0 => {
                            h2.send(h2raw::SETTINGS, h2raw::ACK, 0, &[]);
                        }
                        h2raw::HEADERS => {
                            if seen.fetch_add(1, Ordering::SeqCst) == 0 {
                                if goaway {
                                    // Last stream id 0, NO_ERROR: stream 1 was never processed.
                                    // The connection stays open (a close with the client's
                                    // frames unread would reset it, and the GOAWAY with it).
                                    h2.send(h2raw::GOAWAY, 0, 0, &[0; 8]);
                                    continue;
                                }
                                // REFUSED_STREAM (7).
                                h2.send(h2raw::RST_STREAM, 0, frame.stream, &7u32.to_be_bytes());
                                continue;
                            }
                            // `:status 200` (HPACK static index 8), no body.
                            let flags = h2raw::END_HEADERS | h2raw::END_STREAM;
                            h2.send(h2raw::HEADERS, flags, frame.stream, &[0x88]);
                        }
                        _ => {}
                    }
                }
            });
        }
    });
    (addr, streams)
}

#[test]
fn an_http2_stream_the_callee_refused_or_never_processed_is_sent_again() {
    for goaway in [false, true] {
        let (callee, streams) = refusing_h2_callee(goaway);
        let proxy = outbound_to(callee, &[]);
        let mut client = H2::connect(proxy.outbound[0]);
        client.get(1, "/");
        let frames = client
            .read_until(|frame| frame.kind == h2raw::HEADERS || frame.kind == h2raw::RST_STREAM)
            .unwrap();
        let last = frames.last().unwrap();
        assert!(last.is_status_200(), "goaway={goaway}: {frames:?}");
        assert_eq!(streams.load(Ordering::SeqCst), 2, "goaway={goaway}");
        assert_eq!(
            proxy.metric(
                "lameduck_http_retries_total{direction=\"outbound\",reason=\"not_sent\",outcome=\"retried\"}"
            ),
            1.0,
            "goaway={goaway}"
        );
    }
}

/// A callee whose kernel took the request but whose app never read it (a pod that exits, a
/// listener closed with the connection queued): the connection is reset. A POST sent so is sent
/// again, its body (kept as it went) whole.
#[test]
fn a_post_the_callee_reset_unread_is_sent_again_with_its_body() {
    // The whole request arrives and is never read.
    let (addr, bodies) = resetting_callee(Duration::from_millis(200));
    let proxy = outbound_to(addr, &[]);
    let post = "POST /post HTTP/1.1\r\nHost: callee.test\r\ncontent-length: 5\r\n\r\norder";
    assert_eq!(exchange(proxy.outbound[0], post), 200);
    let bodies = bodies.lock().unwrap();
    assert_eq!(bodies.len(), 1, "{bodies:?}");
    assert!(bodies[0].ends_with("\r\n\r\norder"), "{bodies:?}");
    assert_eq!(
        proxy.metric(
            "lameduck_http_retries_total{direction=\"outbound\",reason=\"unread\",outcome=\"retried\"}"
        ),
        1.0
    );
}

/// A callee that resets its first connection `after` a request's first bytes came, unread, and
/// answers `200 ok` on the others; records each request it read (up to its body, `order`).
fn resetting_callee(after: Duration) -> (SocketAddr, Arc<std::sync::Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = requests.clone();
    thread::spawn(move || {
        for (number, stream) in listener.incoming().enumerate() {
            let Ok(mut stream) = stream else { return };
            let seen = seen.clone();
            thread::spawn(move || {
                if number == 0 {
                    // The close of a socket with unread bytes (and no linger) resets it.
                    let _ = stream.peek(&mut [0u8; 1]);
                    thread::sleep(after);
                    reset_close(stream);
                    return;
                }
                let mut request = Vec::new();
                let mut byte = [0u8; 1];
                while !request.ends_with(b"order") {
                    match std::io::Read::read(&mut stream, &mut byte) {
                        Ok(1) => request.push(byte[0]),
                        _ => return,
                    }
                }
                seen.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&request).into_owned());
                let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
            });
        }
    });
    (addr, requests)
}

/// The proxy sends a request's head as soon as it has it, its body as it comes: a callee that
/// resets the connection unread between the two (a pod that exits as the POST goes out) leaves
/// the body partly sent or not at all. The POST still never reached the app, and goes again
/// with its whole body, the part sent and the rest still to come from the client. Not a race:
/// the client sends its body only after the reset.
#[test]
fn a_post_reset_unread_before_its_body_went_out_is_sent_again_whole() {
    for (sent_first, rest) in [("", "order"), ("ord", "er")] {
        let (addr, requests) = resetting_callee(Duration::ZERO);
        let proxy = outbound_to(addr, &[]);
        let mut client = TcpStream::connect(proxy.outbound[0]).unwrap();
        client.set_read_timeout(Some(PATIENCE)).unwrap();
        let head = "POST /post HTTP/1.1\r\nHost: callee.test\r\ncontent-length: 5\r\n\r\n";
        client
            .write_all(format!("{head}{sent_first}").as_bytes())
            .unwrap();
        // Once the callee has reset the first connection: the retry waits for the rest.
        let sample = "lameduck_http_retries_total{direction=\"outbound\",reason=\"unread\",outcome=\"retried\"} 1";
        wait_until("the POST going again", PATIENCE, || {
            proxy
                .get("/metrics")
                .body
                .lines()
                .any(|line| line == sample)
        });
        client.write_all(rest.as_bytes()).unwrap();
        let response = read_response(&mut client).unwrap();
        assert_eq!(
            response.status,
            200,
            "{sent_first:?}: {:?}",
            String::from_utf8_lossy(&response.body)
        );
        let requests = requests.lock().unwrap();
        assert_eq!(requests.len(), 1, "{requests:?}");
        assert!(requests[0].ends_with("\r\n\r\norder"), "{requests:?}");
    }
}

/// A callee whose first connection answers one request with keep-alive and then closes on the
/// next: with that request unread (`unread`: a FIN, and its kernel's RST for the unread bytes
/// right behind, as when a server closes an idle pooled connection just as a request goes out),
/// or after reading it whole (a FIN alone: it may have acted on it). Its other connections
/// answer every request. Records the request lines it read, each after the number of its
/// connection, and `0 unread` when a request came on the first connection and was left so.
fn closing_callee(unread: bool) -> (SocketAddr, Arc<std::sync::Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = requests.clone();
    thread::spawn(move || {
        for (number, stream) in listener.incoming().enumerate() {
            let Ok(mut stream) = stream else { return };
            let seen = seen.clone();
            thread::spawn(move || {
                let mut served = 0;
                loop {
                    if number == 0 && served == 1 {
                        if unread {
                            // Until the next request is here, unread; then FIN, and the close
                            // of a socket with unread bytes: an RST.
                            if matches!(stream.peek(&mut [0u8; 1]), Ok(1)) {
                                seen.lock().unwrap().push("0 unread".to_string());
                            }
                            let _ = stream.shutdown(std::net::Shutdown::Write);
                        } else if let Some((head, _)) = read_request(&mut stream) {
                            let line = head.lines().next().unwrap_or("").to_string();
                            seen.lock().unwrap().push(format!("0 {line}"));
                            let _ = stream.shutdown(std::net::Shutdown::Write);
                        }
                        return;
                    }
                    let Some((head, _)) = read_request(&mut stream) else {
                        return;
                    };
                    let line = head.lines().next().unwrap_or("").to_string();
                    seen.lock().unwrap().push(format!("{number} {line}"));
                    served += 1;
                    if stream
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    (addr, requests)
}

/// A POST the callee never read, on a pooled connection it closed as the POST went out (a FIN,
/// then the RST its kernel sends for the unread bytes), goes again with its body; one it read
/// before closing (a FIN alone) does not. Not a race: the callee closes once the request is
/// there. (The proxy puts the first connection back in its pool as the first response ends; a
/// POST that came before that went on a new connection, and the case is played again.) The
/// fast lane takes only idempotent requests without a body, which go again after any close.
#[test]
fn a_post_the_callee_closed_its_pooled_connection_on_unread_is_sent_again() {
    let post = "POST /post HTTP/1.1\r\nHost: callee.test\r\ncontent-length: 5\r\n\r\norder";
    for (engine, first, then) in [("hyper", GET_THROUGH_HYPER, post)] {
        for unread in [true, false] {
            let mut played = false;
            for _ in 0..5 {
                let (addr, requests) = closing_callee(unread);
                let proxy = outbound_to(addr, &[]);
                let mut client = TcpStream::connect(proxy.outbound[0]).unwrap();
                client.set_read_timeout(Some(PATIENCE)).unwrap();
                let mut statuses = Vec::new();
                for request in [first, then] {
                    client.write_all(request.as_bytes()).unwrap();
                    let response = read_response(&mut client)
                        .unwrap_or_else(|error| panic!("{engine}: {request:?}: {error}"));
                    statuses.push(response.status);
                    thread::sleep(Duration::from_millis(20));
                }
                let requests = requests.lock().unwrap().clone();
                // The POST on the pooled first connection: the case this test is about.
                if !requests
                    .iter()
                    .any(|line| line.starts_with("0 unread") || line.starts_with("0 POST"))
                {
                    continue;
                }
                played = true;
                let want = if unread { [200, 200] } else { [200, 502] };
                assert_eq!(statuses, want, "{engine}, unread {unread}: {requests:?}");
                // The POST was read once: on a second connection, or before the close.
                let posts = requests.iter().filter(|line| line.contains("POST")).count();
                assert_eq!(posts, 1, "{engine}, unread {unread}: {requests:?}");
                if unread {
                    let retried = proxy.metric(
                        "lameduck_http_retries_total{direction=\"outbound\",reason=\"unread\",outcome=\"retried\"}",
                    );
                    assert_eq!(retried, 1.0, "{engine}");
                }
                break;
            }
            assert!(
                played,
                "{engine}, unread {unread}: the POST never went on the pooled connection"
            );
        }
    }
}
