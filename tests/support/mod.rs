//! Shared helpers for the integration tests: the real `lameduck` binary as a child process,
//! test backends on 127.0.0.1:0, a tiny HTTP/1.1 client for the admin server, and bounded waits.
//!
//! Every wait is bounded so that a broken drain fails a test instead of hanging CI.

#![allow(dead_code)]

pub mod backend;
pub mod h2raw;
pub mod kubectl;
pub mod netns;
pub mod process;
pub mod scripted;

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_lameduck");

/// How long any single wait may take before the test fails. Generous: the machine is shared.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// Variables that would change the proxy's configuration if inherited from the environment.
const CONFIG_VARS: &[&str] = &[
    "LAMEDUCK_INBOUND",
    "LAMEDUCK_OUTBOUND",
    "LAMEDUCK_ADMIN",
    "LAMEDUCK_SHUTDOWN_GRACE_PERIOD",
    "LAMEDUCK_LAME_DUCK_PERIOD",
    "LAMEDUCK_CLOSE_SPREAD_WINDOW",
    "LAMEDUCK_OUTBOUND_SHUTDOWN",
    "LAMEDUCK_SHUTDOWN_ENDPOINT",
    "LAMEDUCK_CONNECT_TIMEOUT",
    "LAMEDUCK_DRAIN_SOCKET",
    "LAMEDUCK_HTTP2_IDLE_TIMEOUT",
    "LAMEDUCK_TCP_HALF_CLOSE_TIMEOUT",
    "LAMEDUCK_TCP_IDLE_TIMEOUT",
    "LAMEDUCK_LOG",
    "LAMEDUCK_LOG_FORMAT",
    "RUST_LOG",
];

/// A command for the binary with a clean configuration environment.
pub fn command() -> Command {
    let mut cmd = Command::new(BIN);
    for var in CONFIG_VARS {
        cmd.env_remove(var);
    }
    cmd
}

/// A command for the binary whose process may open at most `limit` file descriptors.
pub fn command_with_fd_limit(limit: u64) -> Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = command();
    // SAFETY: setrlimit is async-signal-safe and touches only the child.
    unsafe {
        cmd.pre_exec(move || {
            let limit = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// Log lines collected from a child's stderr; the flag is set at its end (the child exited and
/// every line it wrote is in).
#[derive(Clone, Default)]
pub struct Logs(Arc<(Mutex<Vec<String>>, Condvar)>, Arc<AtomicBool>);

impl Logs {
    fn collect(self, stderr: impl Read + Send + 'static) {
        thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let (lines, changed) = &*self.0;
                lines.lock().unwrap().push(line);
                changed.notify_all();
            }
            self.1.store(true, Ordering::SeqCst);
            let (lines, changed) = &*self.0;
            let _guard = lines.lock().unwrap();
            changed.notify_all();
        });
    }

    /// Waits (at most `limit`) until the child's stderr has ended: after its exit, the lines it
    /// wrote last are read by then.
    fn wait_ended(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let (lines, changed) = &*self.0;
        let mut guard = lines.lock().unwrap();
        while !self.1.load(Ordering::SeqCst) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            guard = changed.wait_timeout(guard, left).unwrap().0;
        }
    }

    pub fn lines(&self) -> Vec<String> {
        self.0.0.lock().unwrap().clone()
    }

    pub fn text(&self) -> String {
        self.lines().join("\n")
    }

    /// Waits for a line that satisfies `pred`, and returns it.
    pub fn wait_for(&self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + PATIENCE;
        let (lines, changed) = &*self.0;
        let mut guard = lines.lock().unwrap();
        loop {
            if let Some(line) = guard.iter().find(|line| pred(line)) {
                return line.clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "no log line {what} within {PATIENCE:?}; logs:\n{}",
                guard.join("\n")
            );
            guard = changed.wait_timeout(guard, left).unwrap().0;
        }
    }

    /// The first JSON log event whose message is `message`, waited for (it may still be in the
    /// pipe when the test sees what caused it).
    pub fn wait_event(&self, message: &str) -> serde_json::Value {
        let needle = format!("\"message\":\"{message}\"");
        let line = self.wait_for(message, |line| line.contains(&needle));
        serde_json::from_str(&line).unwrap()
    }

    /// JSON log events whose message is `message`.
    pub fn events(&self, message: &str) -> Vec<serde_json::Value> {
        self.lines()
            .iter()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|event| event["fields"]["message"] == message)
            .collect()
    }
}

