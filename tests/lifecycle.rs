//! The shutdown lifecycle of docs/lifecycle.md, driven by real signals on the real binary:
//! refusal, drain, the grace period, a second signal, signals during start-up, PID 1.

mod support;

use std::io::{Read, Write};
use std::thread;
use std::time::{Duration, Instant};

use support::process::children;
use support::*;

#[test]
fn idle_proxy_exits_promptly_after_sigterm() {
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&["--inbound", &echo.route("127.0.0.1:0")]);
    let sent = Instant::now();
    proxy.signal(libc::SIGTERM);
    let status = proxy.wait_exit(PATIENCE);
    let took = sent.elapsed();
    assert_eq!(status.code(), Some(0));
    assert!(
        took < Duration::from_secs(1),
        "an idle proxy took {took:?} to exit"
    );
    eprintln!("idle proxy exited {took:?} after SIGTERM");
    assert!(
        proxy.logs.text().contains("drained"),
        "{}",
        proxy.logs.text()
    );
}

#[test]
fn sigterm_stops_accepting_at_once_and_keeps_accepted_connections() {
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&[
        "--inbound",
        &echo.route("127.0.0.1:0"),
        "--outbound",
        &echo.route("127.0.0.1:0"),
    ]);
    let (inbound, outbound) = (proxy.inbound[0], proxy.outbound[0]);
    let mut held = echo_connect(inbound);
    assert_eq!(proxy.get("/ready").status, 200);

    proxy.signal(libc::SIGTERM);
    // Outbound closes with inbound by default: its accept loop is another task, so it may
    // close a moment later on a loaded machine, but within the same bound. Both are watched
    // from the signal on.
    let outbound_refused = thread::spawn(move || refusing_from(outbound, PATIENCE));
    let ready_after = wait_until("/ready turns 503", PATIENCE, || {
        proxy.get("/ready").status == 503
    });
    let refused_after = ready_after + refusing_from(inbound, PATIENCE);
    let outbound_refused_after = outbound_refused.join().unwrap();
    eprintln!(
        "after SIGTERM: /ready 503 within {ready_after:?}, first refused connect began inbound {refused_after:?}, outbound {outbound_refused_after:?}"
    );
    assert!(
        refused_after < Duration::from_secs(1),
        "refusing took {refused_after:?}"
    );
    assert!(
        outbound_refused_after < Duration::from_secs(1),
        "outbound refusing took {outbound_refused_after:?}"
    );
    // Every later attempt is refused, on both sides.
    for _ in 0..100 {
        assert_eq!(try_connect(inbound), Attempt::Refused);
        assert_eq!(try_connect(outbound), Attempt::Refused);
        thread::sleep(Duration::from_millis(1));
    }
    // The connection accepted before the signal is untouched.
    echo_round_trip(&mut held, b"still flowing");
    assert!(proxy.is_running());

    drop(held);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn lame_duck_period_keeps_accepting_then_refuses() {
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&[
        "--inbound",
        &echo.route("127.0.0.1:0"),
        "--lame-duck-period=1500ms",
        "--shutdown-grace-period=10s",
    ]);
    let inbound = proxy.inbound[0];
    let held = echo_connect(inbound);
    let sent = Instant::now();
    proxy.signal(libc::SIGTERM);
    wait_until("/ready turns 503", PATIENCE, || {
        proxy.get("/ready").status == 503
    });
    assert!(
        sent.elapsed() < Duration::from_millis(1500),
        "/ready turned 503 only after the lame-duck period"
    );

    // During the lame-duck period new connections are still accepted and forwarded.
    let mut during = echo_connect(inbound);
    assert!(
        sent.elapsed() < Duration::from_millis(1500),
        "the machine was too slow to test inside the period"
    );
    echo_round_trip(&mut during, b"lame duck");

    let refused = wait_until("refused after the lame-duck period", PATIENCE, || {
        try_connect(inbound) == Attempt::Refused
    });
    let at = sent.elapsed();
    assert!(
        at >= Duration::from_millis(1400),
        "refused after {at:?}, before the lame-duck period ended"
    );
    eprintln!("lame duck 1500ms: first refusal {at:?} after SIGTERM (polled for {refused:?})");
    // Draining (two connections still open): `lameduck status` says the listeners are closed.
    let status = proxy.status();
    assert!(
        status.contains("phase:         draining")
            && status.contains("inbound:       closed to new clients (shutdown), draining"),
        "{status}"
    );

    drop(held);
    drop(during);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

