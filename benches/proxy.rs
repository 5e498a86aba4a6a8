//! Side-by-side benchmark of lameduck against no proxy, HAProxy and nginx.
//!
//! `cargo bench --bench proxy` runs every workload with every installed subject, several
//! repetitions each, and writes a markdown table and JSON to `target/bench/`.
//! `cargo bench --bench proxy -- --quick` runs about a second per workload, lameduck and no
//! proxy only (what `.ci/run` does, so the harness cannot rot).
//! `-- --only TEXT` runs only the workloads whose name contains TEXT (for example
//! `--only "http1 keep-alive"`), to iterate on one of them; `-- --reps N` sets the repetitions
//! (the fixed-rate rows run twice as many);
//! `-- --target-only` starts the target alone and prints its addresses (to profile by hand).
//!
//! Method: the proxy under test is pinned to CPU 0; the load generator (wrk, h2load, or this
//! harness's own clients) and the target server are pinned to CPU 1. Proxy CPU time comes from
//! /proc/PID/stat. Repetitions go round the subjects (rather than one subject's repetitions in a
//! row), so that the shared machine's noisy spells spread over all of them. Peers that are not
//! installed are reported as skipped, never faked.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

#[path = "../tests/support/process.rs"]
#[allow(dead_code)]
mod process;
use process::{cpu_time, rss_kib};

const BIN: &str = env!("CARGO_BIN_EXE_lameduck");
const PROXY_CPU: usize = 0;
const LOAD_CPU: usize = 1;
/// Debian's nginx loads its stream module from here (package libnginx-mod-stream).
const NGINX_STREAM_MODULE: &str = "/usr/lib/nginx/modules/ngx_stream_module.so";

#[derive(Clone, Copy)]
struct Plan {
    quick: bool,
    /// Only the workloads whose name contains this (`--only TEXT`).
    only: Option<&'static str>,
    seconds: u64,
    reps: usize,
    idle_connections: usize,
}

/// One measured number.
#[derive(Clone, Debug)]
struct Sample {
    workload: &'static str,
    subject: &'static str,
    metric: &'static str,
    unit: &'static str,
    /// Higher is better (throughput) or lower is better (latency, CPU, memory, time).
    higher_is_better: bool,
    values: Vec<f64>,
}

impl Plan {
    fn wants(&self, workload: &str) -> bool {
        self.only.is_none_or(|only| workload.contains(only))
    }
}

impl Sample {
    fn median(&self) -> f64 {
        let mut sorted = self.values.clone();
        sorted.sort_by(|a, b| a.total_cmp(b));
        sorted[sorted.len() / 2]
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Subject {
    Direct,
    Lameduck,
    HaproxyHttp,
    HaproxyTcp,
    NginxHttp,
    NginxStream,
}

impl Subject {
    fn name(self) -> &'static str {
        match self {
            Subject::Direct => "no proxy",
            Subject::Lameduck => "lameduck",
            Subject::HaproxyHttp => "haproxy http",
            Subject::HaproxyTcp => "haproxy tcp",
            Subject::NginxHttp => "nginx http",
            Subject::NginxStream => "nginx stream",
        }
    }

    fn program(self) -> Option<&'static str> {
        match self {
            Subject::HaproxyHttp | Subject::HaproxyTcp => Some("haproxy"),
            Subject::NginxHttp | Subject::NginxStream => Some("nginx"),
            _ => None,
        }
    }
}