/// The proxy under test: a running `lameduck` process and the addresses it bound.
pub struct Proxy {
    pub child: Child,
    pub logs: Logs,
    pub admin: SocketAddr,
    pub inbound: Vec<SocketAddr>,
    pub outbound: Vec<SocketAddr>,
    status: Option<ExitStatus>,
}

impl Proxy {
    /// Starts the proxy with `args` (plus an admin server on 127.0.0.1:0 unless `--admin` is
    /// given, and JSON logs) and waits until it serves.
    pub fn start(args: &[&str]) -> Proxy {
        let mut cmd = command();
        Proxy::start_command(&mut cmd, args)
    }

    /// Like [`Proxy::start`], for a prepared command (extra environment, rlimits, a wrapper).
    pub fn start_command(cmd: &mut Command, args: &[&str]) -> Proxy {
        cmd.args(args).arg("--log-format=json");
        if std::env::var_os(THROUGH_HYPER).is_some()
            && !args.iter().any(|arg| arg.starts_with("--http1-fast-lane"))
        {
            cmd.arg("--http1-fast-lane=false");
        }
        if !args.iter().any(|arg| arg.starts_with("--admin")) {
            cmd.arg("--admin=127.0.0.1:0");
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn lameduck");
        let logs = Logs::default();
        logs.clone()
            .collect(child.stderr.take().expect("stderr is piped"));
        logs.wait_for("saying the proxy serves", |line| {
            line.contains("\"message\":\"serving\"")
                || line.contains("panicked")
                || line.contains("\"level\":\"ERROR\"")
        });
        let admin_event = logs.events("admin server listening");
        let admin = admin_event
            .first()
            .unwrap_or_else(|| panic!("the proxy did not start:\n{}", logs.text()))["fields"]["listen"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        let mut inbound = Vec::new();
        let mut outbound = Vec::new();
        for event in logs.events("listening") {
            let addr: SocketAddr = event["fields"]["listen"].as_str().unwrap().parse().unwrap();
            match event["fields"]["direction"].as_str().unwrap() {
                "inbound" => inbound.push(addr),
                _ => outbound.push(addr),
            }
        }
        Proxy {
            child,
            logs,
            admin,
            inbound,
            outbound,
            status: None,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, signal: i32) {
        signal_pid(self.pid(), signal);
    }

    /// Waits for the process to exit; fails the test after `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        match self.try_wait_exit(limit) {
            Some(status) => status,
            None => panic!(
                "the proxy did not exit within {limit:?}; logs:\n{}",
                self.logs.text()
            ),
        }
    }

    /// Waits up to `limit` for the process to exit.
    pub fn try_wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        if let Some(status) = self.status {
            return Some(status);
        }
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                self.status = Some(status);
                // Its last lines may still be in the pipe (bounded: a process it left behind
                // could hold the pipe open).
                self.logs.wait_ended(Duration::from_secs(2));
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            thread::sleep(Duration::from_millis(1));
        }
    }

    pub fn is_running(&mut self) -> bool {
        self.try_wait_exit(Duration::ZERO).is_none()
    }

    pub fn get(&self, path: &str) -> HttpResponse {
        http(self.admin, "GET", path, &[])
    }

    pub fn post(&self, path: &str) -> HttpResponse {
        http(self.admin, "POST", path, &[])
    }

    /// The open proxy connections, as `/connections` lists them.
    pub fn open_connections(&self) -> Vec<serde_json::Value> {
        let body = self.get("/connections").body;
        let json: serde_json::Value = serde_json::from_str(&body).unwrap();
        json["connections"].as_array().unwrap().clone()
    }

    /// Waits (boundedly) until `/connections` lists exactly `count` connections.
    pub fn wait_open_connections(&self, count: usize) {
        wait_until(&format!("{count} open connections"), PATIENCE, || {
            self.open_connections().len() == count
        });
    }

    /// The value of a metric sample, by its full line prefix (name and labels).
    /// What `lameduck status` prints about this proxy.
    pub fn status(&self) -> String {
        let output = Command::new(BIN)
            .args(["status", "--admin", &self.admin.to_string()])
            .output()
            .unwrap();
        String::from_utf8(output.stdout).unwrap()
    }

    pub fn metric(&self, sample: &str) -> f64 {
        let body = self.get("/metrics").body;
        body.lines()
            .find_map(|line| {
                line.strip_prefix(sample)
                    .and_then(|rest| rest.strip_prefix(' '))
            })
            .unwrap_or_else(|| panic!("no sample {sample} in:\n{body}"))
            .trim()
            .parse()
            .unwrap()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub fn signal_pid(pid: i32, signal: i32) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    let rc = unsafe { libc::kill(pid, signal) };
    assert_eq!(
        rc,
        0,
        "kill({pid}, {signal}) failed: {}",
        std::io::Error::last_os_error()
    );
}