/// Whether a connection from `source` (a loopback address) to `addr` is refused: by the kernel
/// (a closed listener), or accepted and reset before it is served (a late connection after an
/// adaptive lame duck, docs/pod-lifecycle.md).
fn refused_from(source: [u8; 4], addr: std::net::SocketAddr) -> bool {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket
        .bind(&std::net::SocketAddr::from((source, 0)).into())
        .unwrap();
    if let Err(error) = socket.connect_timeout(&addr.into(), Duration::from_secs(2)) {
        return error.kind() == std::io::ErrorKind::ConnectionRefused;
    }
    let mut stream = std::net::TcpStream::from(socket);
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut echoed = [0u8; 5];
    let answer = stream
        .write_all(b"probe")
        .and_then(|()| stream.read_exact(&mut echoed));
    matches!(answer, Err(error) if matches!(error.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe))
}

/// An adaptive lame duck: (the proxy's SIGTERM at t = 0) with `arrivals` of clients opening a
/// new connection every 100 ms (each echoed), while a prober from an ignored source (as the
/// kubelet's probes come from the node) connects until refused; returns when the first
/// refusal came, and the proxy's /status meanwhile.
fn adaptive_lame_duck(arrivals: Duration) -> (Duration, serde_json::Value) {
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&[
        "--inbound",
        &echo.route("127.0.0.1:0"),
        "--lame-duck-max=8s",
        "--lame-duck-quiet-window=500ms",
        "--lame-duck-min=0s",
        "--lame-duck-ignore-sources=127.0.0.2",
        "--shutdown-grace-period=15s",
    ]);
    let inbound = proxy.inbound[0];
    let held = echo_connect(inbound);
    let sent = Instant::now();
    proxy.signal(libc::SIGTERM);
    let clients = thread::spawn(move || {
        let mut served = 0;
        while sent.elapsed() < arrivals {
            let mut stream = echo_connect(inbound);
            echo_round_trip(&mut stream, b"still here?");
            served += 1;
            thread::sleep(Duration::from_millis(100));
        }
        served
    });
    wait_until("refused to the prober", PATIENCE, || {
        refused_from([127, 0, 0, 2], inbound)
    });
    let refused = sent.elapsed();
    let served = clients
        .join()
        .expect("a client's connection failed during the lame duck");
    let status: serde_json::Value = serde_json::from_str(&proxy.get("/status").body).unwrap();
    drop(held);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    eprintln!(
        "adaptive lame duck, arrivals for {arrivals:?}: {served} served, refused after {refused:?}"
    );
    (refused, status["lame_duck"].clone())
}

/// The adaptive lame duck lasts while new connections keep arriving (every one served), and
/// ends once their source has been quiet for its window (20 of its gaps: 2 s at one connection
/// every 100 ms), far from its 8 s maximum; the prober from an ignored source does not hold it
/// open (alone, the lame duck ends at once: its minimum is 0 s).
#[test]
fn adaptive_lame_duck_lasts_while_new_connections_arrive() {
    let (refused, lame_duck) = adaptive_lame_duck(Duration::from_secs(2));
    assert!(
        refused >= Duration::from_secs(2),
        "refused after {refused:?}, while clients still arrived"
    );
    assert!(
        refused < Duration::from_secs(6),
        "refused only after {refused:?}: the source's window did not end it"
    );
    assert_eq!(lame_duck["ended"], "quiet", "{lame_duck}");
    assert_eq!(
        lame_duck["last_arrival"]["from"], "127.0.0.1",
        "{lame_duck}"
    );

    let (refused, lame_duck) = adaptive_lame_duck(Duration::ZERO);
    assert!(
        refused < Duration::from_secs(4),
        "refused only after {refused:?}: the ignored prober held the lame duck open"
    );
    assert_eq!(lame_duck["ended"], "quiet", "{lame_duck}");
    assert!(lame_duck["last_arrival"].is_null(), "{lame_duck}");
}

