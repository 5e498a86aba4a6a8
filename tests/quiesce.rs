//! The inbound quiesce that an app container's `preStop` hook asks for (docs/pod-lifecycle.md),
//! on the real binary: `lameduck prestop` and `lameduck poststart` against a running proxy
//! over its control socket.

mod support;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use support::backend::{Backend, get, read_response, send_raw};
use support::{
    Attempt, BIN, EchoServer, PATIENCE, Proxy, echo_connect, try_connect, wait_child, wait_until,
};

/// A folder standing in for the pod's shared `emptyDir` (mode 0777, as the kubelet makes it),
/// and the control socket's path in it.
fn shared_dir(test: &str) -> (PathBuf, String) {
    let dir = std::env::temp_dir().join(format!("lameduck-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let socket = dir.join("drain.sock").display().to_string();
    (dir, socket)
}

/// Starts `lameduck HOOK --socket SOCKET ARGS…` with its output piped.
fn spawn_hook(hook: &str, socket: &str, args: &[&str]) -> Child {
    Command::new(BIN)
        .args([hook, "--socket", socket])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for a hook to exit: its status, its output, how long it ran from `started`.
fn finish(mut child: Child, started: Instant) -> (ExitStatus, String, Duration) {
    let status = wait_child(&mut child, PATIENCE * 3);
    let elapsed = started.elapsed();
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    (status, out, elapsed)
}

/// A proxy with an inbound route to a test backend and its control socket in a shared
/// folder, and `extra` flags: (backend, folder, socket path, proxy).
fn quiescable_with(test: &str, extra: &[&str]) -> (Backend, PathBuf, String, Proxy) {
    let backend = Backend::start();
    let (dir, socket) = shared_dir(test);
    let route = backend.route("127.0.0.1:0");
    let mut args = vec!["--inbound", &route, "--drain-socket", &socket];
    args.extend_from_slice(extra);
    let proxy = Proxy::start(&args);
    (backend, dir, socket, proxy)
}

fn quiescable(test: &str) -> (Backend, PathBuf, String, Proxy) {
    quiescable_with(test, &[])
}

fn run_hook(hook: &str, socket: &str, args: &[&str]) -> (ExitStatus, String, Duration) {
    let started = Instant::now();
    finish(spawn_hook(hook, socket, args), started)
}

fn keep_alive_get(stream: &mut std::net::TcpStream, path: &str) -> support::backend::WireResponse {
    stream.write_all(&get(path)).unwrap();
    read_response(stream).expect("a response through the proxy")
}

#[test]
fn prestop_returns_once_inbound_has_drained_and_leaves_outbound_open() {
    let backend = Backend::start();
    let (_dir, socket) = shared_dir("drain");
    let mut proxy = Proxy::start(&[
        "--inbound",
        &backend.route("127.0.0.1:0"),
        "--outbound",
        &backend.route("127.0.0.1:0"),
        "--drain-socket",
        &socket,
        "--lame-duck-period",
        "1s",
    ]);
    let (inbound, outbound) = (proxy.inbound[0], proxy.outbound[0]);
    let mut idle_in = send_raw(inbound, &get("/"));
    assert_eq!(read_response(&mut idle_in).unwrap().status, 200);
    let mut idle_out = send_raw(outbound, &get("/"));
    assert_eq!(read_response(&mut idle_out).unwrap().status, 200);
    // A request in flight when the pod is deleted.
    let mut in_flight = send_raw(inbound, &get("/delay?ms=2500"));

    let started = Instant::now();
    let mut hook = spawn_hook("prestop", &socket, &[]);
    wait_until("/ready answers 503", PATIENCE, || {
        proxy.get("/ready").status == 503
    });
    assert_eq!(proxy.get("/live").status, 200);

    // Lame duck: inbound still accepts, and every inbound HTTP connection is asked to go away.
    let again = keep_alive_get(&mut idle_in, "/");
    assert_eq!(again.header("connection"), Some("close"), "{again:?}");
    let mut fresh_in = send_raw(inbound, &get("/"));
    let fresh = read_response(&mut fresh_in).unwrap();
    assert_eq!(
        (fresh.status, fresh.header("connection")),
        (200, Some("close"))
    );
    // The outbound side is untouched: no connection: close, new connections accepted.
    let out = keep_alive_get(&mut idle_out, "/");
    assert_eq!((out.status, out.header("connection")), (200, None));
    let mut fresh_out = send_raw(outbound, &get("/"));
    let fresh = read_response(&mut fresh_out).unwrap();
    assert_eq!((fresh.status, fresh.header("connection")), (200, None));

    // The hook waits for the request in flight, which completes and closes its connection.
    assert!(
        hook.try_wait().unwrap().is_none(),
        "prestop returned while an inbound request was in flight"
    );
    let done = read_response(&mut in_flight).unwrap();
    assert_eq!(
        (done.status, done.header("connection")),
        (200, Some("close"))
    );
    let (status, out, elapsed) = finish(hook, started);
    assert!(status.success(), "{out}");
    assert!(out.contains("ok inbound drained in"), "{out}");
    assert!(
        elapsed >= Duration::from_millis(2400),
        "returned after {elapsed:?}, before the request in flight had finished"
    );

    // Quiesced: inbound refused, outbound serving as before.
    assert_eq!(proxy.metric("lameduck_inbound_quiesced"), 1.0);
    assert_eq!(try_connect(inbound), Attempt::Refused);
    let out = keep_alive_get(&mut idle_out, "/");
    assert_eq!((out.status, out.header("connection")), (200, None));
    assert_eq!(proxy.get("/ready").status, 503);
    assert!(proxy.is_running());

    // The proxy's own SIGTERM (the app has exited): no second lame duck, out at once.
    drop((idle_out, fresh_out));
    let signalled = Instant::now();
    proxy.signal(libc::SIGTERM);
    let status = proxy.wait_exit(PATIENCE);
    assert_eq!(status.code(), Some(0));
    assert!(
        signalled.elapsed() < Duration::from_millis(900),
        "took {:?}: the lame duck ran again",
        signalled.elapsed()
    );
    proxy.logs.wait_for("skipping the lame duck", |line| {
        line.contains("the inbound side was quiesced already")
    });
}

#[test]
fn the_grace_period_bounds_the_inbound_drain_and_resets_the_rest() {
    let echo = EchoServer::start();
    let (_dir, socket) = shared_dir("grace");
    let proxy = Proxy::start(&[
        "--inbound",
        &format!("127.0.0.1:0={}/tcp", echo.addr),
        "--drain-socket",
        &socket,
        "--shutdown-grace-period",
        "1s",
    ]);
    let mut held = echo_connect(proxy.inbound[0]);
    let (status, out, elapsed) = run_hook("prestop", &socket, &[]);
    assert!(status.success(), "{out}");
    assert!(
        out.contains("grace period ran out") && out.contains("reset 1 inbound connections"),
        "{out}"
    );
    assert!(
        elapsed >= Duration::from_millis(900) && elapsed < PATIENCE,
        "{elapsed:?}"
    );
    let mut buf = [0u8; 1];
    let read = held.read(&mut buf);
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "the held connection is closed: {read:?}"
    );
}

#[test]
fn the_quiesce_ends_long_lived_connections_in_its_close_spread_window() {
    let echo = EchoServer::start();
    let (_dir, socket) = shared_dir("spread");
    let proxy = Proxy::start(&[
        "--inbound",
        &format!("127.0.0.1:0={}/tcp", echo.addr),
        "--drain-socket",
        &socket,
        "--shutdown-grace-period=4s",
        "--close-spread-window=2s",
    ]);
    let mut held = echo_connect(proxy.inbound[0]);
    let started = Instant::now();
    // The client closes once the proxy has ended its stream (a FIN), as clients do.
    let client = std::thread::spawn(move || {
        let (close, _) = support::wait_close(&mut held, PATIENCE);
        let at = started.elapsed();
        drop(held);
        (close, at)
    });
    let (status, out, elapsed) = run_hook("prestop", &socket, &[]);
    let (close, fin_at) = client.join().unwrap();
    assert!(status.success(), "{out}");
    assert_eq!(close, support::Close::Eof, "a FIN, not a reset");
    assert!(
        fin_at >= Duration::from_millis(1950) && fin_at < Duration::from_secs(4),
        "the FIN came {fin_at:?} after the quiesce began; its window is the last 2 s of 4"
    );
    // Drained as soon as the client closed: nothing reset, the grace period not used up.
    assert!(out.contains("ok inbound drained"), "{out}");
    assert!(elapsed < Duration::from_secs(4), "{elapsed:?}");
}

#[test]
fn poststart_after_a_container_restart_serves_inbound_again() {
    let (backend, _dir, socket, proxy) = quiescable("restart");
    let inbound = proxy.inbound[0];
    // The first start of the app container: nothing to resume.
    let (status, out, _) = run_hook("poststart", &socket, &[]);
    assert!(status.success(), "{out}");
    assert!(out.contains("ok inbound side already serving"), "{out}");

    for round in 0..2 {
        // The liveness probe failed: preStop, then the kubelet restarts the container.
        let (status, out, _) = run_hook("prestop", &socket, &[]);
        assert!(status.success(), "round {round}: {out}");
        assert_eq!(try_connect(inbound), Attempt::Refused);
        assert_eq!(proxy.get("/ready").status, 503);
        let (status, out, _) = run_hook("poststart", &socket, &[]);
        assert!(status.success(), "round {round}: {out}");
        assert!(out.contains("ok inbound side serving again"), "{out}");
        assert_eq!(proxy.get("/ready").status, 200);
        assert_eq!(proxy.metric("lameduck_inbound_quiesced"), 0.0);
        let mut stream = send_raw(inbound, &get("/after-restart"));
        let response = read_response(&mut stream).unwrap();
        assert_eq!(
            (response.status, response.header("connection")),
            (200, None),
            "round {round}"
        );
    }
    assert_eq!(
        backend
            .seen_paths()
            .iter()
            .filter(|path| *path == "/after-restart")
            .count(),
        2
    );
}

#[test]
fn hooks_work_as_any_user_without_capabilities_and_only_through_the_socket() {
    let (_backend, _dir, socket, proxy) = quiescable("uid");
    // Nothing on the admin port starts a drain: no such endpoint, and the shutdown endpoint
    // is disabled by default.
    for (method, path) in [
        ("POST", "/quiesce"),
        ("POST", "/drain"),
        ("POST", "/prestop"),
        ("GET", "/quiesce"),
        ("POST", "/shutdown"),
    ] {
        let response = support::http(proxy.admin, method, path, &[]);
        assert_eq!(response.status, 404, "{method} {path}");
        assert_eq!(proxy.get("/ready").status, 200, "{method} {path}");
    }
    // Nor anything on the proxy's own ports.
    let mut stream = send_raw(proxy.inbound[0], b"quiesce\n");
    stream
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let _ = stream.read(&mut [0u8; 64]);
    assert_eq!(proxy.get("/ready").status, 200);
    drop(stream);

    if Command::new("setpriv").arg("--help").output().is_err() {
        support::skip(
            "hooks_work_as_any_user_without_capabilities",
            "no setpriv (util-linux): the hook is not run as another user",
        );
        return;
    }
    // The app container's user: not the proxy's, no capabilities, nothing inherited.
    for uid in ["4321", "65534"] {
        let output = Command::new("setpriv")
            .args([
                &format!("--reuid={uid}"),
                &format!("--regid={uid}"),
                "--clear-groups",
                "--inh-caps=-all",
                "--bounding-set=-all",
                "--no-new-privs",
                BIN,
                "prestop",
                "--socket",
                &socket,
            ])
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "uid {uid}: {out}{output:?}");
        assert!(out.contains("ok inbound drained"), "uid {uid}: {out}");
        assert_eq!(proxy.get("/ready").status, 503);
        let (status, out, _) = run_hook("poststart", &socket, &[]);
        assert!(status.success() && out.contains("serving again"), "{out}");
    }
    proxy.logs.wait_for("naming the hook's user", |line| {
        line.contains("inbound quiesce requested") && line.contains("uid 4321")
    });
}

#[test]
fn prestop_runs_the_containers_own_hook_after_the_drain() {
    let (_backend, dir, socket, proxy) = quiescable("chain");
    let (status, out, _) = run_hook(
        "prestop",
        &socket,
        &["--", "sh", "-c", "echo their hook ran; exit 7"],
    );
    assert_eq!(status.code(), Some(7), "their status is the hook's: {out}");
    let drained = out.find("ok inbound drained").expect(&out);
    let theirs = out.find("their hook ran").expect(&out);
    assert!(drained < theirs, "ours first, then theirs: {out}");

    // A sleep action becomes --sleep.
    let (status, out, elapsed) = run_hook("prestop", &socket, &["--sleep", "400ms"]);
    assert!(status.success(), "{out}");
    assert!(elapsed >= Duration::from_millis(400), "{elapsed:?}");

    // poststart chains the same way.
    let (status, out, _) = run_hook("poststart", &socket, &["--", "sh", "-c", "echo started"]);
    assert!(status.success() && out.contains("started"), "{out}");
    assert_eq!(proxy.get("/ready").status, 200);

    // No proxy to ask: prestop fails (the kubelet records the event, with this output) but
    // still runs their hook; poststart never fails (the kubelet would kill the container).
    let missing = dir.join("nothing-here.sock").display().to_string();
    let (status, out, _) = run_hook("prestop", &missing, &[]);
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(out.contains("cannot reach the proxy"), "{out}");
    let (status, out, _) = run_hook("prestop", &missing, &["--", "true"]);
    assert!(status.success(), "{out}");
    let (status, out, _) = run_hook("poststart", &missing, &[]);
    assert!(status.success(), "{out}");
    let (status, out, _) = run_hook("prestop", &socket, &["--", "/no/such/program"]);
    assert_eq!(status.code(), Some(127), "{out}");
}

#[test]
fn bad_requests_on_the_control_socket_get_an_error_and_change_nothing() {
    let (_backend, dir, socket, proxy) = quiescable("bad");
    for request in [
        &b"shutdown\n"[..],
        b"\xff\xfe\n",
        &[b'q'; 10_000],
        b"GET / HTTP/1.1\r\n\r\n",
    ] {
        let mut stream = UnixStream::connect(&socket).unwrap();
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        let _ = stream.write_all(request);
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let mut answer = String::new();
        let _ = stream.read_to_string(&mut answer);
        assert!(answer.starts_with("error "), "{answer:?}");
        assert_eq!(proxy.get("/ready").status, 200);
    }
    // A client that says nothing is let go.
    let silent = UnixStream::connect(&socket).unwrap();
    drop(silent);
    assert_eq!(proxy.get("/ready").status, 200);

    // Configuration: a bad path is a configuration error; a file in the way cannot be bound.
    let (status, err, _) = support::run_to_exit(&["--drain-socket", ""], &[]);
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.contains("--drain-socket"), "{err}");
    let long = format!("/{}", "x".repeat(120));
    let (status, err, _) = support::run_to_exit(&[], &[("LAMEDUCK_DRAIN_SOCKET", long.as_ref())]);
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.contains("LAMEDUCK_DRAIN_SOCKET"), "{err}");
    let in_the_way = dir.join("file");
    std::fs::write(&in_the_way, "not a socket").unwrap();
    let (status, err, _) = support::run_to_exit(
        &[
            "--inbound",
            "127.0.0.1:0=127.0.0.1:9",
            "--admin",
            "127.0.0.1:0",
            "--drain-socket",
            &in_the_way.display().to_string(),
        ],
        &[],
    );
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("control socket"), "{err}");
    assert_eq!(
        std::fs::read_to_string(&in_the_way).unwrap(),
        "not a socket"
    );
}