/// Waits for `child` to exit; fails the test (killing it) after `limit`.
pub fn wait_child(child: &mut Child, limit: Duration) -> ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the process did not exit within {limit:?}");
        }
        thread::sleep(Duration::from_millis(1));
    }
}

/// Runs the binary to completion with `args` and extra environment; returns status, stderr and
/// how long it ran.
pub fn run_to_exit(
    args: &[&str],
    env: &[(&str, &std::ffi::OsStr)],
) -> (ExitStatus, String, Duration) {
    let mut cmd = command();
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (name, value) in env {
        cmd.env(name, value);
    }
    let started = Instant::now();
    let mut child = cmd.spawn().expect("spawn lameduck");
    let status = wait_child(&mut child, PATIENCE);
    let elapsed = started.elapsed();
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let mut stdout = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    (status, stderr + &stdout, elapsed)
}

/// An admin response.
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().skip(1).find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.trim()
                .eq_ignore_ascii_case(name)
                .then(|| value.trim().to_string())
        })
    }
}

/// One HTTP/1.1 request on a fresh connection; `headers` may override `Host`.
pub fn http(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)]) -> HttpResponse {
    let stream =
        TcpStream::connect(addr).unwrap_or_else(|error| panic!("connect to admin {addr}: {error}"));
    http_on(stream, method, path, headers)
}

/// One HTTP/1.1 request on `stream`, which is closed afterwards.
pub fn http_on(
    mut stream: TcpStream,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> HttpResponse {
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut request = format!("{method} {path} HTTP/1.1\r\n");
    if !headers
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case("host"))
    {
        request.push_str("Host: localhost\r\n");
    }
    for (name, value) in headers {
        if !value.is_empty() {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
    }
    request.push_str("Connection: close\r\nContent-Length: 0\r\n\r\n");
    stream.write_all(request.as_bytes()).unwrap();
    let mut raw = Vec::new();
    stream
        .read_to_end(&mut raw)
        .expect("read the admin response");
    parse_response(&raw)
}

pub fn parse_response(raw: &[u8]) -> HttpResponse {
    let text = String::from_utf8_lossy(raw).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("not an HTTP response: {text:?}"));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    HttpResponse {
        status,
        head: head.to_string(),
        body: body.to_string(),
    }
}

/// A backend that echoes every byte back and, on the client's FIN, finishes its reply and
/// closes. Counts the connections it holds open.
pub struct EchoServer {
    pub addr: SocketAddr,
    pub open: Arc<AtomicUsize>,
}

impl EchoServer {
    pub fn start() -> EchoServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let open = Arc::new(AtomicUsize::new(0));
        let counter = open.clone();
        thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let counter = counter.clone();
                counter.fetch_add(1, Ordering::SeqCst);
                thread::spawn(move || {
                    let mut buf = [0u8; 16 * 1024];
                    loop {
                        match stream.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                if stream.write_all(&buf[..n]).is_err() {
                                    break;
                                }
                            }
                        }
                    }
                    drop(stream);
                    counter.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        EchoServer { addr, open }
    }

    pub fn route(&self, listen: &str) -> String {
        format!("{listen}={}", self.addr)
    }
}