#[test]
fn tcp_stream_keeps_flowing_while_draining() {
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&["--inbound", &format!("{}/tcp", echo.route("127.0.0.1:0"))]);
    let mut stream = echo_connect(proxy.inbound[0]);
    let mut exchange = |round: u32| {
        let payload: Vec<u8> = (0..1024u32)
            .map(|i| (i.wrapping_mul(31) ^ round) as u8)
            .collect();
        echo_round_trip(&mut stream, &payload);
    };
    for round in 0..5 {
        exchange(round);
        thread::sleep(Duration::from_millis(100));
    }
    proxy.signal(libc::SIGTERM);
    for round in 5..15 {
        exchange(round);
        thread::sleep(Duration::from_millis(100));
    }
    assert!(
        proxy.is_running(),
        "the proxy exited while a stream was open"
    );
    let closed = Instant::now();
    drop(stream);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    let took = closed.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "exit took {took:?} after the last connection closed"
    );
    eprintln!("exited {took:?} after the last stream closed");
}

#[test]
fn grace_expiry_resets_open_tcp_connections_and_names_them() {
    // One idle-but-open tunnel, and one stream the backend never stops sending on.
    let firehose = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let firehose_addr = firehose.local_addr().unwrap();
    thread::spawn(move || {
        for stream in firehose.incoming() {
            let Ok(mut stream) = stream else { continue };
            thread::spawn(move || {
                while stream.write_all(&[b'x'; 1024]).is_ok() {
                    thread::sleep(Duration::from_millis(10));
                }
            });
        }
    });
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&[
        "--inbound",
        &echo.route("127.0.0.1:0"),
        "--inbound",
        &format!("127.0.0.1:0={firehose_addr}/tcp"),
        "--shutdown-grace-period=2s",
        // No close-spread window: what is still open at the deadline is reset (the window's
        // FINs are tests/close_spread.rs').
        "--close-spread-window=0s",
    ]);
    let mut idle = echo_connect(proxy.inbound[0]);
    let mut streaming = std::net::TcpStream::connect(proxy.inbound[1]).unwrap();
    let mut first = [0u8; 1];
    streaming.set_read_timeout(Some(PATIENCE)).unwrap();
    streaming.read_exact(&mut first).unwrap();

    let sent = Instant::now();
    proxy.signal(libc::SIGTERM);
    let (idle_close, _) = wait_close(&mut idle, PATIENCE);
    let idle_at = sent.elapsed();
    let (streaming_close, _) = wait_close(&mut streaming, PATIENCE);
    let status = proxy.wait_exit(PATIENCE);
    let exit_at = sent.elapsed();

    assert_eq!(
        idle_close,
        Close::Reset,
        "the idle tunnel must be reset, not closed as if complete"
    );
    assert_eq!(streaming_close, Close::Reset);
    assert!(
        idle_at >= Duration::from_millis(1900) && idle_at <= Duration::from_secs(4),
        "reset at {idle_at:?}, expected at the 2 s grace period"
    );
    assert!(exit_at <= Duration::from_secs(4), "exited at {exit_at:?}");
    assert_eq!(
        status.code(),
        Some(0),
        "a forced close at the end of the grace period still exits 0"
    );
    eprintln!("grace 2s: connections reset at {idle_at:?}, exit at {exit_at:?}");

    let logs = proxy.logs.text();
    let named: Vec<String> = proxy
        .logs
        .lines()
        .into_iter()
        .filter(|line| line.contains("force-closing"))
        .collect();
    assert_eq!(named.len(), 2, "both survivors are named:\n{logs}");
    let idle_peer = idle.local_addr().unwrap().to_string();
    assert!(
        named
            .iter()
            .any(|line| line.contains(&format!("peer={idle_peer}"))),
        "{logs}"
    );
    assert!(
        named
            .iter()
            .all(|line| line.contains("age=") && line.contains("bytes_from_peer=")),
        "{logs}"
    );
    assert!(
        logs.contains("\"connections\":2"),
        "the count of reset connections is logged:\n{logs}"
    );
}

#[test]
fn zero_grace_period_resets_at_once() {
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&[
        "--inbound",
        &echo.route("127.0.0.1:0"),
        "--shutdown-grace-period=0s",
    ]);
    let mut held = echo_connect(proxy.inbound[0]);
    let sent = Instant::now();
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    let took = sent.elapsed();
    assert!(took < Duration::from_millis(1000), "grace 0s took {took:?}");
    assert_eq!(wait_close(&mut held, PATIENCE).0, Close::Reset);
    eprintln!("grace 0s: exit {took:?} after SIGTERM");
}