const HTTP_SUBJECTS: [Subject; 4] = [
    Subject::Direct,
    Subject::Lameduck,
    Subject::HaproxyHttp,
    Subject::NginxHttp,
];
const TCP_SUBJECTS: [Subject; 4] = [
    Subject::Direct,
    Subject::Lameduck,
    Subject::HaproxyTcp,
    Subject::NginxStream,
];

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|arg| arg == "--quick");
    let only = args.iter().position(|arg| arg == "--only").map(|at| {
        &*args
            .get(at + 1)
            .expect("--only needs a workload name")
            .clone()
            .leak()
    });
    // The harness holds both ends of every idle connection for the TCP rows (client, and the
    // target's side): four descriptors per connection with room to spare must fit the limit.
    let fd_limit = raise_fd_limit(65_536);
    let mut plan = match quick {
        true => Plan {
            quick,
            only,
            seconds: 1,
            reps: 1,
            idle_connections: 500,
        },
        false => Plan {
            quick,
            only,
            seconds: 5,
            reps: 3,
            idle_connections: 10_000,
        },
    };
    if let Some(reps) = args.iter().position(|arg| arg == "--reps") {
        plan.reps = args
            .get(reps + 1)
            .and_then(|n| n.parse().ok())
            .expect("--reps N");
    }
    plan.idle_connections = plan.idle_connections.min(fd_limit as usize / 5);
    let out_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
    std::fs::create_dir_all(&out_dir).unwrap();
    let target = Target::start();
    if args.iter().any(|arg| arg == "--target-only") {
        // For profiling one proxy by hand: the same target, until interrupted.
        println!(
            "target: http {} sink {} hold {}",
            target.http, target.sink, target.hold
        );
        loop {
            thread::park();
        }
    }
    let mut samples = Vec::new();
    let mut skipped = Vec::new();
    let mut subjects = |all: [Subject; 4]| -> Vec<Subject> {
        all.into_iter()
            .filter(|subject| !plan.quick || matches!(subject, Subject::Direct | Subject::Lameduck))
            .filter(|subject| match subject.program() {
                Some(program) if !installed(program) => {
                    skipped.push(format!("{} (not installed)", subject.name()));
                    false
                }
                _ if *subject == Subject::NginxStream
                    && !Path::new(NGINX_STREAM_MODULE).exists() =>
                {
                    skipped.push("nginx stream (libnginx-mod-stream not installed)".into());
                    false
                }
                _ => true,
            })
            .collect()
    };
    let http_subjects = subjects(HTTP_SUBJECTS);
    let tcp_subjects = subjects(TCP_SUBJECTS);
    skipped.dedup();

    // Start-up and shutdown first, while the harness holds no connections of earlier workloads
    // (a full run left it holding thousands, and start-up then measured 85 ms instead of 4).
    if plan.wants("lifecycle") {
        samples.extend(lifecycle(&plan, &target, &out_dir));
    }
    if plan.wants(HANDOFF) {
        samples.extend(handoff(&plan, &target, &out_dir));
    }
    // Memory is measured first on each fresh process, before any load has grown its pools.
    // Then each repetition goes round every subject of the group, all of them running (idle
    // while another is measured), so that a noisy minute on this shared machine falls on every
    // subject alike instead of on whichever ran then.
    let once = Plan { reps: 1, ..plan };
    let mut running = Vec::new();
    for &subject in &http_subjects {
        if plan.wants(PACED_MEMORY) {
            // On a process of its own: holes left by the other row's connections would take
            // this row's.
            let mut proxy = Running::start(subject, &target, false, &out_dir);
            samples.extend(idle_memory(&plan, subject, &proxy, Opening::Paced));
            proxy.stop();
        }
        let proxy = Running::start(subject, &target, false, &out_dir);
        if plan.wants("memory, idle http1 keep-alive") {
            samples.extend(idle_memory(&plan, subject, &proxy, Opening::Http));
        }
        running.push((subject, proxy));
    }
    for every in rounds(&plan) {
        for (subject, proxy) in &running {
            let mut round = Vec::new();
            if every && installed("wrk") && plan.wants("http1 keep-alive") {
                round.extend(h1_keepalive(&once, *subject, proxy));
            }
            if every && installed("wrk") && plan.wants("http1 new connection per request") {
                round.extend(h1_new_connections(&once, *subject, proxy));
            }
            if installed("h2load") && plan.wants("http1 keep-alive, 10,000 req/s") {
                round.extend(h1_fixed_rate(&once, *subject, proxy, &out_dir));
            }
            if every && installed("h2load") && plan.wants("http2 multiplexed") {
                round.extend(h2_multiplexed(&once, *subject, proxy));
            }
            merge(&mut samples, round);
        }
    }
    for (_, mut proxy) in running.drain(..) {
        proxy.stop();
    }
    // The same keep-alive workload against nginx as the app, with a browser's or an SDK's
    // request headers: what a sidecar forwards in a real pod.
    let nginx_flat_out = plan.wants("http1 keep-alive, nginx backend") && installed("wrk");
    let nginx_fixed_rate =
        plan.wants("http1 keep-alive, nginx backend, 10,000 req/s") && installed("h2load");
    if nginx_flat_out || nginx_fixed_rate {
        if installed("nginx") {
            let mut origin = NginxOrigin::start(&out_dir);
            for &subject in &http_subjects {
                running.push((
                    subject,
                    Running::start_to(subject, origin.addr, false, &out_dir),
                ));
            }
            for every in rounds(&plan) {
                for (subject, proxy) in &running {
                    let mut round = Vec::new();
                    if every && nginx_flat_out {
                        round.extend(h1_nginx_backend(&once, *subject, proxy));
                    }
                    if nginx_fixed_rate {
                        round.extend(h1_nginx_backend_fixed_rate(
                            &once, *subject, proxy, &out_dir,
                        ));
                    }
                    merge(&mut samples, round);
                }
            }
            for (_, mut proxy) in running.drain(..) {
                proxy.stop();
            }
            origin.stop();
        } else {
            skipped.push("http1 keep-alive, nginx backend (nginx not installed)".into());
        }
    }
    for &subject in &tcp_subjects {
        let proxy = Running::start(subject, &target, true, &out_dir);
        if plan.wants("memory, idle tcp connection pair") {
            samples.extend(idle_memory(&plan, subject, &proxy, Opening::Tcp));
        }
        running.push((subject, proxy));
    }
    for _ in 0..plan.reps {
        for (subject, proxy) in &running {
            if plan.wants("tcp bulk transfer") {
                merge(&mut samples, tcp_bulk(&once, *subject, proxy, &target));
            }
        }
    }
    for (_, mut proxy) in running.drain(..) {
        proxy.stop();
    }
    for tool in ["wrk", "h2load"] {
        if !installed(tool) {
            skipped.push(format!("{tool} workloads ({tool} not installed)"));
        }
    }

    let report = report(&samples, &skipped, &plan);
    println!("{report}");
    std::fs::write(out_dir.join("results.md"), &report).unwrap();
    std::fs::write(out_dir.join("results.json"), json(&samples)).unwrap();
    let measured = samples.iter().filter(|s| s.subject == "lameduck").count();
    assert!(measured > 0, "nothing was measured for lameduck");
    // The plain closing line CI reads.
    println!("bench: {} passed, 0 failed", samples.len());
}

// ---------------------------------------------------------------- the target and subjects

/// The app behind the proxies: an HTTP/1.1 + HTTP/2 server answering `ok`, a TCP sink that
/// counts what it receives, and a TCP listener that holds connections open. Pinned to CPU 1.
struct Target {
    http: SocketAddr,
    sink: SocketAddr,
    hold: SocketAddr,
    sunk: Arc<AtomicU64>,
}