/// A stale socket left by an earlier run of the proxy (its container restarted; the
/// `emptyDir` outlives it) is replaced.
#[test]
fn a_stale_socket_is_replaced() {
    let (_dir, socket) = shared_dir("stale");
    let stale = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    drop(stale);
    assert!(Path::new(&socket).exists());
    let backend = Backend::start();
    let proxy = Proxy::start(&[
        "--inbound",
        &backend.route("127.0.0.1:0"),
        "--drain-socket",
        &socket,
    ]);
    let (status, out, _) = run_hook("prestop", &socket, &[]);
    assert!(status.success(), "{out}");
    assert_eq!(proxy.get("/ready").status, 503);
}

/// `lameduck status`, as an operator runs it in the proxy's container: the phase, the inbound
/// quiesce and the grace period left, the open connections by direction and protocol, and the
/// oldest ones, which hold the drain up.
#[test]
fn status_tells_why_the_pod_does_not_go_away() {
    let echo = EchoServer::start();
    let backend = Backend::start();
    let (_dir, socket) = shared_dir("status");
    let mut proxy = Proxy::start(&[
        "--inbound",
        &format!("127.0.0.1:0={}/tcp", echo.addr),
        "--outbound",
        &backend.route("127.0.0.1:0"),
        "--drain-socket",
        &socket,
        "--shutdown-grace-period",
        "30s",
    ]);
    let status = |env_admin: bool| {
        let mut command = Command::new(BIN);
        command.arg("status");
        let admin = proxy.admin.to_string();
        if env_admin {
            command.env("LAMEDUCK_ADMIN", &admin);
        } else {
            command.args(["--admin", &admin]);
        }
        let output = command.output().unwrap();
        assert!(output.status.success(), "{output:?}");
        String::from_utf8(output.stdout).unwrap()
    };
    let out = status(false);
    assert!(out.contains("phase:         serving (ready)"), "{out}");
    assert!(out.contains("inbound:       serving"), "{out}");
    assert!(out.contains("shutdown:      not started"), "{out}");
    assert!(out.contains("connections:   0 open"), "{out}");

    let held = echo_connect(proxy.inbound[0]);
    let peer = held.local_addr().unwrap().to_string();
    let mut idle_out = send_raw(proxy.outbound[0], &get("/"));
    assert_eq!(read_response(&mut idle_out).unwrap().status, 200);
    let hook = spawn_hook("prestop", &socket, &[]);
    wait_until("/ready answers 503", PATIENCE, || {
        proxy.get("/ready").status == 503
    });
    let out = status(true);
    assert!(out.contains("(not ready)"), "{out}");
    assert!(out.contains("inbound:       quiesced"), "{out}");
    assert!(out.contains("of its grace period left"), "{out}");
    assert!(
        out.contains("connections:   2 open: inbound 1 (tcp 1), outbound 1 (http1 1)"),
        "{out}"
    );
    assert!(
        out.contains("oldest connections (these hold a drain up):"),
        "{out}"
    );
    let oldest = out
        .lines()
        .find(|line| line.contains(&peer))
        .unwrap_or_else(|| panic!("the held connection from {peer} is not listed:\n{out}"));
    assert!(oldest.trim_start().starts_with("inbound  tcp"), "{oldest}");

    drop(held);
    let (status_code, out_hook, _) = finish(hook, Instant::now());
    assert!(status_code.success(), "{out_hook}");
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));

    // No proxy: a clear error, status 1; a bad address: status 2.
    let output = Command::new(BIN)
        .args(["status", "--admin", &proxy.admin.to_string()])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("cannot ask the proxy"));
    let output = Command::new(BIN)
        .args(["status", "--admin", "nowhere"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
}

/// Legacy mode: the proxy container's own preStop (`prestop --wait-for-apps`) returns only
/// once every app container's holder (left by `poststart --hold`) is gone.
#[test]
fn wait_for_apps_returns_once_every_holder_is_gone() {
    let (_backend, _dir, socket, proxy) = quiescable("holders");
    let mut holders: Vec<Child> = (0..2)
        .map(|_| {
            Command::new(BIN)
                .args(["hold", "--socket", &socket])
                .spawn()
                .unwrap()
        })
        .collect();
    let holding = |count: usize| {
        wait_until("the holders hold", PATIENCE, || {
            proxy
                .logs
                .lines()
                .iter()
                .filter(|line| line.contains("holds the control socket"))
                .count()
                == count
        })
    };
    holding(2);
    let started = Instant::now();
    let mut hook = spawn_hook("prestop", &socket, &["--wait-for-apps"]);
    for (index, holder) in holders.iter_mut().enumerate() {
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            hook.try_wait().unwrap().is_none(),
            "returned with {} holders left",
            2 - index
        );
        let _ = holder.kill();
        let _ = holder.wait();
    }
    let (status, out, _) = finish(hook, started);
    assert!(status.success(), "{out}");
    assert!(out.contains("ok inbound drained"), "{out}");
    assert!(
        out.contains("ok every app container has exited (2 held the socket)"),
        "{out}"
    );
    // `poststart --hold` leaves a holder behind that outlives the hook.
    let (status, out, _) = run_hook("poststart", &socket, &["--hold"]);
    assert!(
        status.success() && out.contains("holds the proxy's socket"),
        "{out}"
    );
    holding(3);
}