#[test]
fn admin_shutdown_drains_like_sigterm() {
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&[
        "--inbound",
        &echo.route("127.0.0.1:0"),
        "--shutdown-endpoint",
    ]);
    let inbound = proxy.inbound[0];
    let mut held = echo_connect(inbound);

    let response = proxy.post("/shutdown");
    assert_eq!(response.status, 200);
    assert_eq!(response.body, "shutdown\n");
    wait_until("refused after POST /shutdown", PATIENCE, || {
        try_connect(inbound) == Attempt::Refused
    });
    assert_eq!(proxy.get("/ready").status, 503);
    assert_eq!(
        proxy.get("/live").status,
        200,
        "the admin server keeps serving while draining"
    );
    echo_round_trip(&mut held, b"in flight");

    let again = proxy.post("/shutdown");
    assert_eq!(
        (again.status, again.body.as_str()),
        (200, "shutdown\n"),
        "a second POST answers 200 and does nothing more"
    );
    proxy.logs.wait_event("shutdown started");
    assert_eq!(proxy.logs.events("shutdown started").len(), 1);
    assert_eq!(
        proxy.logs.events("shutdown started")[0]["fields"]["trigger"],
        "POST /shutdown"
    );

    drop(held);
    assert_eq!(
        proxy.wait_exit(PATIENCE).code(),
        Some(0),
        "same exit status as after SIGTERM"
    );
}

#[test]
fn second_sigterm_stops_now_with_143() {
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&["--inbound", &echo.route("127.0.0.1:0")]);
    let mut held = echo_connect(proxy.inbound[0]);
    proxy.signal(libc::SIGTERM);
    wait_until("draining", PATIENCE, || proxy.get("/ready").status == 503);
    thread::sleep(Duration::from_millis(200));
    assert!(
        proxy.is_running(),
        "one SIGTERM drains, it does not stop an open connection"
    );
    let sent = Instant::now();
    proxy.signal(libc::SIGTERM);
    let status = proxy.wait_exit(PATIENCE);
    assert_eq!(status.code(), Some(143));
    assert!(
        sent.elapsed() < Duration::from_secs(2),
        "stop now took {:?}",
        sent.elapsed()
    );
    assert_eq!(wait_close(&mut held, PATIENCE).0, Close::Reset);
    assert!(!proxy.logs.text().contains("panicked"));
}

#[test]
fn sigint_drains_like_sigterm_and_a_second_sigint_exits_130() {
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&["--inbound", &echo.route("127.0.0.1:0")]);
    let mut held = echo_connect(proxy.inbound[0]);
    proxy.signal(libc::SIGINT);
    wait_until("refused after SIGINT", PATIENCE, || {
        try_connect(proxy.inbound[0]) == Attempt::Refused
    });
    echo_round_trip(&mut held, b"after SIGINT");
    assert_eq!(
        proxy.logs.wait_event("shutdown started")["fields"]["trigger"],
        "SIGINT"
    );
    proxy.signal(libc::SIGINT);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(130));

    // And one SIGINT alone drains to exit 0.
    let mut proxy = Proxy::start(&["--inbound", &echo.route("127.0.0.1:0")]);
    let held = echo_connect(proxy.inbound[0]);
    proxy.signal(libc::SIGINT);
    wait_until("draining", PATIENCE, || proxy.get("/ready").status == 503);
    drop(held);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn sighup_is_not_fatal() {
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&["--inbound", &echo.route("127.0.0.1:0")]);
    proxy.signal(libc::SIGHUP);
    proxy
        .logs
        .wait_for("about SIGHUP", |line| line.contains("SIGHUP"));
    assert!(proxy.is_running());
    assert_eq!(
        proxy.get("/ready").status,
        200,
        "SIGHUP does not start a shutdown"
    );
    echo_connect(proxy.inbound[0]);
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn outbound_after_inbound_keeps_outbound_open_until_inbound_drained() {
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&[
        "--inbound",
        &echo.route("127.0.0.1:0"),
        "--outbound",
        &echo.route("127.0.0.1:0"),
        "--outbound-shutdown=after-inbound",
    ]);
    let (inbound, outbound) = (proxy.inbound[0], proxy.outbound[0]);
    let held_inbound = echo_connect(inbound);
    let mut held_outbound = echo_connect(outbound);
    proxy.signal(libc::SIGTERM);
    wait_until("inbound refused", PATIENCE, || {
        try_connect(inbound) == Attempt::Refused
    });

    // While an inbound connection is open the app can still call out, on new connections too.
    for _ in 0..5 {
        let mut call = echo_connect(outbound);
        echo_round_trip(&mut call, b"the app still calls out");
        thread::sleep(Duration::from_millis(50));
    }
    assert!(proxy.is_running());

    let drained = Instant::now();
    drop(held_inbound);
    let took = refusing_from(outbound, PATIENCE);
    eprintln!(
        "outbound listener closed {took:?} after the last inbound connection ({:?})",
        drained.elapsed()
    );
    assert!(took < Duration::from_secs(2));
    echo_round_trip(&mut held_outbound, b"outbound connections still drain");
    drop(held_outbound);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn sigterm_during_start_up_is_not_lost() {
    // Wait until the handler is installed (the SigCgt mask has SIGTERM), then signal at once,
    // while the proxy is still reading its configuration and binding.
    for _ in 0..5 {
        let echo = EchoServer::start();
        let mut child = command()
            .args([
                "--inbound",
                &echo.route("127.0.0.1:0"),
                "--admin=127.0.0.1:0",
            ])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        wait_until("the SIGTERM handler is installed", PATIENCE, || {
            sigterm_caught(pid)
        });
        signal_pid(pid, libc::SIGTERM);
        // A lost signal shows as a process that never exits.
        let status = wait_child(&mut child, PATIENCE);
        assert_eq!(
            status.code(),
            Some(0),
            "a shutdown before serving is still a graceful one"
        );
    }
}