impl Target {
    fn start() -> Target {
        let (tx, rx) = std::sync::mpsc::channel();
        let sunk = Arc::new(AtomicU64::new(0));
        let counter = sunk.clone();
        thread::spawn(move || {
            pin_current_thread(LOAD_CPU);
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                use tokio::io::AsyncReadExt;
                let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let sink = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let hold = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                tx.send((
                    http.local_addr().unwrap(),
                    sink.local_addr().unwrap(),
                    hold.local_addr().unwrap(),
                ))
                .unwrap();
                tokio::spawn(async move {
                    loop {
                        let Ok((stream, _)) = sink.accept().await else {
                            continue;
                        };
                        let counter = counter.clone();
                        tokio::spawn(async move {
                            let mut stream = stream;
                            let mut buf = vec![0u8; 256 * 1024];
                            while let Ok(n) = stream.read(&mut buf).await {
                                if n == 0 {
                                    break;
                                }
                                counter.fetch_add(n as u64, Ordering::Relaxed);
                            }
                        });
                    }
                });
                tokio::spawn(async move {
                    loop {
                        let Ok((mut stream, _)) = hold.accept().await else {
                            continue;
                        };
                        // Hold it open, silent, until the other side closes it.
                        tokio::spawn(async move {
                            let mut buf = [0u8; 64];
                            while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
                        });
                    }
                });
                loop {
                    let Ok((stream, _)) = http.accept().await else {
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    tokio::spawn(async move {
                        let service = hyper::service::service_fn(|_request| async {
                            Ok::<_, std::convert::Infallible>(hyper::Response::new(
                                http_body_util::Full::new(bytes::Bytes::from_static(b"ok")),
                            ))
                        });
                        let _ = hyper_util::server::conn::auto::Builder::new(
                            hyper_util::rt::TokioExecutor::new(),
                        )
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                    });
                }
            });
        });
        let (http, sink, hold) = rx.recv().unwrap();
        Target {
            http,
            sink,
            hold,
            sunk,
        }
    }
}

/// A subject serving on `addr` (HTTP/1 and auto) and `h2` (HTTP/2 prior knowledge).
struct Running {
    child: Option<Child>,
    addr: SocketAddr,
    h2: SocketAddr,
}

impl Running {
    /// Starts `subject` in front of the target's HTTP server (or TCP sink and hold listener).
    fn start(subject: Subject, target: &Target, tcp: bool, dir: &Path) -> Running {
        let forward = if tcp { target.sink } else { target.http };
        Running::start_to(subject, forward, tcp, dir)
    }

    /// Starts `subject` in front of `forward`.
    fn start_to(subject: Subject, forward: SocketAddr, tcp: bool, dir: &Path) -> Running {
        if subject == Subject::Direct {
            return Running {
                child: None,
                addr: forward,
                h2: forward,
            };
        }
        let (addr, h2) = (free_port(), free_port());
        let mut command = match subject {
            Subject::Lameduck => {
                let mut command = Command::new(BIN);
                let suffix = if tcp { "/tcp" } else { "" };
                command.args([
                    "--inbound",
                    &format!("{addr}={forward}{suffix}"),
                    "--log",
                    "warn",
                ]);
                command.args(["--inbound", &format!("{h2}={forward}{suffix}")]);
                command.args(["--admin", &free_port().to_string()]);
                command
            }
            Subject::HaproxyHttp | Subject::HaproxyTcp => {
                let template = if tcp {
                    "haproxy-tcp.cfg"
                } else {
                    "haproxy-http.cfg"
                };
                let config = render(dir, template, addr, h2, forward);
                let mut command = Command::new("haproxy");
                command.args(["-db", "-f"]).arg(config);
                command
            }
            Subject::NginxHttp | Subject::NginxStream => {
                let template = if tcp {
                    "nginx-stream.conf"
                } else {
                    "nginx-http.conf"
                };
                let config = render(dir, template, addr, h2, forward);
                let mut command = Command::new("nginx");
                command.arg("-c").arg(config).arg("-p").arg(dir);
                command
            }
            Subject::Direct => unreachable!(),
        };
        pin(&mut command, PROXY_CPU);
        let child = spawn_listening(&mut command, addr, subject.name());
        Running {
            child: Some(child),
            addr,
            h2,
        }
    }

    fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|child| child.id() as i32)
    }

    fn cpu(&self) -> Duration {
        let (user, kernel) = self.cpu_split();
        user + kernel
    }

    /// CPU time in user space and in the kernel.
    fn cpu_split(&self) -> (Duration, Duration) {
        self.pid()
            .map_or((Duration::ZERO, Duration::ZERO), cpu_time)
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts `command` and waits (at most 10 s) until it accepts connections on `addr`.
fn spawn_listening(command: &mut Command, addr: SocketAddr, what: &str) -> Child {
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < deadline, "{what} did not start");
        thread::sleep(Duration::from_millis(5));
    }
    child
}

fn render(
    dir: &Path,
    template: &str,
    listen: SocketAddr,
    h2: SocketAddr,
    target: SocketAddr,
) -> PathBuf {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("benches")
            .join(template),
    )
    .unwrap();
    let text = text
        .replace("{LISTEN_H1}", &listen.to_string())
        .replace(
            "{LISTEN}",
            &if template.starts_with("haproxy-tcp") || template.starts_with("nginx-stream") {
                listen
            } else {
                h2
            }
            .to_string(),
        )
        .replace("{TARGET}", &target.to_string())
        .replace("{DIR}", &dir.display().to_string());
    let path = dir.join(template);
    std::fs::write(&path, text).unwrap();
    path
}

// ---------------------------------------------------------------- workloads

fn h1_keepalive(plan: &Plan, subject: Subject, proxy: &Running) -> Vec<Sample> {
    h1_keepalive_rows("http1 keep-alive", &[], plan, subject, proxy)
}