/// The preStop quiesce's lame duck is adaptive when asked: it lasts while new inbound
/// connections keep arriving (each served, and asked to go away), `lameduck status` says why it
/// is still open (the last arrival, from where) and then why it ended, and the hook returns
/// once the source has been quiet for its window (20 of its gaps: 2 s at one connection every
/// 100 ms), well before the maximum.
#[test]
fn an_adaptive_quiesce_lasts_while_connections_arrive_and_status_says_why() {
    let backend = Backend::start();
    let (_dir, socket) = shared_dir("adaptive");
    let mut proxy = Proxy::start(&[
        "--inbound",
        &backend.route("127.0.0.1:0"),
        "--drain-socket",
        &socket,
        "--lame-duck-max=10s",
        "--lame-duck-quiet-window=700ms",
        "--lame-duck-min=0s",
        "--shutdown-grace-period=20s",
    ]);
    let inbound = proxy.inbound[0];
    let admin = proxy.admin.to_string();
    let status = move || {
        let output = Command::new(BIN)
            .args(["status", "--admin", &admin])
            .output()
            .unwrap();
        String::from_utf8(output.stdout).unwrap()
    };
    let started = Instant::now();
    let hook = spawn_hook("prestop", &socket, &[]);
    wait_until("/ready answers 503", PATIENCE, || {
        proxy.get("/ready").status == 503
    });
    // New connections for 2 s, each with a request that is served and told to go away.
    let mut open_seen = String::new();
    while started.elapsed() < Duration::from_secs(2) {
        let mut stream = send_raw(inbound, &get("/arriving"));
        let response = read_response(&mut stream).expect("served during the lame duck");
        assert_eq!(response.status, 200);
        assert_eq!(response.header("connection"), Some("close"));
        if open_seen.is_empty() && started.elapsed() > Duration::from_secs(1) {
            open_seen = status();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        open_seen.contains("lame duck:     open for")
            && open_seen.contains("1 of 1 sources of new connections still sending")
            && open_seen.contains("the last new connection")
            && open_seen.contains("from 127.0.0.1"),
        "{open_seen}"
    );
    let (code, out, took) = finish(hook, started);
    assert!(code.success(), "{out}");
    assert!(
        took >= Duration::from_secs(3) && took < Duration::from_secs(8),
        "the hook returned after {took:?}: arrivals for 2 s, then the source's window (2 s) \
         and not its 10 s maximum"
    );
    let ended = status();
    assert!(
        ended.contains("lame duck:     ended after")
            && ended.contains("every source of new connections quiet for its window"),
        "{ended}"
    );
    assert_eq!(
        proxy.metric("lameduck_lame_ducks_total{ended=\"quiet\"}"),
        1.0
    );
    assert!(proxy.metric("lameduck_lame_duck_seconds") >= 2.0);
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

/// A proxy with an adaptive lame duck whose inbound side a preStop hook has quiesced, with
/// nothing arriving: its lame duck ended at its minimum, and the inbound side drained at once.
fn quiesced_adaptively(test: &str) -> (Backend, PathBuf, Proxy) {
    let adaptive = [
        "--lame-duck-max=10s",
        "--lame-duck-min=500ms",
        "--shutdown-grace-period=30s",
    ];
    let (backend, dir, socket, proxy) = quiescable_with(test, &adaptive);
    let (code, out, _) = run_hook("prestop", &socket, &[]);
    assert!(code.success(), "{out}");
    (backend, dir, proxy)
}

/// A late client: its connection opens (the listener is there) and is reset before any answer,
/// within a round trip rather than a connect timeout; how long that took.
fn late_connection(inbound: std::net::SocketAddr, path: &str) -> Duration {
    let started = Instant::now();
    let mut stream = std::net::TcpStream::connect(inbound).expect("the listener is there");
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    // The reset may come before the request is written, or after.
    let answer = stream
        .write_all(&get(path))
        .and_then(|()| stream.read(&mut [0u8; 64]));
    assert!(
        matches!(&answer, Err(error) if matches!(error.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe)),
        "a late connection is reset, never served: {answer:?}"
    );
    started.elapsed()
}

/// Never a black hole: once an adaptive quiesce's lame duck is over, a connection that still
/// arrives is accepted and reset at once (never left to time out), counted in the metrics,
/// `lameduck status` and the log; and when the proxy is signalled (the app has exited), it does
/// not exit while late connections keep arriving, but once their source has been quiet for its
/// window; with none, it exits at once.
#[test]
fn late_connections_are_refused_at_once_and_the_proxy_lingers_while_they_come() {
    let (backend, _dir, mut proxy) = quiesced_adaptively("late");
    let inbound = proxy.inbound[0];
    proxy
        .logs
        .wait_for("the listener kept for late connections", |line| {
            line.contains("late connections are refused at once")
        });
    let late = |path: &str| late_connection(inbound, path);
    let took = late("/late");
    assert!(took < Duration::from_secs(1), "refused after {took:?}");
    assert!(backend.seen_paths().iter().all(|path| path != "/late"));
    assert_eq!(
        proxy.metric("lameduck_late_connections_total{direction=\"inbound\",fate=\"refused\"}"),
        1.0
    );
    let status = proxy.status();
    assert!(
        status.contains("late:          1 connections after the lame duck: 0 handed off to the Service, 1 refused at once")
            && status.contains("from 127.0.0.1"),
        "{status}"
    );
    proxy
        .logs
        .wait_for("the first late connection in the log", |line| {
            line.contains("late connection: the lame duck is over")
                && line.contains("\"to\":\"refused\"")
        });
    // Late connections keep coming, one every 100 ms; a second into them, the proxy's SIGTERM
    // (the app has exited): it stays while they come (its pod's address answers them), then
    // exits once they have stopped, two seconds after.
    let started = Instant::now();
    let mut signalled = None;
    let mut refused = 0;
    while started.elapsed() < Duration::from_secs(4) {
        late("/still-late");
        refused += 1;
        if signalled.is_none() && started.elapsed() >= Duration::from_secs(1) {
            proxy.signal(libc::SIGTERM);
            signalled = Some(Instant::now());
        }
        if signalled.is_some() {
            assert!(
                proxy.try_wait_exit(Duration::ZERO).is_none(),
                "exited while late connections came"
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let stopped = Instant::now();
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    let lingered = stopped.elapsed();
    assert!(
        lingered < Duration::from_secs(15),
        "lingered {lingered:?} after the last late connection"
    );
    let summary = proxy
        .logs
        .wait_event("late connections after the lame duck (handed off or refused)");
    assert_eq!(summary["fields"]["late_connections"], 1 + refused);
}

const LINGERING: &str = "lingering: new connections may still come; the pod's address answers them (handed off to the Service, or refused at once) until they stop";

/// A lame duck cut short by its maximum while a source still sent new connections: the proxy,
/// signalled once the app has exited, lingers for that source (the pod's address answers)
/// although no late connection has come yet, as when the cluster's traffic pauses across the
/// drain; the lame duck's book is the evidence, not only the late connections. Before, it
/// exited at once and every client still routed here met a closed port.
#[test]
fn a_lame_duck_cut_short_lingers_for_its_sources_before_any_late_connection() {
    let (_backend, _dir, socket, mut proxy) = quiescable_with(
        "cut-short",
        &[
            "--lame-duck-max=3s",
            "--lame-duck-min=500ms",
            "--shutdown-grace-period=8s",
        ],
    );
    let inbound = proxy.inbound[0];
    let started = Instant::now();
    let hook = spawn_hook("prestop", &socket, &[]);
    wait_until("/ready answers 503", PATIENCE, || {
        proxy.get("/ready").status == 503
    });
    // Four new connections 400 ms apart: the last at least 1.2 s into the lame duck, its mean
    // gap at least 300 ms, its window (20 of them) at least 6 s, past the 3 s maximum; then
    // nothing, across the drain.
    for _ in 0..4 {
        let mut stream = send_raw(inbound, &get("/arriving"));
        let response = read_response(&mut stream).expect("served during the lame duck");
        assert_eq!(response.status, 200);
        std::thread::sleep(Duration::from_millis(400));
    }
    let (code, out, _) = finish(hook, started);
    assert!(code.success(), "{out}");
    assert_eq!(
        proxy.metric("lameduck_lame_ducks_total{ended=\"max\"}"),
        1.0
    );
    proxy.signal(libc::SIGTERM);
    let lingering = proxy.logs.wait_event(LINGERING);
    assert_eq!(lingering["fields"]["late_connections"], 0, "{lingering}");
    assert!(
        lingering["fields"]["still"]
            .as_str()
            .is_some_and(|still| still.starts_with("127.0.0.1 sent")),
        "{lingering}"
    );
    assert!(
        proxy.try_wait_exit(Duration::ZERO).is_none(),
        "exited while the lame duck's source may still send"
    );
    // A client still routed here: its connection is answered (reset at once), not refused by a
    // closed port.
    let took = late_connection(inbound, "/late");
    assert!(took < Duration::from_secs(1), "refused after {took:?}");
    // It exits once the source has been quiet for its window.
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    let summary = proxy
        .logs
        .wait_event("late connections after the lame duck (handed off or refused)");
    assert_eq!(summary["fields"]["late_connections"], 1, "{summary}");
}

/// The linger after a quiesce ends within the grace period counted from the quiesce (the start
/// of the pod's termination), not from the proxy's own SIGTERM: the kubelet's deadline (the
/// grace period, the app's own budget and 5 s) must never find the proxy still lingering, however
/// long the app took to exit, even while late connections keep coming.
#[test]
fn the_linger_after_a_quiesce_ends_within_the_grace_period_from_the_quiesce() {
    let (_backend, _dir, socket, mut proxy) = quiescable_with(
        "linger-bound",
        &[
            "--lame-duck-max=1s",
            "--lame-duck-min=500ms",
            "--shutdown-grace-period=6s",
        ],
    );
    let inbound = proxy.inbound[0];
    let quiesced = Instant::now();
    let (code, out, _) = run_hook("prestop", &socket, &[]);
    assert!(code.success(), "{out}");
    // Late connections every 100 ms from here on; the app takes its time to exit, then the
    // proxy's SIGTERM 5 s after the quiesce. Counted from the SIGTERM, its grace period would
    // end 11 s after the quiesce; counted from the quiesce, at 6 s.
    let mut signalled = false;
    let exited = loop {
        if !signalled && quiesced.elapsed() >= Duration::from_secs(5) {
            proxy.signal(libc::SIGTERM);
            signalled = true;
        }
        if let Some(status) = proxy.try_wait_exit(Duration::ZERO) {
            break (status, quiesced.elapsed());
        }
        assert!(
            quiesced.elapsed() < PATIENCE * 2,
            "still lingering {:?} after the quiesce",
            quiesced.elapsed()
        );
        // The listener may close between the connect and the reset: either is no black hole.
        if let Ok(mut stream) = std::net::TcpStream::connect(inbound) {
            let _ = stream.write_all(&get("/late"));
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(signalled, "exited before its SIGTERM");
    assert_eq!(exited.0.code(), Some(0));
    assert!(
        exited.1 >= Duration::from_secs(6) && exited.1 < Duration::from_secs(9),
        "exited {:?} after the quiesce: its grace period (6 s) counts from there",
        exited.1
    );
}

/// Without late connections the proxy's own SIGTERM after the quiesce ends it at once: no
/// linger for nothing.
#[test]
fn without_late_connections_the_proxy_exits_at_once() {
    let (_backend, _dir, mut proxy) = quiesced_adaptively("no-late");
    let signalled = Instant::now();
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    assert!(
        signalled.elapsed() < Duration::from_secs(1),
        "exited {:?} after its SIGTERM",
        signalled.elapsed()
    );
    assert!(
        proxy
            .logs
            .events("late connections after the lame duck (handed off or refused)")
            .is_empty()
    );
}
