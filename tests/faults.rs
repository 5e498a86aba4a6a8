//! Faults on either side of a TCP route (a target that refuses, resets or vanishes, a client
//! that goes away): the proxy passes them on honestly, frees what it held, and keeps serving.

mod support;

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::thread;
use std::time::{Duration, Instant};

use support::process::cpu_total;
use support::*;

#[test]
fn refused_target_resets_the_client_promptly_and_is_counted() {
    let closed_port = closed_port();
    let mut proxy = Proxy::start(&["--inbound", &format!("127.0.0.1:0={closed_port}/tcp")]);
    let inbound = proxy.inbound[0];
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    for _ in 0..100 {
        let attempt = Instant::now();
        let mut client = TcpStream::connect(inbound).unwrap();
        // The reset may already be there; a write consumes it as ECONNRESET or EPIPE.
        let close = match client.write_all(b"hello?") {
            Ok(()) => wait_close(&mut client, PATIENCE).0,
            Err(error)
                if matches!(
                    error.kind(),
                    ErrorKind::ConnectionReset | ErrorKind::BrokenPipe
                ) =>
            {
                Close::Reset
            }
            Err(error) => panic!("unexpected write error {error}"),
        };
        assert_eq!(
            close,
            Close::Reset,
            "a failed connect must not look like an empty reply"
        );
        slowest = slowest.max(attempt.elapsed());
    }
    eprintln!(
        "100 connects to a refused target: {:?} in all, slowest {slowest:?}",
        started.elapsed()
    );
    assert!(
        slowest < Duration::from_secs(1),
        "slowest reset took {slowest:?}"
    );
    assert_eq!(
        proxy.metric(
            "lameduck_upstream_connect_failures_total{direction=\"inbound\",reason=\"refused\"}"
        ),
        100.0
    );
    // No retry loop left behind: the proxy is idle and ready.
    let cpu_before = cpu_total(proxy.pid());
    thread::sleep(Duration::from_millis(500));
    assert!(
        cpu_total(proxy.pid()) - cpu_before < Duration::from_millis(100),
        "the proxy keeps working after the failures"
    );
    assert_eq!(proxy.get("/ready").status, 200);
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn connect_timeout_resets_the_client() {
    let (_blackhole, target, _fillers) = blackhole();
    let mut proxy = Proxy::start(&[
        "--inbound",
        &format!("127.0.0.1:0={target}/tcp"),
        "--connect-timeout=300ms",
    ]);
    let started = Instant::now();
    let mut client = TcpStream::connect(proxy.inbound[0]).unwrap();
    let (close, _) = wait_close(&mut client, PATIENCE);
    let took = started.elapsed();
    assert_eq!(close, Close::Reset);
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(3),
        "reset after {took:?} with a 300ms connect timeout"
    );
    assert_eq!(
        proxy.metric(
            "lameduck_upstream_connect_failures_total{direction=\"inbound\",reason=\"timeout\"}"
        ),
        1.0
    );
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn client_that_disappears_frees_the_target_side() {
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&["--inbound", &format!("{}/tcp", echo.route("127.0.0.1:0"))]);
    let inbound = proxy.inbound[0];
    // Warm up so that the runtime's own descriptors are all open before the baseline.
    drop(echo_connect(inbound));
    wait_until("warm-up connection closed", PATIENCE, || {
        echo.open.load(Ordering::SeqCst) == 0
    });
    let baseline = fd_count(proxy.pid());

    for i in 0..1000 {
        let mut client = TcpStream::connect(inbound).unwrap();
        client
            .write_all(b"POST / HTTP/1.1\r\ncontent-length: 100\r\n\r\nhalf")
            .unwrap();
        if i % 2 == 0 {
            reset_close(client);
        } else {
            shutdown_write(&client);
            drop(client);
        }
    }
    let took = wait_until("the proxy closed every target connection", PATIENCE, || {
        echo.open.load(Ordering::SeqCst) == 0
    });
    eprintln!("1000 vanished clients: target side clean {took:?} after the last");
    wait_until("descriptors back to the baseline", PATIENCE, || {
        fd_count(proxy.pid()) <= baseline + 2
    });
    // Left in CLOSE-WAIT, not passing through it: a socket whose peer's FIN has just arrived
    // is in CLOSE-WAIT until the proxy closes it a moment later, so this waits (boundedly)
    // for none of the proxy's sockets to be there.
    wait_until("no proxy socket is left in CLOSE-WAIT", PATIENCE, || {
        ss_count("state close-wait", proxy.pid()) == 0
    });
    // A connection leaves the table once its task has ended, a moment after its sockets
    // closed: waited for too (CI saw one still listed once in a few hundred runs).
    wait_until("no connection is left in the table", PATIENCE, || {
        proxy.get("/connections").body.matches("\"id\"").count() == 0
    });
    echo_connect(inbound);
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn half_close_is_forwarded_both_ways() {
    // Client finishes first: the target reads EOF, then replies in full.
    let target = TcpListener::bind("127.0.0.1:0").unwrap();
    let target_addr = target.local_addr().unwrap();
    let server = thread::spawn(move || {
        let (mut stream, _) = target.accept().unwrap();
        let mut request = Vec::new();
        stream.read_to_end(&mut request).unwrap();
        stream
            .write_all(format!("got {} bytes: ", request.len()).as_bytes())
            .unwrap();
        stream.write_all(&request).unwrap();
        drop(stream);
        // Reverse: the target finishes first while the client still sends.
        let (mut stream, _) = target.accept().unwrap();
        stream.write_all(b"server done").unwrap();
        stream.shutdown(std::net::Shutdown::Write).unwrap();
        let mut rest = Vec::new();
        stream.read_to_end(&mut rest).unwrap();
        rest
    });
    let mut proxy = Proxy::start(&["--inbound", &format!("127.0.0.1:0={target_addr}/tcp")]);

    let mut client = TcpStream::connect(proxy.inbound[0]).unwrap();
    client.set_read_timeout(Some(PATIENCE)).unwrap();
    client.write_all(b"hello").unwrap();
    shutdown_write(&client);
    let mut reply = String::new();
    client.read_to_string(&mut reply).unwrap();
    assert_eq!(reply, "got 5 bytes: hello");

    let mut client = TcpStream::connect(proxy.inbound[0]).unwrap();
    client.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut first = String::new();
    client.read_to_string(&mut first).unwrap();
    assert_eq!(first, "server done", "the target's FIN reached the client");
    client.write_all(b"client still talking").unwrap();
    shutdown_write(&client);
    assert_eq!(server.join().unwrap(), b"client still talking");
    assert_eq!(
        wait_close(&mut client, PATIENCE).0,
        Close::Eof,
        "full close after both FINs"
    );

    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn half_open_connection_is_closed_at_the_end_of_the_grace_period() {
    // The target half-closes and then goes silent; the client never closes.
    let target = TcpListener::bind("127.0.0.1:0").unwrap();
    let target_addr = target.local_addr().unwrap();
    let (closed_tx, closed_rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        let (mut stream, _) = target.accept().unwrap();
        stream.shutdown(std::net::Shutdown::Write).unwrap();
        let mut buf = [0u8; 64];
        let outcome = loop {
            match stream.read(&mut buf) {
                Ok(0) => break "eof",
                Ok(_) => continue,
                Err(_) => break "reset",
            }
        };
        closed_tx.send(outcome).unwrap();
    });
    let mut proxy = Proxy::start(&[
        "--inbound",
        &format!("127.0.0.1:0={target_addr}/tcp"),
        "--shutdown-grace-period=2s",
        // No close-spread window: the half-open stream is reset at the deadline (with one, it
        // gets its FINs first: tests/close_spread.rs).
        "--close-spread-window=0s",
    ]);
    let mut client = TcpStream::connect(proxy.inbound[0]).unwrap();
    client.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut nothing = Vec::new();
    client.read_to_end(&mut nothing).unwrap();
    let conns = proxy.get("/connections").body;
    assert!(conns.contains("\"state\": \"target_closed\""), "{conns}");

    let sent = Instant::now();
    proxy.signal(libc::SIGTERM);
    let target_side = closed_rx
        .recv_timeout(PATIENCE)
        .expect("the target side was never closed");
    let at = sent.elapsed();
    assert_eq!(target_side, "reset");
    assert!(
        at >= Duration::from_millis(1900) && at < Duration::from_secs(4),
        "closed at {at:?}, grace is 2s"
    );
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    assert!(
        client
            .write_all(b"x")
            .and_then(|()| client.write_all(b"y"))
            .is_err(),
        "the client side is closed too"
    );
}

#[test]
fn out_of_file_descriptors_backs_off_without_spinning_and_recovers() {
    let echo = EchoServer::start();
    let mut cmd = command_with_fd_limit(64);
    let mut proxy = Proxy::start_command(
        &mut cmd,
        &["--inbound", &format!("{}/tcp", echo.route("127.0.0.1:0"))],
    );
    let inbound = proxy.inbound[0];

    // Idle admin connections use up every descriptor, so accepting fails with EMFILE.
    let hogs: Vec<TcpStream> = (0..80)
        .map(|_| TcpStream::connect(proxy.admin).unwrap())
        .collect();
    proxy.logs.wait_for("about exhausted descriptors", |line| {
        line.contains("out of resources")
    });
    let waiting: Vec<TcpStream> = (0..50)
        .map(|_| TcpStream::connect(inbound).unwrap())
        .collect();
    thread::sleep(Duration::from_millis(300));

    let (cpu, logged, elapsed) = measure(&proxy, "out of resources", Duration::from_secs(2));
    eprintln!(
        "out of descriptors for {elapsed:?}: proxy CPU {cpu:?}, {logged} accept-error log lines"
    );
    assert!(
        cpu < elapsed / 5,
        "the accept loops spin: {cpu:?} of CPU in {elapsed:?}"
    );
    assert!(
        logged <= 6,
        "{logged} log lines in {elapsed:?}: not rate-limited"
    );
    assert!(
        proxy.is_running(),
        "running out of descriptors must not end the proxy"
    );

    drop(hogs);
    drop(waiting);
    let took = wait_until(
        "a new connection is forwarded after the release",
        PATIENCE,
        || echoes(inbound),
    );
    eprintln!("forwarding again {took:?} after releasing the descriptors");
    assert!(took < Duration::from_secs(5), "recovery took {took:?}");
    assert!(
        proxy.metric("lameduck_accept_errors_total{direction=\"inbound\"}") > 0.0,
        "the failed accepts are counted"
    );

    // The connection limit derived from the descriptor limit keeps the rest in the listen
    // queue: no errors, no spinning, and the admin server still answers.
    let held: Vec<TcpStream> = (0..300)
        .map(|_| TcpStream::connect(inbound).unwrap())
        .collect();
    proxy.logs.wait_for("about the connection limit", |line| {
        line.contains("at the connection limit")
    });
    let (cpu, _, elapsed) = measure(&proxy, "out of resources", Duration::from_secs(1));
    assert!(
        cpu < elapsed / 5,
        "{cpu:?} of CPU in {elapsed:?} at the connection limit"
    );
    assert_eq!(
        proxy.get("/live").status,
        200,
        "the admin server answers while the data plane is at its limit"
    );
    drop(held);
    let took = wait_until("forwarding after the queue emptied", PATIENCE, || {
        echoes(inbound)
    });
    assert!(took < Duration::from_secs(5), "recovery took {took:?}");
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

/// CPU used by the proxy and log lines containing `needle` over `window`.
fn measure(proxy: &Proxy, needle: &str, window: Duration) -> (Duration, usize, Duration) {
    let cpu_before = cpu_total(proxy.pid());
    let logged_before = count_lines(&proxy.logs, needle);
    let started = Instant::now();
    thread::sleep(window);
    let cpu = cpu_total(proxy.pid()) - cpu_before;
    (
        cpu,
        count_lines(&proxy.logs, needle) - logged_before,
        started.elapsed(),
    )
}

/// Whether a fresh connection through `addr` echoes within half a second.
fn echoes(addr: std::net::SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect(addr) else {
        return false;
    };
    stream
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut buf = [0u8; 2];
    stream.write_all(b"ok").is_ok() && stream.read_exact(&mut buf).is_ok() && &buf == b"ok"
}

fn count_lines(logs: &Logs, needle: &str) -> usize {
    logs.lines()
        .iter()
        .filter(|line| line.contains(needle))
        .count()
}

/// The TCP sockets in `filter` that the process `pid` holds, seen by ss(8).
fn ss_count(filter: &str, pid: i32) -> usize {
    let output = std::process::Command::new("ss")
        .args(["-Htanp", filter])
        .output()
        .expect("run ss");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|line| line.contains(&format!("pid={pid},")))
        .count()
}