/// Keep-alive requests flat out (wrk), with `headers` besides `Host`: the rows of `workload`.
fn h1_keepalive_rows(
    workload: &'static str,
    headers: &[&str],
    plan: &Plan,
    subject: Subject,
    proxy: &Running,
) -> Vec<Sample> {
    let mut rps = sample(workload, subject, "requests/s", "req/s", true);
    let mut p50 = sample(workload, subject, "latency p50", "µs", false);
    let mut p99 = sample(workload, subject, "latency p99", "µs", false);
    let mut p999 = sample(workload, subject, "latency p99.9", "µs", false);
    let mut cpu = sample(workload, subject, "proxy CPU per request", "µs", false);
    // The kernel's part: the socket calls and the TCP work of both ends of each loopback
    // connection, which runs on the sender's CPU. Every proxy pays it alike; it is the floor.
    let mut kernel = sample(
        workload,
        subject,
        "proxy CPU per request, in the kernel",
        "µs",
        false,
    );
    let headers: Vec<&str> = headers.iter().flat_map(|header| ["-H", header]).collect();
    for _ in 0..plan.reps {
        let (user_before, kernel_before) = proxy.cpu_split();
        let run = wrk(plan, proxy.addr, &headers);
        let (user_after, kernel_after) = proxy.cpu_split();
        let requests = run.requests.max(1) as f64;
        rps.values.push(run.requests as f64 / run.seconds);
        p50.values.push(run.p50);
        p99.values.push(run.p99);
        p999.values.push(run.p999);
        let spent_kernel = kernel_after - kernel_before;
        let spent = user_after - user_before + spent_kernel;
        cpu.values.push(spent.as_secs_f64() * 1e6 / requests);
        kernel
            .values
            .push(spent_kernel.as_secs_f64() * 1e6 / requests);
    }
    let mut samples = vec![rps, p50, p99, p999];
    if subject != Subject::Direct {
        samples.push(cpu);
        samples.push(kernel);
    }
    samples
}

/// Request headers of a browser or an SDK, besides the `Host` wrk sends.
const REALISTIC_HEADERS: [&str; 9] = [
    "User-Agent: Mozilla/5.0 (X11; Linux x86_64; rv:128.0) Gecko/20100101 Firefox/128.0",
    "Accept: text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8",
    "Accept-Language: en-US,en;q=0.5",
    "Accept-Encoding: gzip, deflate, br",
    "Cookie: session=3f2a9c1e7b5d4a60; theme=dark",
    "Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.c2lnbmF0dXJl",
    "X-Request-Id: 7d0c3f6e-9a41-4b8e-8f2d-1c5e6a7b8c9d",
    "Traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "Cache-Control: no-cache",
];

/// The keep-alive workload against nginx as the app, with realistic request headers.
fn h1_nginx_backend(plan: &Plan, subject: Subject, proxy: &Running) -> Vec<Sample> {
    h1_keepalive_rows(
        "http1 keep-alive, nginx backend",
        &REALISTIC_HEADERS,
        plan,
        subject,
        proxy,
    )
}

/// The fixed-rate workload against nginx as the app, with realistic request headers.
fn h1_nginx_backend_fixed_rate(
    plan: &Plan,
    subject: Subject,
    proxy: &Running,
    dir: &Path,
) -> Vec<Sample> {
    h1_fixed_rate_rows(
        "http1 keep-alive, nginx backend, 10,000 req/s",
        &REALISTIC_HEADERS,
        plan,
        subject,
        proxy,
        dir,
    )
}

/// nginx as the app (`benches/nginx-origin.conf`), on the target's CPU.
struct NginxOrigin {
    child: Child,
    addr: SocketAddr,
}