/// Connects and proves the path works with one echo round trip.
pub fn echo_connect(addr: SocketAddr) -> TcpStream {
    let mut stream =
        TcpStream::connect(addr).unwrap_or_else(|error| panic!("connect {addr}: {error}"));
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    echo_round_trip(&mut stream, b"hello");
    stream
}

/// Sends `payload` and reads the same bytes back.
pub fn echo_round_trip(stream: &mut TcpStream, payload: &[u8]) {
    stream.write_all(payload).expect("write through the proxy");
    let mut back = vec![0u8; payload.len()];
    stream
        .read_exact(&mut back)
        .expect("read the echo through the proxy");
    assert_eq!(back, payload, "the echo came back changed");
}

/// What a connection attempt ran into.
#[derive(Debug, PartialEq, Eq)]
pub enum Attempt {
    Connected,
    Refused,
    Other(ErrorKind),
}

pub fn try_connect(addr: SocketAddr) -> Attempt {
    match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
        Ok(_) => Attempt::Connected,
        Err(error) if error.kind() == ErrorKind::ConnectionRefused => Attempt::Refused,
        Err(error) => Attempt::Other(error.kind()),
    }
}

/// Tries to connect to `addr` until an attempt is refused; returns when (from this call) the
/// first refused attempt *began*, or fails after `limit`. Its start, not its end, says when the
/// listener stopped taking connections: an attempt whose SYN met the closing listener's SYN
/// filter (src/net.rs, refuse_new_handshakes) is refused only at its retransmission, a second
/// later, though the listener had stopped accepting when it began.
pub fn refusing_from(addr: SocketAddr, limit: Duration) -> Duration {
    let started = Instant::now();
    loop {
        let began = started.elapsed();
        let attempt = Instant::now();
        if try_connect(addr) == Attempt::Refused {
            let took = attempt.elapsed();
            if took >= Duration::from_millis(500) {
                eprintln!(
                    "the first refused attempt began {began:?} in and took {took:?}: its SYN met the closing listener's filter and was refused on its retransmission"
                );
            }
            return began;
        }
        assert!(
            started.elapsed() < limit,
            "{addr}: no connection refused within {limit:?}"
        );
        thread::sleep(Duration::from_millis(1));
    }
}

/// Retries `attempt` until it returns true; returns how long that took, or fails after `limit`.
pub fn wait_until(what: &str, limit: Duration, mut attempt: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    loop {
        if attempt() {
            return started.elapsed();
        }
        assert!(started.elapsed() < limit, "{what}: not within {limit:?}");
        thread::sleep(Duration::from_millis(1));
    }
}

/// Reads until EOF or error; tells which one the peer sent.
#[derive(Debug, PartialEq, Eq)]
pub enum Close {
    /// read() returned 0: a FIN.
    Eof,
    /// ECONNRESET: an RST.
    Reset,
    /// Still open when the wait ended.
    Open,
}

pub fn wait_close(stream: &mut TcpStream, limit: Duration) -> (Close, Duration) {
    let started = Instant::now();
    stream
        .set_read_timeout(Some(Duration::from_millis(20)))
        .unwrap();
    let mut buf = [0u8; 64 * 1024];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return (Close::Eof, started.elapsed()),
            Ok(_) => {}
            Err(error) if error.kind() == ErrorKind::ConnectionReset => {
                return (Close::Reset, started.elapsed());
            }
            Err(error) if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(error) => panic!("unexpected read error {error}"),
        }
        if started.elapsed() >= limit {
            return (Close::Open, started.elapsed());
        }
    }
}

/// Half-closes the write side.
pub fn shutdown_write(stream: &TcpStream) {
    stream.shutdown(Shutdown::Write).unwrap();
}

