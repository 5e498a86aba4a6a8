//! Shutdown under load: no request that a client wrote is
//! lost, with and without a lame-duck period, over HTTP/1.1 keep-alive and HTTP/2.

mod support;

use std::collections::HashSet;
use std::io::{ErrorKind, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use support::backend::{Backend, read_response};
use support::*;

/// What the load client saw.
#[derive(Default, Debug)]
struct Tally {
    sent: u64,
    completed: HashSet<u64>,
    /// Not sent: connect() refused after the listeners closed.
    refused: u64,
    /// Closed before any response byte on a reused keep-alive connection, and retried once on a
    /// fresh connection, as HTTP clients do.
    retried: u64,
    /// Written but failed in a way no client could safely retry.
    lost: Vec<u64>,
    not_2xx: Vec<u16>,
}

/// 32 keep-alive HTTP/1.1 connections at about 1000 requests/s for `run`, SIGTERM at `signal_at`.
fn load(proxy: &Proxy, run: Duration, signal_at: Duration) -> Tally {
    let tally = Arc::new(Mutex::new(Tally::default()));
    let next_id = Arc::new(AtomicU64::new(1));
    let started = Instant::now();
    let addr = proxy.inbound[0];
    let workers: Vec<_> = (0..32)
        .map(|_| {
            let (tally, next_id) = (tally.clone(), next_id.clone());
            thread::spawn(move || worker(addr, started, run, &next_id, &tally))
        })
        .collect();
    thread::sleep(signal_at);
    proxy.signal(libc::SIGTERM);
    for worker in workers {
        worker.join().unwrap();
    }
    Arc::try_unwrap(tally).unwrap().into_inner().unwrap()
}

fn worker(
    addr: SocketAddr,
    started: Instant,
    run: Duration,
    next_id: &AtomicU64,
    tally: &Mutex<Tally>,
) {
    let mut conn: Option<(TcpStream, bool)> = None;
    let mut slot = Instant::now();
    while started.elapsed() < run {
        slot += Duration::from_millis(32);
        if let Some(wait) = slot.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
        let id = next_id.fetch_add(1, Ordering::Relaxed);
        for attempt in 0..2 {
            let (stream, reused) = match conn.take() {
                Some(open) => open,
                None => match TcpStream::connect(addr) {
                    Ok(stream) => {
                        stream.set_read_timeout(Some(PATIENCE)).unwrap();
                        (stream, false)
                    }
                    Err(_) => {
                        tally.lock().unwrap().refused += 1;
                        break;
                    }
                },
            };
            let mut stream = stream;
            let request = format!("GET /delay?id={id} HTTP/1.1\r\nHost: app.local\r\n\r\n");
            if attempt == 0 {
                tally.lock().unwrap().sent += 1;
            }
            let written = stream.write_all(request.as_bytes());
            let outcome = written.and_then(|()| read_response(&mut stream));
            match outcome {
                Ok(response) => {
                    let mut tally = tally.lock().unwrap();
                    if (200..300).contains(&response.status) {
                        tally.completed.insert(id);
                    } else {
                        tally.not_2xx.push(response.status);
                    }
                    if response.header("connection") != Some("close") {
                        conn = Some((stream, true));
                    }
                    break;
                }
                Err(error)
                    if reused
                        && attempt == 0
                        && matches!(
                            error.kind(),
                            ErrorKind::ConnectionAborted
                                | ErrorKind::BrokenPipe
                                | ErrorKind::ConnectionReset
                        ) =>
                {
                    tally.lock().unwrap().retried += 1;
                }
                Err(error) => {
                    eprintln!("lost {id}: reused={reused} attempt={attempt} {error:?}");
                    tally.lock().unwrap().lost.push(id);
                    break;
                }
            }
        }
    }
}

fn check(tally: &Tally, backend: &Backend, mode: &str) {
    let mut seen = HashSet::new();
    for path in backend.seen_paths() {
        let id: u64 = path.trim_start_matches("/delay?id=").parse().unwrap();
        assert!(
            seen.insert(id),
            "{mode}: request {id} reached the app twice"
        );
    }
    let unanswered: Vec<_> = seen.difference(&tally.completed).collect();
    eprintln!(
        "{mode}: sent {}, completed {}, refused before sending {}, retried after an idle close {}, lost {}, non-2xx {}",
        tally.sent,
        tally.completed.len(),
        tally.refused,
        tally.retried,
        tally.lost.len(),
        tally.not_2xx.len()
    );
    assert!(
        tally.lost.is_empty(),
        "{mode}: lost requests {:?}",
        tally.lost
    );
    assert!(
        unanswered.is_empty(),
        "{mode}: the app saw requests whose client got no response: {unanswered:?}"
    );
    assert!(tally.not_2xx.is_empty(), "{mode}: {:?}", tally.not_2xx);
    assert!(
        tally.completed.len() > 2000,
        "{mode}: only {} requests completed",
        tally.completed.len()
    );
}

#[test]
fn http1_load_loses_nothing_across_sigterm() {
    let backend = Backend::start();
    let route = backend.route("127.0.0.1:0");
    let mut proxy = Proxy::start(&["--inbound", &route]);
    let tally = load(&proxy, Duration::from_secs(6), Duration::from_secs(3));
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    check(&tally, &backend, "refuse mode");
    assert!(
        tally.refused > 0,
        "connections after the shutdown should have been refused"
    );
}

#[test]
fn http1_load_loses_nothing_with_a_lame_duck_period() {
    let backend = Backend::start();
    let route = backend.route("127.0.0.1:0");
    let mut proxy = Proxy::start(&["--inbound", &route, "--lame-duck-period=2s"]);
    let tally = load(&proxy, Duration::from_secs(6), Duration::from_secs(2));
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    check(&tally, &backend, "lame-duck mode");
    assert_eq!(
        tally.retried, 0,
        "with a lame-duck period no keep-alive connection is closed under a request"
    );
}

#[test]
fn h2load_under_sigterm_sees_no_errors() {
    let backend = Backend::start();
    let route = backend.route("127.0.0.1:0");
    let mut proxy = Proxy::start(&["--inbound", &route]);
    let url = format!("http://{}/", proxy.inbound[0]);
    let child = Command::new("h2load")
        .args(["-n", "20000", "-c", "50", "-m", "10", &url])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| {
            panic!("h2load (Debian package nghttp2-client) is needed: {error}")
        });
    wait_until("h2load is under way", PATIENCE, || {
        backend.seen().len() > 2000
    });
    proxy.signal(libc::SIGTERM);
    let output = child.wait_with_output().unwrap();
    let h2load = (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        backend.seen().len(),
    );
    let (report, app_saw) = h2load;
    let counts = |line_start: &str| -> Vec<u64> {
        let line = report
            .lines()
            .find(|line| line.starts_with(line_start))
            .unwrap_or_else(|| panic!("{report}"));
        line.split(|c: char| !c.is_ascii_digit())
            .filter(|s| !s.is_empty())
            .map(|s| s.parse().unwrap())
            .collect()
    };
    // requests: N total, N started, N done, N succeeded, N failed, N errored, N timeout
    let requests = counts("requests:");
    let (total, succeeded, failed, errored, timeout) = (
        requests[0],
        requests[3],
        requests[4],
        requests[5],
        requests[6],
    );
    // status codes: N 2xx, N 3xx, N 4xx, N 5xx
    let statuses = counts("status codes:");
    eprintln!(
        "h2load under SIGTERM: {total} total, {succeeded} succeeded, {failed} failed (never sent: GOAWAY), \
         {errored} errored, {timeout} timeout, 5xx {}; the app saw {app_saw}",
        statuses[6]
    );
    // h2load counts the requests it could not send after GOAWAY as failed and errored; that
    // they never reached the app is what the last assertions prove.
    assert!(errored <= failed, "{report}");
    assert_eq!(timeout, 0, "{report}");
    assert_eq!(statuses[6], 0, "no 5xx: {report}");
    assert_eq!(
        app_saw as u64, succeeded,
        "every request the app saw was answered, and only those"
    );
    assert_eq!(succeeded + failed, total);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}
