//! The close-spread window (docs/lifecycle.md): long-lived connections still open in the last
//! part of the grace period are ended one by one, evenly spread, each as cleanly as its
//! protocol allows, and nothing is reset.
//!
//! Real peers: the `websockets` and `grpcio` Python packages and asyncio TCP streams
//! (tests/close_spread/*.py), through the real binary.

mod support;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use support::{Proxy, skip};

const WEBSOCKETS: usize = 1000;
const GRPC_STREAMS: usize = 200;
const TCP_STREAMS: usize = 1000;
const GRACE: f64 = 16.0;
const WINDOW: f64 = 10.0;

/// Whether the Python peers can run here; why not otherwise.
fn python_peers() -> Result<(), String> {
    let out = Command::new("python3")
        .args(["-c", "import websockets, grpc"])
        .output()
        .map_err(|error| format!("python3: {error}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "the websockets and grpcio Python packages are missing (.ci/test installs them): {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A Python process and its stdout, line by line.
struct Peer {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Peer {
    fn start(script: &str, args: &[String]) -> Peer {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/close_spread")
            .join(script);
        let mut child = Command::new("python3")
            .arg(path)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn python3");
        let stdout = child.stdout.take().unwrap();
        let (sender, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if sender.send(line).is_err() {
                    return;
                }
            }
        });
        Peer { child, lines }
    }

    /// The lines up to the first that starts with `what`, which is returned last.
    fn until(&self, what: &str, limit: Duration) -> Vec<String> {
        let deadline = Instant::now() + limit;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let last = line.starts_with(what);
                    seen.push(line);
                    if last {
                        return seen;
                    }
                }
                Err(error) => panic!("waiting for {what:?}: {error}; got {seen:?}"),
            }
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

#[test]
fn long_lived_connections_end_cleanly_one_by_one_across_the_close_spread_window() {
    let test = "long_lived_connections_end_cleanly_one_by_one_across_the_close_spread_window";
    if let Err(why) = python_peers() {
        return skip(test, &why);
    }
    let ports: Vec<String> = (0..3)
        .map(|_| support::port_for_another_process().to_string())
        .collect();
    let apps = Peer::start("apps.py", &ports);
    apps.until("listening", Duration::from_secs(30));

    let routes: Vec<String> = ports
        .iter()
        .zip(["http", "http", "tcp"])
        .map(|(port, protocol)| format!("--inbound=127.0.0.1:0=127.0.0.1:{port}/{protocol}"))
        .collect();
    let mut args: Vec<&str> = routes.iter().map(String::as_str).collect();
    let grace = format!("--shutdown-grace-period={GRACE}s");
    let window = format!("--close-spread-window={WINDOW}s");
    args.extend([grace.as_str(), window.as_str()]);
    let mut proxy = Proxy::start(&args);
    let addrs: Vec<String> = proxy.inbound.iter().map(|addr| addr.to_string()).collect();

    let mut client_args = addrs.clone();
    for count in [WEBSOCKETS, GRPC_STREAMS, TCP_STREAMS] {
        client_args.push(count.to_string());
    }
    client_args.push(((GRACE + 30.0) as u64).to_string());
    let clients = Peer::start("clients.py", &client_args);
    clients.until("ready", Duration::from_secs(180));
    let total = WEBSOCKETS + GRPC_STREAMS + TCP_STREAMS;
    proxy.wait_open_connections(total);

    let signalled = now();
    let started = Instant::now();
    proxy.signal(libc::SIGTERM);
    // Late in the window, the metrics count the clean ends so far.
    thread::sleep(Duration::from_secs_f64(GRACE - 2.0));
    let metrics = proxy.get("/metrics").body;
    proxy.wait_exit(Duration::from_secs_f64(GRACE + 10.0));
    let lasted = started.elapsed();

    let lines = clients.until("done", Duration::from_secs(60));
    let mut ends: BTreeMap<(String, String), usize> = BTreeMap::new();
    let mut times = Vec::new();
    for line in &lines {
        let Ok(end) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let (kind, how) = (end["kind"].as_str().unwrap(), end["how"].as_str().unwrap());
        *ends.entry((kind.into(), how.into())).or_default() += 1;
        times.push(end["at"].as_f64().unwrap() - signalled);
    }
    support::signal_pid(apps.child.id() as i32, libc::SIGTERM);
    let app_ends: serde_json::Value =
        serde_json::from_str(apps.until("{", Duration::from_secs(30)).last().unwrap()).unwrap();

    // Every client saw its protocol's clean end: Close 1001 (and the TCP close after it), gRPC
    // status 14 (UNAVAILABLE), a FIN; none a reset.
    let expected: BTreeMap<(String, String), usize> = [
        // The proxy's own message: a connection lost is status 14 too, with another.
        (
            ("grpc", "status:14:lameduck: the pod is shutting down"),
            GRPC_STREAMS,
        ),
        (("tcp", "fin"), TCP_STREAMS),
        (("websocket", "close:1001"), WEBSOCKETS),
    ]
    .into_iter()
    .map(|((kind, how), count)| ((kind.to_string(), how.to_string()), count))
    .collect();
    let odd: Vec<&String> = lines
        .iter()
        .filter(|line| {
            !line.contains("\"close:1001\"")
                && !line.contains("\"status:14:lameduck")
                && !line.contains("\"fin\"")
        })
        .take(20)
        .collect();
    assert_eq!(
        ends, expected,
        "how the clients' connections ended; not as expected: {odd:?}"
    );
    assert!(
        lines.last().unwrap().starts_with("done 0"),
        "{:?}",
        lines.last()
    );
    // The apps saw each end too: the proxy's masked Close 1001, the stream cancelled, a FIN.
    let expected_apps = serde_json::json!({
        "websocket:1001": WEBSOCKETS,
        "grpc:cancelled": GRPC_STREAMS,
        "tcp:fin": TCP_STREAMS,
    });
    assert_eq!(app_ends, expected_apps, "how the apps' connections ended");

    // All within the window, before the deadline, and the proxy left as soon as all were gone.
    let window_start = GRACE - WINDOW;
    let (first, last) = times
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), t| (lo.min(*t), hi.max(*t)));
    assert!(
        first >= window_start - 0.05 && last < GRACE,
        "ends from {first:.2}s to {last:.2}s after SIGTERM; the window is {window_start}s to {GRACE}s"
    );
    assert!(
        lasted < Duration::from_secs_f64(GRACE),
        "the proxy exited {lasted:?} after SIGTERM"
    );
    let log = proxy.logs.text();
    assert!(
        !log.contains("resetting the remaining connections"),
        "nothing is reset\n{log}"
    );
    // Evenly spread: no one-second slice of the window has more than 1.5 times the average.
    let slices = WINDOW as usize;
    let mut per_slice = vec![0usize; slices];
    for t in &times {
        let slice = ((t - window_start).max(0.0) as usize).min(slices - 1);
        per_slice[slice] += 1;
    }
    let average = total as f64 / WINDOW;
    eprintln!(
        "ends from {first:.2}s to {last:.2}s after SIGTERM; per second of the window: {per_slice:?}; the proxy exited after {lasted:?}"
    );
    assert!(
        per_slice.iter().all(|&n| n as f64 <= 1.5 * average),
        "connections ended per second of the window: {per_slice:?} (average {average})"
    );
    // The metrics say how they ended.
    for protocol in ["websocket", "http2", "tcp"] {
        let sample = format!(
            "lameduck_connections_ended_at_shutdown_total{{protocol=\"{protocol}\",how=\"clean\"}} "
        );
        let clean: f64 = metrics
            .lines()
            .find_map(|line| line.strip_prefix(&sample))
            .unwrap_or_else(|| panic!("{sample} in\n{metrics}"))
            .parse()
            .unwrap();
        assert!(clean > 0.0, "{sample}{clean}");
    }
    assert!(!metrics.contains("how=\"reset\""), "{metrics}");
}

/// Reads one response from `stream` and then until the connection closes, in a thread:
/// the response (or why it could not be read whole), how the connection closed, and when
/// (after `since`).
fn read_in_background(
    mut stream: std::net::TcpStream,
    since: Instant,
) -> thread::JoinHandle<(std::io::Result<usize>, support::Close, Duration)> {
    thread::spawn(move || {
        let response = support::backend::read_response(&mut stream).map(|r| r.body.len());
        let at = since.elapsed();
        let (close, _) = support::wait_close(&mut stream, Duration::from_secs(30));
        (response, close, at)
    })
}

#[test]
fn http1_event_streams_end_cleanly_and_other_responses_are_cut_without_a_reset() {
    use support::backend::{Backend, get, proxy_for, send_raw};
    let backend = Backend::start();
    // Both engines: the fast lane (the default) and hyper's.
    for engine in ["--http1-fast-lane=true", "--http1-fast-lane=false"] {
        let mut proxy = proxy_for(
            &backend,
            &[
                "--shutdown-grace-period=4s",
                "--close-spread-window=2s",
                engine,
            ],
        );
        let since = Instant::now();
        let download = read_in_background(send_raw(proxy.inbound[0], &get("/forever")), since);
        let long_poll = read_in_background(send_raw(proxy.inbound[0], &get("/hang")), since);
        // The newest, so the last time in the window: its connection, kept alive by its head,
        // must close right after the stream's end, not linger to the deadline's reset.
        thread::sleep(Duration::from_millis(50));
        let events = read_in_background(send_raw(proxy.inbound[0], &get("/events")), since);
        support::wait_until(
            "two responses streaming, one awaited",
            support::PATIENCE,
            || {
                let conns = proxy.open_connections();
                let streaming = conns
                    .iter()
                    .filter(|conn| conn["bytes_to_peer"].as_u64().unwrap_or(0) > 2048)
                    .count();
                conns.len() == 3 && streaming == 2
            },
        );
        let signalled = since.elapsed();
        proxy.signal(libc::SIGTERM);
        let (events, events_close, events_at) = events.join().unwrap();
        let (download, download_close, download_at) = download.join().unwrap();
        let (long_poll, long_poll_close, long_poll_at) = long_poll.join().unwrap();
        let status = proxy.wait_exit(support::PATIENCE);
        let exited = since.elapsed() - signalled;
        // Server-sent events end with the last chunk: the client has a whole response, and
        // an EventSource reconnects.
        assert!(
            events.as_ref().is_ok_and(|len| *len > 0),
            "{engine}: {events:?}"
        );
        // Anything else is cut, never made to look whole: an incomplete chunked body.
        let error = download.expect_err("a cut download must not look complete");
        assert_eq!(
            error.kind(),
            std::io::ErrorKind::UnexpectedEof,
            "{engine}: {error}"
        );
        // A request still waiting for its response: its connection is closed (HTTP/1 cannot
        // cancel a request otherwise), before a byte of a response.
        let error = long_poll.expect_err("no response was made up");
        assert_eq!(
            error.kind(),
            std::io::ErrorKind::ConnectionAborted,
            "{engine}: {error}"
        );
        // Both with a FIN, in the window (from 2 s after the signal), before the deadline.
        for (what, close, at) in [
            ("events", events_close, events_at),
            ("download", download_close, download_at),
            ("long poll", long_poll_close, long_poll_at),
        ] {
            assert_eq!(close, support::Close::Eof, "{engine}: {what}");
            let after = at - signalled;
            assert!(
                after >= Duration::from_millis(1950) && after < Duration::from_secs(4),
                "{engine}: {what} ended {after:?} after SIGTERM"
            );
        }
        assert_eq!(status.code(), Some(0));
        assert!(
            exited < Duration::from_secs(4),
            "{engine}: exited after {exited:?}"
        );
        let log = proxy.logs.text();
        assert!(
            !log.contains("resetting the remaining connections"),
            "{engine}\n{log}"
        );
    }
}

/// The HTTP/2 reason among an error's causes (a stream reset, say).
fn h2_reason(error: &(dyn std::error::Error + 'static)) -> Option<h2::Reason> {
    let mut cause = Some(error);
    while let Some(error) = cause {
        if let Some(h2) = error.downcast_ref::<h2::Error>() {
            return h2.reason();
        }
        cause = error.source();
    }
    None
}

#[test]
fn http2_streams_end_as_their_kind_allows() {
    use http_body_util::{BodyExt, Empty};
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use support::backend::{Backend, proxy_for};
    let backend = Backend::start();
    let mut proxy = proxy_for(
        &backend,
        &["--shutdown-grace-period=4s", "--close-spread-window=2s"],
    );
    let addr = proxy.inbound[0];
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let since = Instant::now();
    let request = |method: &str, path: &str, grpc: bool| {
        let mut request = hyper::Request::builder()
            .method(method)
            .uri(format!("http://app.local{path}"));
        if grpc {
            request = request.header("content-type", "application/grpc");
        }
        request.body(Empty::<bytes::Bytes>::new()).unwrap()
    };
    let (signalled, ends, connection) = runtime.block_on(async {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .unwrap();
        let connection = tokio::spawn(async move {
            let ended = connection.await;
            (ended.map_err(|error| error.to_string()), since.elapsed())
        });
        let mut calls = Vec::new();
        for (method, path, grpc) in [
            ("GET", "/events", false),
            ("GET", "/forever", false),
            ("GET", "/hang", false),
            ("POST", "/hang", true),
        ] {
            let response = sender.send_request(request(method, path, grpc));
            calls.push(tokio::spawn(async move {
                let response = match response.await {
                    Ok(response) => response,
                    Err(error) => {
                        let reason = h2_reason(&error);
                        return (format!("no response: {reason:?}"), since.elapsed());
                    }
                };
                let grpc_status = response
                    .headers()
                    .get("grpc-status")
                    .map(|value| value.to_str().unwrap().to_string());
                let body = response
                    .into_body()
                    .collect()
                    .await
                    .map(|body| body.to_bytes());
                let how = match (grpc_status, body) {
                    (Some(status), Ok(_)) => format!("grpc-status {status}"),
                    (None, Ok(body)) if !body.is_empty() => "whole".to_string(),
                    (None, Ok(_)) => "empty".to_string(),
                    (_, Err(error)) => format!("body: {:?}", h2_reason(&error)),
                };
                (how, since.elapsed())
            }));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let signalled = since.elapsed();
        proxy.signal(libc::SIGTERM);
        let mut ends = Vec::new();
        for call in calls {
            ends.push(call.await.unwrap());
        }
        (signalled, ends, connection.await.unwrap())
    });
    let hows: Vec<&str> = ends.iter().map(|(how, _)| how.as_str()).collect();
    assert_eq!(
        hows,
        [
            // Server-sent events: END_STREAM, a whole response.
            "whole",
            // Another streaming response: RST_STREAM(CANCEL), never made to look whole.
            "body: Some(CANCEL)",
            // No response yet: cancelled.
            "no response: Some(CANCEL)",
            // A gRPC call without a response yet: trailers-only, status 14 (UNAVAILABLE).
            "grpc-status 14",
        ]
    );
    for (how, at) in &ends {
        let after = *at - signalled;
        assert!(
            after >= Duration::from_millis(1950) && after < Duration::from_secs(4),
            "{how} {after:?} after SIGTERM"
        );
    }
    // Then the connection closes (GOAWAY went at the start of the drain), before the deadline.
    let (closed, at) = connection;
    assert!(closed.is_ok(), "{closed:?}");
    assert!(
        at - signalled < Duration::from_secs(4),
        "{:?}",
        at - signalled
    );
    assert_eq!(proxy.wait_exit(support::PATIENCE).code(), Some(0));
    assert!(
        !proxy
            .logs
            .text()
            .contains("resetting the remaining connections")
    );
}

#[test]
fn a_peer_that_never_closes_is_reset_at_the_deadline_and_one_gone_before_is_untouched() {
    use support::{Close, EchoServer, echo_connect, echo_round_trip, wait_close};
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&[
        "--inbound",
        &echo.route("127.0.0.1:0"),
        "--shutdown-grace-period=4s",
        "--close-spread-window=2s",
    ]);
    let mut stubborn = echo_connect(proxy.inbound[0]);
    let mut early = echo_connect(proxy.inbound[0]);
    echo_round_trip(&mut stubborn, b"hello");
    echo_round_trip(&mut early, b"hello");
    let sent = Instant::now();
    proxy.signal(libc::SIGTERM);
    // One ends by itself before the window: it closes as it asked, nothing else.
    thread::sleep(Duration::from_millis(500));
    early.shutdown(std::net::Shutdown::Write).unwrap();
    let (close, _) = wait_close(&mut early, support::PATIENCE);
    assert_eq!(close, Close::Eof);
    // The other gets the window's FIN at its time, and never closes: it is reset at the
    // deadline, and named.
    let (close, _) = wait_close(&mut stubborn, support::PATIENCE);
    let fin_at = sent.elapsed();
    assert_eq!(close, Close::Eof);
    assert!(
        fin_at >= Duration::from_millis(1950) && fin_at < Duration::from_secs(4),
        "FIN {fin_at:?} after SIGTERM"
    );
    let status = proxy.wait_exit(support::PATIENCE);
    let exit_at = sent.elapsed();
    assert_eq!(status.code(), Some(0));
    assert!(
        exit_at >= Duration::from_millis(3950) && exit_at < Duration::from_secs(6),
        "exited {exit_at:?} after SIGTERM: the window never extends the grace period"
    );
    let log = proxy.logs.text();
    let window = proxy
        .logs
        .events("close spread: ending the connections still open one by one");
    assert_eq!(window.len(), 1, "{log}");
    assert_eq!(window[0]["fields"]["connections"], 1, "{log}");
    assert!(
        log.contains("resetting the remaining connections") && log.contains("force-closing id=1"),
        "{log}"
    );
    // Its socket was reset: what it sends now is refused.
    let refused = stubborn
        .write_all(b"x")
        .and_then(|()| {
            thread::sleep(Duration::from_millis(50));
            stubborn.write_all(b"y")
        })
        .is_err();
    assert!(refused, "the stubborn peer's connection was reset");
}