#[test]
fn pid1_drains_on_sigterm_and_does_not_lose_an_early_one() {
    let echo = EchoServer::start();
    // Steady state: lameduck is PID 1 of a new PID namespace.
    let mut proxy = Proxy::start_command(
        &mut pid1_command(),
        &["--inbound", &echo.route("127.0.0.1:0")],
    );
    let pid = wait_for_child_pid(proxy.pid());
    assert_eq!(ns_pid(pid), 1, "lameduck should be PID 1 in its namespace");
    let mut held = echo_connect(proxy.inbound[0]);
    signal_pid(pid, libc::SIGTERM);
    wait_until("refused after SIGTERM to PID 1", PATIENCE, || {
        try_connect(proxy.inbound[0]) == Attempt::Refused
    });
    echo_round_trip(&mut held, b"pid 1 drains");
    drop(held);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));

    // Start-up: SIGTERM as soon as the handler exists, before the proxy serves.
    let mut wrapper = pid1_command()
        .args([
            "--inbound",
            &echo.route("127.0.0.1:0"),
            "--admin=127.0.0.1:0",
        ])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = wait_for_child_pid(wrapper.id() as i32);
    wait_until("the SIGTERM handler is installed", PATIENCE, || {
        sigterm_caught(pid)
    });
    signal_pid(pid, libc::SIGTERM);
    // A lost signal shows as a process that never exits (`--kill-child` ends it with the wrapper).
    let status = wait_child(&mut wrapper, PATIENCE);
    assert_eq!(status.code(), Some(0));
}

/// `unshare --pid --fork --mount-proc lameduck ...`: lameduck becomes PID 1 of a new namespace.
fn pid1_command() -> std::process::Command {
    let mut cmd = std::process::Command::new("unshare");
    cmd.args(["--pid", "--fork", "--mount-proc", "--kill-child", BIN]);
    cmd
}

fn wait_for_child_pid(parent: i32) -> i32 {
    let mut pid = None;
    wait_until("unshare forks lameduck", PATIENCE, || {
        pid = children(parent)
            .into_iter()
            .find(|&child| comm(child) == "lameduck");
        pid.is_some()
    });
    pid.unwrap()
}

fn comm(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// The PID of `pid` inside its own PID namespace (the last NSpid entry).
fn ns_pid(pid: i32) -> i32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|line| line.starts_with("NSpid:"))
        .unwrap();
    line.split_whitespace().last().unwrap().parse().unwrap()
}

/// Whether the process has a handler for SIGTERM (bit 15 of SigCgt).
fn sigterm_caught(pid: i32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    let Some(mask) = status.lines().find_map(|line| line.strip_prefix("SigCgt:")) else {
        return false;
    };
    u64::from_str_radix(mask.trim(), 16).is_ok_and(|mask| mask & (1 << (libc::SIGTERM - 1)) != 0)
}

