//! The close-spread window (docs/lifecycle.md): long-lived connections still open in the last
//! part of the grace period are ended one by one, evenly spread, each as cleanly as its
//! protocol allows, and nothing is reset.
//!
//! Real peers: the `websockets` and `grpcio` Python packages and asyncio TCP streams
//! (tests/close_spread/*.py), through the real binary.

mod support;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
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

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
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
    let ports: Vec<String> = (0..3).map(|_| free_port().to_string()).collect();
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