impl NginxOrigin {
    fn start(dir: &Path) -> NginxOrigin {
        let addr = free_port();
        let config = render(dir, "nginx-origin.conf", addr, addr, addr);
        let mut command = Command::new("nginx");
        command.arg("-c").arg(config).arg("-p").arg(dir);
        pin(&mut command, LOAD_CPU);
        let child = spawn_listening(&mut command, addr, "the nginx backend");
        NginxOrigin { child, addr }
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn h1_new_connections(plan: &Plan, subject: Subject, proxy: &Running) -> Vec<Sample> {
    let mut cps = sample(
        "http1 new connection per request",
        subject,
        "connections/s",
        "conn/s",
        true,
    );
    for _ in 0..plan.reps {
        let run = wrk(plan, proxy.addr, &["-H", "Connection: close"]);
        cps.values.push(run.requests as f64 / run.seconds);
    }
    vec![cps]
}

struct WrkRun {
    requests: u64,
    seconds: f64,
    p50: f64,
    p99: f64,
    p999: f64,
}

fn wrk(plan: &Plan, addr: SocketAddr, extra: &[&str]) -> WrkRun {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/percentiles.lua");
    let mut command = Command::new("wrk");
    command
        .args(["-t1", "-c32", &format!("-d{}s", plan.seconds), "-s"])
        .arg(&script)
        .args(extra)
        .arg(format!("http://{addr}/"));
    pin(&mut command, LOAD_CPU);
    let output = command.output().expect("run wrk");
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text
        .lines()
        .find(|line| line.starts_with("BENCH "))
        .unwrap_or_else(|| panic!("wrk said:\n{text}"));
    let field = |name: &str| -> f64 {
        line.split_whitespace()
            .find_map(|part| part.strip_prefix(&format!("{name}=")))
            .and_then(|value| value.parse().ok())
            .unwrap_or(0.0)
    };
    WrkRun {
        requests: field("requests") as u64,
        seconds: plan.seconds as f64,
        p50: field("p50"),
        p99: field("p99"),
        p999: field("p999"),
    }
}

/// Requests per second of the fixed-rate latency workload: about a third of what a proxy here
/// serves at saturation, so the percentiles measure the proxy, not a queue in front of it.
const FIXED_RATE: u64 = 10_000;

/// The fixed-rate rows run this many times per repetition of the others, in rounds of their
/// own: a p99 of a few seconds is the figure a noisy spell of this shared machine moves most.
const FIXED_RATE_ROUNDS: usize = 2;

/// The rounds of a run: `true` for those in which every workload runs, `false` for those of
/// the fixed-rate rows alone.
fn rounds(plan: &Plan) -> impl Iterator<Item = bool> {
    (0..plan.reps * FIXED_RATE_ROUNDS).map(|round| round % FIXED_RATE_ROUNDS == 0)
}

/// HTTP/1.1 keep-alive latency at a fixed request rate (32 connections, h2load `--rps`), from
/// h2load's per-request log.
fn h1_fixed_rate(plan: &Plan, subject: Subject, proxy: &Running, dir: &Path) -> Vec<Sample> {
    h1_fixed_rate_rows(
        "http1 keep-alive, 10,000 req/s",
        &[],
        plan,
        subject,
        proxy,
        dir,
    )
}

/// The fixed-rate workload with `headers` besides `Host`: the rows of `workload`.
fn h1_fixed_rate_rows(
    workload: &'static str,
    headers: &[&str],
    plan: &Plan,
    subject: Subject,
    proxy: &Running,
    dir: &Path,
) -> Vec<Sample> {
    let headers: Vec<&str> = headers.iter().flat_map(|header| ["-H", header]).collect();
    let mut p50 = sample(workload, subject, "latency p50", "µs", false);
    let mut p99 = sample(workload, subject, "latency p99", "µs", false);
    let mut p999 = sample(workload, subject, "latency p99.9", "µs", false);
    let log = dir.join("h2load-requests.log");
    for _ in 0..plan.reps {
        // h2load appends to its log: each repetition starts a new one.
        let _ = std::fs::remove_file(&log);
        let mut command = Command::new("h2load");
        command
            .args(["--h1", "-c", "32", "--rps", &(FIXED_RATE / 32).to_string()])
            .args(&headers)
            .args(["-D", &plan.seconds.to_string(), "--log-file"])
            .arg(&log)
            .arg(format!("http://{}/", proxy.addr));
        pin(&mut command, LOAD_CPU);
        let output = command.output().expect("run h2load");
        assert!(output.status.success(), "h2load failed: {output:?}");
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let mut micros: Vec<f64> = text
            .lines()
            .filter_map(|line| {
                let mut columns = line.split('\t');
                let status = columns.nth(1)?;
                let took = columns.next()?;
                (status == "200")
                    .then(|| took.trim().parse().ok())
                    .flatten()
            })
            .collect();
        assert!(!micros.is_empty(), "h2load logged no successful request");
        micros.sort_by(f64::total_cmp);
        let at = |q: f64| micros[((micros.len() - 1) as f64 * q).round() as usize];
        p50.values.push(at(0.50));
        p99.values.push(at(0.99));
        p999.values.push(at(0.999));
    }
    let _ = std::fs::remove_file(&log);
    vec![p50, p99, p999]
}

fn h2_multiplexed(plan: &Plan, subject: Subject, proxy: &Running) -> Vec<Sample> {
    let mut rps = sample("http2 multiplexed", subject, "requests/s", "req/s", true);
    let mut cpu = sample(
        "http2 multiplexed",
        subject,
        "proxy CPU per request",
        "µs",
        false,
    );
    for _ in 0..plan.reps {
        let before = proxy.cpu();
        let mut command = Command::new("h2load");
        command.args([
            "-c",
            "8",
            "-m",
            "32",
            "-D",
            &plan.seconds.to_string(),
            &format!("http://{}/", proxy.h2),
        ]);
        pin(&mut command, LOAD_CPU);
        let output = command.output().expect("run h2load");
        let text = String::from_utf8_lossy(&output.stdout);
        let succeeded = text
            .lines()
            .find(|line| line.starts_with("requests:"))
            .and_then(|line| line.split(',').find(|part| part.contains("succeeded")))
            .and_then(|part| part.split_whitespace().next())
            .and_then(|n| n.parse::<f64>().ok())
            .unwrap_or(0.0);
        rps.values.push(succeeded / plan.seconds as f64);
        cpu.values
            .push((proxy.cpu() - before).as_secs_f64() * 1e6 / succeeded.max(1.0));
    }
    if subject == Subject::Direct {
        vec![rps]
    } else {
        vec![rps, cpu]
    }
}

fn tcp_bulk(plan: &Plan, subject: Subject, proxy: &Running, target: &Target) -> Vec<Sample> {
    let mut gbps = sample("tcp bulk transfer", subject, "throughput", "Gbit/s", true);
    let mut cpu = sample(
        "tcp bulk transfer",
        subject,
        "proxy CPU per GB",
        "ms",
        false,
    );
    for _ in 0..plan.reps {
        let before_cpu = proxy.cpu();
        let before = target.sunk.load(Ordering::Relaxed);
        let until = Instant::now() + Duration::from_secs(plan.seconds);
        let addr = proxy.addr;
        let writers: Vec<_> = (0..4)
            .map(|_| {
                thread::spawn(move || {
                    pin_current_thread(LOAD_CPU);
                    let mut stream = TcpStream::connect(addr).unwrap();
                    let chunk = vec![0x5au8; 256 * 1024];
                    while Instant::now() < until {
                        if stream.write_all(&chunk).is_err() {
                            break;
                        }
                    }
                })
            })
            .collect();
        let started = Instant::now();
        for writer in writers {
            writer.join().unwrap();
        }
        thread::sleep(Duration::from_millis(100));
        let bytes = (target.sunk.load(Ordering::Relaxed) - before) as f64;
        let seconds = started.elapsed().as_secs_f64();
        gbps.values.push(bytes * 8.0 / seconds / 1e9);
        cpu.values
            .push((proxy.cpu() - before_cpu).as_secs_f64() * 1e3 / (bytes / 1e9).max(1e-9));
    }
    if subject == Subject::Direct {
        vec![gbps]
    } else {
        vec![gbps, cpu]
    }
}

/// The memory row whose connections open one by one, each idle before the next comes.
const PACED_MEMORY: &str = "memory, idle http1 keep-alive, opened 15 ms apart";

/// How the idle connections of a memory row are opened.
#[derive(Clone, Copy, PartialEq)]
enum Opening {
    /// HTTP/1 keep-alive after one request, as fast as the proxy answers: the connections
    /// opened within lameduck's park delay of each other still hold their buffers together.
    Http,
    /// The same, 15 ms apart (a quarter as many): each connection is parked before the next
    /// opens, as when clients come over time.
    Paced,
    /// A TCP connection pair held open by the target.
    Tcp,
}

/// Resident memory idle, and per open idle connection.
fn idle_memory(plan: &Plan, subject: Subject, proxy: &Running, opening: Opening) -> Vec<Sample> {
    let Some(pid) = proxy.pid() else {
        return Vec::new();
    };
    let (workload, count) = match opening {
        Opening::Http => ("memory, idle http1 keep-alive", plan.idle_connections),
        Opening::Paced => (PACED_MEMORY, plan.idle_connections / 4),
        Opening::Tcp => ("memory, idle tcp connection pair", plan.idle_connections),
    };
    let http = opening != Opening::Tcp;
    let paced = opening == Opening::Paced;
    let mut idle = sample(workload, subject, "resident idle", "KiB", false);
    let mut per = sample(workload, subject, "per connection", "KiB", false);
    // TCP subjects forward to the sink, which holds every connection open until the client closes.
    let addr = proxy.addr;
    thread::sleep(Duration::from_millis(200));
    let mut before = rss_kib(pid);
    idle.values.push(before as f64);
    // The paced row counts the connections after its first fifth: what the first ones
    // allocate for good (the buffers each thread keeps for its next lanes, the tables' first
    // growth) is not a cost per connection.
    let warm = if paced { count / 5 } else { 0 };
    let mut counted = 0;
    let mut held = Vec::with_capacity(count);
    for opened in 0..count {
        if opened == warm && warm > 0 {
            thread::sleep(Duration::from_millis(100));
            before = rss_kib(pid);
        }
        let Ok(mut stream) = TcpStream::connect(addr) else {
            break;
        };
        if http {
            let _ = stream.write_all(b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n");
            let mut buf = [0u8; 512];
            let _ = stream.read(&mut buf);
        }
        held.push(stream);
        counted += usize::from(opened >= warm);
        if paced {
            thread::sleep(Duration::from_millis(15));
        }
    }
    assert_eq!(
        held.len(),
        count,
        "{}: could not open every idle connection",
        subject.name()
    );
    thread::sleep(Duration::from_millis(500));
    let after = rss_kib(pid);
    per.values
        .push((after.saturating_sub(before)) as f64 / counted.max(1) as f64);
    drop(held);
    thread::sleep(Duration::from_millis(300));
    if paced {
        // The resident set idle is the other row's.
        vec![per]
    } else {
        vec![idle, per]
    }
}

/// Start-up to `/ready`, and the shutdown times of docs/lifecycle.md (lameduck only).
fn lifecycle(plan: &Plan, target: &Target, dir: &Path) -> Vec<Sample> {
    let _ = dir;
    let mut startup = sample(
        "lifecycle",
        Subject::Lameduck,
        "start to /ready",
        "ms",
        false,
    );
    let mut idle_exit = sample(
        "lifecycle",
        Subject::Lameduck,
        "SIGTERM to exit, idle",
        "ms",
        false,
    );
    let mut busy_exit = sample(
        "lifecycle",
        Subject::Lameduck,
        "SIGTERM to exit, idle keep-alive connections",
        "ms",
        false,
    );
    let mut forced = sample(
        "lifecycle",
        Subject::Lameduck,
        "force-close TCP connections at grace end",
        "ms",
        false,
    );
    for _ in 0..plan.reps.max(3) {
        let (mut child, admin, _, started) = start_lameduck(target, &[]);
        startup.values.push(started.as_secs_f64() * 1e3);
        let sent = Instant::now();
        signal(&child, libc::SIGTERM);
        let _ = child.wait();
        idle_exit.values.push(sent.elapsed().as_secs_f64() * 1e3);
        let _ = admin;
    }
    for _ in 0..plan.reps {
        let (mut child, _, inbound, _) = start_lameduck(target, &[]);
        let held: Vec<TcpStream> = (0..plan.idle_connections)
            .filter_map(|_| {
                let mut stream = TcpStream::connect(inbound[0]).ok()?;
                stream
                    .write_all(b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n")
                    .ok()?;
                let mut buf = [0u8; 512];
                let _read = stream.read(&mut buf).ok()?;
                Some(stream)
            })
            .collect();
        let sent = Instant::now();
        signal(&child, libc::SIGTERM);
        let _ = child.wait();
        busy_exit.values.push(sent.elapsed().as_secs_f64() * 1e3);
        drop(held);

        let grace = Duration::from_millis(500);
        let (mut child, _, inbound, _) = start_lameduck(target, &["--shutdown-grace-period=500ms"]);
        let held: Vec<TcpStream> = (0..plan.idle_connections)
            .filter_map(|_| TcpStream::connect(inbound[1]).ok())
            .collect();
        thread::sleep(Duration::from_millis(300));
        let sent = Instant::now();
        signal(&child, libc::SIGTERM);
        let _ = child.wait();
        forced
            .values
            .push((sent.elapsed().saturating_sub(grace)).as_secs_f64() * 1e3);
        drop(held);
    }
    // The floor of the two shutdown rows: one thread on the proxy's CPU closing the same
    // sockets with nothing else to do (FIN to each idle client; RST to each client and target).
    let mut busy_floor = sample(
        "lifecycle",
        Subject::Direct,
        "SIGTERM to exit, idle keep-alive connections",
        "ms",
        false,
    );
    let mut forced_floor = sample(
        "lifecycle",
        Subject::Direct,
        "force-close TCP connections at grace end",
        "ms",
        false,
    );
    for _ in 0..plan.reps {
        busy_floor
            .values
            .push(close_floor(plan.idle_connections, None).as_secs_f64() * 1e3);
        forced_floor
            .values
            .push(close_floor(plan.idle_connections, Some(target.hold)).as_secs_f64() * 1e3);
    }
    vec![
        startup,
        idle_exit,
        busy_exit,
        forced,
        busy_floor,
        forced_floor,
    ]
}

/// How long one thread pinned to the proxy's CPU takes to close `n` accepted idle client
/// connections: with a FIN, or, given the target's address, with an RST together with `n`
/// connections of its own to the target (what a proxy's forced close does).
fn close_floor(n: usize, target: Option<SocketAddr>) -> Duration {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (go, went) = std::sync::mpsc::channel::<()>();
    let closer = thread::spawn(move || {
        pin_current_thread(PROXY_CPU);
        let mut sockets = Vec::with_capacity(2 * n);
        for _ in 0..n {
            sockets.push(listener.accept().unwrap().0);
            if let Some(target) = target {
                sockets.push(TcpStream::connect(target).unwrap());
            }
        }
        went.recv().unwrap();
        let started = Instant::now();
        if target.is_some() {
            for socket in &sockets {
                let _ = socket2::SockRef::from(socket).set_linger(Some(Duration::ZERO));
            }
        }
        drop(sockets);
        started.elapsed()
    });
    let clients: Vec<TcpStream> = (0..n).map(|_| TcpStream::connect(addr).unwrap()).collect();
    thread::sleep(Duration::from_millis(300));
    go.send(()).unwrap();
    let took = closer.join().unwrap();
    drop(clients);
    took
}

/// Starts lameduck with an HTTP route and a TCP route to the hold listener; returns the child,
/// its admin address, the inbound addresses and the time it took to answer `/ready` 200.
const HANDOFF: &str = "hand-off, a new connection per request";

/// What a late connection's hand-off costs (docs/pod-lifecycle.md, "Hand-off"): a pod's proxy
/// quiesced by its preStop hook, its lame duck over, hands each connection that still arrives
/// to the Service, here the other pod's proxy; against the same requests sent to that proxy
/// directly. wrk, one connection at a time, each request on a new connection (as late clients
/// come); both proxies on the proxy CPU.
fn handoff(plan: &Plan, target: &Target, dir: &Path) -> Vec<Sample> {
    let metric = |name: &'static str, unit: &'static str, higher: bool| {
        sample(HANDOFF, Subject::Lameduck, name, unit, higher)
    };
    let mut handed = [
        metric("requests/s handed off, one at a time", "req/s", true),
        metric("latency p50 handed off", "µs", false),
        metric("latency p99 handed off", "µs", false),
    ];
    let mut direct = [
        metric(
            "requests/s to the other pod directly, one at a time",
            "req/s",
            true,
        ),
        metric("latency p50 to the other pod directly", "µs", false),
        metric("latency p99 to the other pod directly", "µs", false),
    ];
    let (mut other, _, [other_http, _], _) = start_lameduck(target, &[]);
    let socket = dir.join("handoff.sock");
    let _ = std::fs::remove_file(&socket);
    let leaving_http = free_port();
    let handoff = format!("{}=127.0.0.1:{}", leaving_http.port(), other_http.port());
    let mut command = Command::new(BIN);
    command
        .args(["--inbound", &format!("{leaving_http}={}", target.http)])
        .args(["--handoff", &handoff])
        .args(["--drain-socket", &socket.display().to_string()])
        .args(["--lame-duck-max=1s", "--lame-duck-min=0s"])
        .args(["--shutdown-grace-period=600s", "--log", "warn"]);
    pin(&mut command, PROXY_CPU);
    let mut leaving = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while !socket.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no drain socket"
        );
        thread::sleep(Duration::from_millis(5));
    }
    let hook = Command::new(BIN)
        .args(["prestop", "--socket", &socket.display().to_string()])
        .output()
        .unwrap();
    assert!(hook.status.success(), "the preStop hook: {hook:?}");
    for _ in 0..plan.reps {
        for (addr, into) in [(leaving_http, &mut handed), (other_http, &mut direct)] {
            // One connection at a time: the latency a late request pays, not a queue's.
            let run = wrk(plan, addr, &["-c1", "-H", "Connection: close"]);
            into[0].values.push(run.requests as f64 / run.seconds);
            into[1].values.push(run.p50);
            into[2].values.push(run.p99);
        }
    }
    for child in [&mut leaving, &mut other] {
        signal(child, libc::SIGKILL);
        let _ = child.wait();
    }
    handed.into_iter().chain(direct).collect()
}

fn start_lameduck(
    target: &Target,
    extra: &[&str],
) -> (Child, SocketAddr, [SocketAddr; 2], Duration) {
    let (http, tcp, admin) = (free_port(), free_port(), free_port());
    let mut command = Command::new(BIN);
    command
        .args(["--inbound", &format!("{http}={}", target.http)])
        .args(["--inbound", &format!("{tcp}={}/tcp", target.hold)])
        .args(["--admin", &admin.to_string(), "--log", "warn"])
        .args(extra);
    pin(&mut command, PROXY_CPU);
    let started = Instant::now();
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    loop {
        if ready(admin) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "lameduck did not become ready"
        );
        thread::sleep(Duration::from_micros(200));
    }
    (child, admin, [http, tcp], started.elapsed())
}

fn ready(admin: SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect(admin) else {
        return false;
    };
    if stream
        .write_all(b"GET /ready HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).is_ok() && &head[9..12] == b"200"
}

// ---------------------------------------------------------------- report

fn sample(
    workload: &'static str,
    subject: Subject,
    metric: &'static str,
    unit: &'static str,
    higher: bool,
) -> Sample {
    Sample {
        workload,
        subject: subject.name(),
        metric,
        unit,
        higher_is_better: higher,
        values: Vec::new(),
    }
}

/// Adds one round's values to the samples of the earlier rounds.
fn merge(samples: &mut Vec<Sample>, round: Vec<Sample>) {
    for new in round {
        let earlier = samples.iter_mut().find(|old| {
            (old.workload, old.subject, old.metric) == (new.workload, new.subject, new.metric)
        });
        match earlier {
            Some(old) => old.values.extend(new.values),
            None => samples.push(new),
        }
    }
}

fn report(samples: &[Sample], skipped: &[String], plan: &Plan) -> String {
    let mut out = String::new();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let _ = writeln!(
        out,
        "lameduck bench ({} mode): {} s per run, {} repetition(s), median [min–max]; {} idle connections for the memory and shutdown rows; proxy pinned to CPU {PROXY_CPU}, load and target to CPU {LOAD_CPU}; {cpu}\n",
        if plan.quick { "quick" } else { "full" },
        plan.seconds,
        plan.reps,
        plan.idle_connections
    );
    let _ = writeln!(
        out,
        "| workload | metric | subject | value | vs no proxy | lameduck vs this |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|");
    let mut groups: BTreeMap<(&str, &str), Vec<&Sample>> = BTreeMap::new();
    for sample in samples.iter().filter(|s| !s.values.is_empty()) {
        groups
            .entry((sample.workload, sample.metric))
            .or_default()
            .push(sample);
    }
    for ((workload, metric), group) in &groups {
        let direct = group
            .iter()
            .find(|s| s.subject == "no proxy")
            .map(|s| s.median());
        let ours = group
            .iter()
            .find(|s| s.subject == "lameduck")
            .map(|s| s.median());
        for sample in group {
            let median = sample.median();
            let min = sample.values.iter().copied().fold(f64::INFINITY, f64::min);
            let max = sample
                .values
                .iter()
                .copied()
                .fold(f64::NEG_INFINITY, f64::max);
            let vs_direct = direct
                .filter(|_| sample.subject != "no proxy")
                .map_or(String::new(), |d| format!("{:.2}×", median / d));
            let vs_peer = ours
                .filter(|_| !matches!(sample.subject, "lameduck" | "no proxy"))
                .map_or(String::new(), |o| format!("{:.2}×", o / median));
            let _ = writeln!(
                out,
                "| {workload} | {metric} ({}{}) | {} | {} [{}–{}] | {vs_direct} | {vs_peer} |",
                sample.unit,
                if sample.higher_is_better {
                    ", higher is better"
                } else {
                    ""
                },
                sample.subject,
                fmt(median),
                fmt(min),
                fmt(max),
            );
        }
    }
    if !skipped.is_empty() {
        let _ = writeln!(out, "\nSkipped: {}.", skipped.join(", "));
    }
    out
}

fn fmt(value: f64) -> String {
    if value >= 100.0 {
        format!("{value:.0}")
    } else if value >= 1.0 {
        format!("{value:.2}")
    } else {
        format!("{value:.3}")
    }
}

fn json(samples: &[Sample]) -> String {
    let rows: Vec<serde_json::Value> = samples
        .iter()
        .map(|s| {
            serde_json::json!({
                "workload": s.workload, "subject": s.subject, "metric": s.metric, "unit": s.unit,
                "higher_is_better": s.higher_is_better, "values": s.values,
                "median": if s.values.is_empty() { None } else { Some(s.median()) },
            })
        })
        .collect();
    serde_json::to_string_pretty(&rows).unwrap()
}

// ---------------------------------------------------------------- system helpers

fn installed(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A port on 127.0.0.1 for a process to listen on a while later, drawn from 10000-19999: below
/// the kernel's ephemeral range, where wrk's and h2load's connections take their source ports
/// by the thousand (a port merely released there could become one before the process binds it,
/// and the process would fail to start), and below the hand-off's dial ports. Free when drawn.
/// (tests/support's port_for_another_process, for the tests.)
fn free_port() -> SocketAddr {
    use std::hash::{BuildHasher, Hasher};
    for attempt in 0u64..1000 {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(attempt);
        let port = 10_000 + (hasher.finish() % 10_000) as u16;
        if let Ok(listener) = TcpListener::bind(("127.0.0.1", port)) {
            return listener.local_addr().unwrap();
        }
    }
    panic!("no free port in 10000-19999");
}

fn pin(command: &mut Command, cpu: usize) {
    // SAFETY: sched_setaffinity is async-signal-safe and affects only the child.
    unsafe {
        command.pre_exec(move || {
            set_affinity(cpu);
            Ok(())
        });
    }
}

fn pin_current_thread(cpu: usize) {
    set_affinity(cpu);
}

fn set_affinity(cpu: usize) {
    let cpus = thread::available_parallelism().map_or(1, |n| n.get());
    // SAFETY: the set is a plain bitmask on the stack, passed with its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu % cpus, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// Raises the descriptor limit as far as allowed; returns the limit now in force.
fn raise_fd_limit(want: u64) -> u64 {
    // SAFETY: setrlimit and getrlimit read or write one struct.
    unsafe {
        let limit = libc::rlimit {
            rlim_cur: want,
            rlim_max: want,
        };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
            let mut current = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut current);
            current.rlim_cur = current.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &current);
            return current.rlim_cur;
        }
        want
    }
}

fn signal(child: &Child, signal: i32) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(child.id() as i32, signal) };
}