#[test]
fn single_cpu_proxy_runs_on_one_thread_and_drains() {
    use std::os::unix::process::CommandExt;
    let echo = EchoServer::start();
    let mut cmd = command();
    // SAFETY: sched_setaffinity only reads the set and affects only the child.
    unsafe {
        cmd.pre_exec(|| {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(0, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
            Ok(())
        });
    }
    let mut proxy = Proxy::start_command(&mut cmd, &["--inbound", &echo.route("127.0.0.1:0")]);
    let threads = std::fs::read_dir(format!("/proc/{}/task", proxy.pid()))
        .unwrap()
        .count();
    assert_eq!(
        threads, 1,
        "one CPU: the current-thread runtime, no worker threads"
    );
    let mut held = echo_connect(proxy.inbound[0]);
    proxy.signal(libc::SIGTERM);
    wait_until("refused", PATIENCE, || {
        try_connect(proxy.inbound[0]) == Attempt::Refused
    });
    echo_round_trip(&mut held, b"one thread still drains");
    drop(held);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn connections_waiting_in_the_accept_queue_are_served_not_reset() {
    // A descriptor limit of 48 gives a connection limit of (48 - 32) / 2 = 8: the ninth and
    // later clients complete their handshake and wait in the kernel's accept queue.
    let echo = EchoServer::start();
    let mut cmd = command_with_fd_limit(48);
    let mut proxy = Proxy::start_command(
        &mut cmd,
        &["--inbound", &format!("{}/tcp", echo.route("127.0.0.1:0"))],
    );
    let inbound = proxy.inbound[0];
    let mut served: Vec<std::net::TcpStream> = (0..8).map(|_| echo_connect(inbound)).collect();
    let mut queued: Vec<std::net::TcpStream> = (0..4)
        .map(|i| {
            let mut stream = std::net::TcpStream::connect(inbound).unwrap();
            stream.set_read_timeout(Some(PATIENCE)).unwrap();
            stream.write_all(format!("queued {i}").as_bytes()).unwrap();
            stream
        })
        .collect();
    proxy.logs.wait_for("about the connection limit", |line| {
        line.contains("at the connection limit")
    });
    assert_eq!(
        echo.open.load(std::sync::atomic::Ordering::SeqCst),
        8,
        "the queued clients are not forwarded yet"
    );

    proxy.signal(libc::SIGTERM);
    // Each queued client is accepted and forwarded: its bytes come back, nothing is reset.
    for (i, stream) in queued.iter_mut().enumerate() {
        let expected = format!("queued {i}");
        let mut back = vec![0u8; expected.len()];
        stream
            .read_exact(&mut back)
            .unwrap_or_else(|error| panic!("queued client {i}: {error}"));
        assert_eq!(back, expected.as_bytes());
    }
    proxy.logs.wait_for("about the queued connections", |line| {
        line.contains("accepted queued connections")
    });
    assert_eq!(
        try_connect(inbound),
        Attempt::Refused,
        "new connections are refused after the close"
    );
    for stream in &mut served {
        echo_round_trip(stream, b"still served");
    }
    drop(served);
    drop(queued);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

/// The exit's summary goes where Kubernetes shows it (`--termination-log`, the container's
/// termination message in `kubectl describe pod`): how the shutdown ended, how long it took,
/// and what was reset.
#[test]
fn the_exit_summary_is_written_as_the_termination_message() {
    let dir = std::env::temp_dir().join(format!("lameduck-termlog-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("termination-log");
    let log_flag = format!("--termination-log={}", log.display());
    let echo = EchoServer::start();

    // Drained: nothing open.
    let mut proxy = Proxy::start(&[
        "--inbound",
        &echo.route("127.0.0.1:0"),
        "--shutdown-grace-period=10s",
        &log_flag,
    ]);
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    let message = std::fs::read_to_string(&log).unwrap();
    assert!(
        message.starts_with("lameduck: shutdown by SIGTERM: drained in ")
            && message.contains("(grace period 10s)"),
        "{message}"
    );

    // The grace period ran out with a TCP stream open: it was reset, and the message names it.
    let mut proxy = Proxy::start(&[
        "--inbound",
        &echo.route("127.0.0.1:0"),
        "--shutdown-grace-period=1s",
        "--close-spread-window=0s",
        &log_flag,
    ]);
    let held = echo_connect(proxy.inbound[0]);
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    let message = std::fs::read_to_string(&log).unwrap();
    assert!(
        message.contains("shutdown by SIGTERM: the grace period ran out after")
            && message.contains("1 connections reset, the first: id=")
            && message.contains("protocol=tcp"),
        "{message}"
    );
    drop(held);
    let _ = std::fs::remove_dir_all(&dir);
}