/// Closes with RST (SO_LINGER 0).
pub fn reset_close(stream: TcpStream) {
    socket2::SockRef::from(&stream)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(stream);
}

/// Open file descriptors of a process.
pub fn fd_count(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| dir.count())
        .unwrap_or(0)
}

/// A port that nobody listens on: connecting to it is refused for as long as the guard lives.
/// The port stays bound (a socket that never listens), so that no other test's listener can
/// take it meanwhile (a port merely released could become a silent target's).
pub struct ClosedPort {
    _held: socket2::Socket,
    pub addr: SocketAddr,
}

impl std::fmt::Display for ClosedPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.addr.fmt(f)
    }
}

pub fn closed_port() -> ClosedPort {
    let held = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    held.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .unwrap();
    let addr = held.local_addr().unwrap().as_socket().unwrap();
    ClosedPort { _held: held, addr }
}

/// A port on 127.0.0.1 for another process to listen on (HAProxy, the Python peers), which
/// binds it itself a while later. Drawn from 10000-19999, below the kernel's ephemeral range
/// (where every test's outgoing connections and `:0` listeners take their ports, thousands a
/// second in the load tests) and below the hand-off's dial ports: a port from that range, merely
/// released, could become a connection's source port before the process binds it, and the
/// process would fail to start. Free when drawn.
pub fn port_for_another_process() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    for attempt in 0u64..1000 {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(attempt);
        let port = 10_000 + (hasher.finish() % 10_000) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in 10000-19999");
}

/// A target that accepts and then neither reads, writes nor closes (keep the listener).
pub fn silent_target() -> (TcpListener, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    (listener, addr)
}

/// A target that never answers: a listener whose accept queue is full and never drained, so
/// that further SYNs go unanswered (a connect to it times out). Keep the fillers while it is used.
pub fn blackhole() -> (socket2::Socket, SocketAddr, Vec<TcpStream>) {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    socket.bind(&any.into()).unwrap();
    socket.listen(0).unwrap();
    let addr = socket.local_addr().unwrap().as_socket().unwrap();
    let fillers = (0..4)
        .filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok())
        .collect();
    (socket, addr, fillers)
}

/// Says on the test's own stderr (not captured, so CI's log shows it) that `test` did not run
/// and why; the caller then returns. A test that cannot run here is skipped, never passed
/// silently.
pub fn skip(test: &str, why: &str) {
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

/// Runs `lameduck inject ARGS` on `input`; returns (status code, stdout, stderr).
pub fn inject(input: &str, args: &[&str]) -> (i32, String, String) {
    let mut child = Command::new(BIN)
        .arg("inject")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

/// Set in a test binary run again by [`run_again_through_hyper`]: every proxy it starts has its
/// HTTP/1 fast lane off (unless the test sets `--http1-fast-lane` itself).
const THROUGH_HYPER: &str = "LAMEDUCK_TEST_THROUGH_HYPER";

/// Runs this test binary's other tests again, every proxy with its HTTP/1 fast lane off, so that
/// the file's promises are checked through both HTTP/1 engines (docs/http.md, "Two engines, one
/// policy"). `this_test` is the calling test's name, left out of the second run.
pub fn run_again_through_hyper(this_test: &str) {
    if std::env::var_os(THROUGH_HYPER).is_some() {
        return;
    }
    let binary = std::env::current_exe().expect("the test binary's path");
    let output = Command::new(binary)
        .env(THROUGH_HYPER, "1")
        .args(["--skip", this_test, "--test-threads", "4"])
        .output()
        .expect("run the test binary again");
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    let stdout = text(&output.stdout);
    let summary = stdout
        .lines()
        .filter(|line| line.starts_with("test result:"))
        .collect::<Vec<_>>()
        .join("; ");
    let _ = writeln!(std::io::stderr(), "through hyper: {summary}");
    assert!(
        output.status.success(),
        "the tests failed with the fast lane off:\n{stdout}\n{}",
        text(&output.stderr)
    );
    assert!(
        summary.contains(" passed;") && !summary.contains(" 0 passed;"),
        "the second run ran no test: {summary}"
    );
}
