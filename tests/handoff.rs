//! Hand-off (docs/pod-lifecycle.md, "Hand-off"): once the lame duck is over, a late
//! connection goes to another pod of its Service instead of being refused. In a network
//! namespace of the test's own: the pod's address, another pod of the Service, and the
//! Service's ClusterIP as kube-proxy writes it (DNAT in OUTPUT), so that the hand-off goes
//! through real NAT rules, which may send it back to the very pod it left.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::thread;
use std::time::Instant;

use support::backend::{Backend, get, read_response, send_raw};
use support::h2raw::{self, H2};
use support::netns::run;
use support::{BIN, PATIENCE, Proxy, wait_close};

/// The leaving pod's address, the other pod's, and the Service's ClusterIP.
const POD: &str = "10.78.0.2";
const OTHER_POD: &str = "10.78.0.3";
const SERVICE: &str = "10.96.0.10";
/// The pod ports: HTTP (`auto` route), opaque TCP, and one without a hand-off.
const HTTP_PORT: u16 = 8080;
const TCP_PORT: u16 = 9000;
const BARE_PORT: u16 = 8090;
/// A pod port handed off to a Service port no endpoint serves.
const NOWHERE_PORT: u16 = 8070;
const SERVICE_NOWHERE: u16 = 81;
/// The Service's ports.
const SERVICE_HTTP: u16 = 80;
const SERVICE_TCP: u16 = 9000;

fn in_netns(test: &'static str, work: impl FnOnce() + Send + 'static) {
    support::netns::in_netns(test, support::netns::without_iptables(), work);
}

/// How kube-proxy's rules send the Service's port to its endpoints.
#[derive(Clone, Copy)]
enum Endpoints {
    /// The other pod only: the node has forgotten the leaving one.
    OtherOnly,
    /// Every second new connection to the leaving pod itself, the others to the other pod
    /// (`-m statistic --mode nth`: deterministic, unlike kube-proxy's `random`).
    Alternating,
    /// Every second new connection to the TCP port to a pod whose proxy resets it at once,
    /// unread (another leaving pod, without a hand-off of its own), the others to the other pod.
    ResettingFirst,
}

/// The pod that resets every connection it is sent.
const RESETTING_POD: &str = "10.78.0.4";

/// The two pods' addresses and the Service's DNAT rules, for the HTTP and the TCP port.
fn cluster(endpoints: Endpoints) {
    for addr in [POD, OTHER_POD, RESETTING_POD] {
        run("ip", &["addr", "add", &format!("{addr}/32"), "dev", "lo"]);
    }
    // A route for the ClusterIP, as a node's default route is: a connection to it is routed
    // before the DNAT rules rewrite it.
    run(
        "ip",
        &["route", "add", &format!("{SERVICE}/32"), "dev", "lo"],
    );
    // A Service port without endpoints: kube-proxy rejects its connections (with an ICMP
    // error; here a reset: over the loopback the ICMP error left the connect to time out).
    iptables(&format!(
        "-A OUTPUT -d {SERVICE} -p tcp --dport {SERVICE_NOWHERE} -j REJECT --reject-with tcp-reset"
    ));
    for (service_port, pod_port) in [(SERVICE_HTTP, HTTP_PORT), (SERVICE_TCP, TCP_PORT)] {
        let chain = format!("SVC-{service_port}");
        iptables(&format!("-t nat -N {chain}"));
        let first = match endpoints {
            Endpoints::OtherOnly => None,
            Endpoints::Alternating => Some(POD),
            Endpoints::ResettingFirst => (pod_port == TCP_PORT).then_some(RESETTING_POD),
        };
        if let Some(first) = first {
            iptables(&format!(
                "-t nat -A {chain} -m statistic --mode nth --every 2 --packet 0 -p tcp \
                 -j DNAT --to-destination {first}:{pod_port}"
            ));
        }
        iptables(&format!(
            "-t nat -A {chain} -p tcp -j DNAT --to-destination {OTHER_POD}:{pod_port}"
        ));
        iptables(&format!(
            "-t nat -A OUTPUT -d {SERVICE} -p tcp --dport {service_port} -j {chain}"
        ));
    }
}

/// One `iptables-nft` rule, its words as written.
fn iptables(rule: &str) {
    run("iptables-nft", &rule.split_whitespace().collect::<Vec<_>>());
}

/// An echo server that answers each chunk with `tag` and the chunk.
fn echo_on(listen: SocketAddr, tag: &'static [u8]) {
    let listener = TcpListener::bind(listen).unwrap();
    thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(read @ 1..) = stream.read(&mut buf) {
                    let mut answer = tag.to_vec();
                    answer.extend_from_slice(&buf[..read]);
                    if stream.write_all(&answer).is_err() {
                        break;
                    }
                }
            });
        }
    });
}

/// Accepts every connection at `listen` and resets it, unread, once its first bytes have come:
/// always after the dialler's connect, while its bytes wait.
fn resetting_on(listen: SocketAddr) {
    let listener = TcpListener::bind(listen).unwrap();
    thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let _ = stream.peek(&mut [0u8; 1]);
            support::reset_close(stream);
        }
    });
}

/// The app behind the leaving pod's proxy and the other pod, for HTTP and TCP.
struct Pods {
    app: Backend,
    other: Backend,
}

fn pods() -> Pods {
    echo_on("127.0.0.1:19000".parse().unwrap(), b"app:");
    echo_on(addr(OTHER_POD, TCP_PORT), b"other:");
    resetting_on(addr(RESETTING_POD, TCP_PORT));
    Pods {
        app: Backend::start(),
        other: Backend::start_on(addr(OTHER_POD, HTTP_PORT)),
    }
}

/// The leaving pod's proxy: an `auto` route and a TCP route with hand-offs to the Service, a
/// route without one; an adaptive lame duck that ends soon when nothing arrives; the drain
/// socket of the app containers' preStop hook, in `dir`.
fn leaving_proxy(pods: &Pods, dir: &Dir) -> Proxy {
    let handoff = format!(
        "{HTTP_PORT}={SERVICE}:{SERVICE_HTTP},{TCP_PORT}={SERVICE}:{SERVICE_TCP},{NOWHERE_PORT}={SERVICE}:{SERVICE_NOWHERE}"
    );
    Proxy::start(&[
        "--inbound",
        &format!("{POD}:{HTTP_PORT}={}", pods.app.addr),
        "--inbound",
        &format!("{POD}:{TCP_PORT}=127.0.0.1:19000/tcp"),
        "--inbound",
        &format!("{POD}:{BARE_PORT}={}", pods.app.addr),
        "--inbound",
        &format!("{POD}:{NOWHERE_PORT}={}", pods.app.addr),
        "--handoff",
        &handoff,
        "--pod-ip",
        POD,
        "--drain-socket",
        &dir.socket(),
        "--lame-duck-max=2s",
        "--lame-duck-min=100ms",
        "--shutdown-grace-period=30s",
        "--close-spread-window=0s",
    ])
}

/// A folder for the drain socket, removed on drop.
struct Dir(std::path::PathBuf);

impl Dir {
    fn new(test: &str) -> Dir {
        let dir = std::env::temp_dir().join(format!("lameduck-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Dir(dir)
    }

    fn socket(&self) -> String {
        self.0.join("drain.sock").display().to_string()
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The pod's termination begins: the app container's preStop hook quiesces the inbound side;
/// the lame duck ends with nothing arriving, and the listeners stay for late connections.
fn lame_duck_over(proxy: &Proxy, dir: &Dir) {
    let hook = Command::new(BIN)
        .args(["prestop", "--socket", &dir.socket()])
        .output()
        .unwrap();
    assert!(hook.status.success(), "{hook:?}");
    proxy
        .logs
        .wait_for("the listeners kept for late connections", |line| {
            line.contains("listener closed to new clients")
        });
}

/// The cluster with its Service's `endpoints`, the pods, and the leaving pod's proxy with its
/// lame duck over (its drain socket's folder named after `tag`).
fn late(endpoints: Endpoints, tag: &str) -> (Pods, Dir, Proxy) {
    cluster(endpoints);
    let pods = pods();
    let dir = Dir::new(tag);
    let proxy = leaving_proxy(&pods, &dir);
    lame_duck_over(&proxy, &dir);
    (pods, dir, proxy)
}

/// Late connections the proxy handed off so far.
fn handed_off(proxy: &Proxy) -> f64 {
    proxy.metric("lameduck_late_connections_total{direction=\"inbound\",fate=\"handed_off\"}")
}

/// The leaving pod's app got nothing late.
fn app_untouched(pods: &Pods) {
    assert!(
        pods.app.seen_paths().is_empty(),
        "the leaving pod's app got {:?}",
        pods.app.seen_paths()
    );
}

/// The app has exited: the proxy's own SIGTERM. It exits once late connections have stopped.
fn app_exited(proxy: &mut Proxy) {
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

fn addr(ip: &str, port: u16) -> SocketAddr {
    format!("{ip}:{port}").parse().unwrap()
}

/// `POST path` with a body.
fn post(path: &str, body: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: app.local\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A late HTTP/1 request on a new connection: its response.
fn late_request(bytes: &[u8]) -> support::backend::WireResponse {
    let mut stream = send_raw(addr(POD, HTTP_PORT), bytes);
    read_response(&mut stream).expect("a late request is answered")
}

/// A late TCP stream: what the other side echoes to `payload`.
fn late_stream(payload: &[u8]) -> Vec<u8> {
    let mut stream = TcpStream::connect(addr(POD, TCP_PORT)).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    stream.write_all(payload).unwrap();
    let mut echoed = vec![0u8; b"other:".len() + payload.len()];
    stream
        .read_exact(&mut echoed)
        .expect("the late stream is echoed");
    echoed
}

/// Once the lame duck is over, late HTTP/1 (GET, and POST with a body), HTTP/2 and opaque TCP
/// connections reach the Service's other pod, never the leaving pod's app; each handed-off
/// request carries the mark, the pod's own address; the metrics, `/status` and `lameduck
/// status` count them; and once they stop, the proxy exits.
#[test]
fn late_connections_are_handed_off_to_the_service() {
    in_netns("late_connections_are_handed_off_to_the_service", || {
        let (pods, _dir, mut proxy) = late(Endpoints::OtherOnly, "handoff");

        let response = late_request(&get("/late-get"));
        assert_eq!(response.status, 200);
        assert_eq!(response.header("connection"), Some("close"));
        let response = late_request(&post("/late-post", "a body to hand off"));
        assert_eq!(response.status, 200);

        let mut h2 = H2::connect(addr(POD, HTTP_PORT));
        h2.get(1, "/late-h2");
        let frames = h2
            .read_until(|frame| frame.stream == 1 && frame.flags & h2raw::END_STREAM != 0)
            .expect("the late HTTP/2 request is answered");
        assert!(
            frames
                .iter()
                .any(|frame| frame.kind == h2raw::HEADERS && frame.is_status_200()),
            "{frames:?}"
        );
        // Asked to go away, as any connection of a pod that is going away.
        if !frames.iter().any(|frame| frame.kind == h2raw::GOAWAY) {
            h2.read_until(|frame| frame.kind == h2raw::GOAWAY)
                .expect("GOAWAY after the late request");
        }
        drop(h2);

        assert_eq!(late_stream(b"late tcp"), b"other:late tcp");

        let seen = pods.other.seen();
        let paths: Vec<&str> = seen.iter().map(|seen| seen.path.as_str()).collect();
        assert_eq!(paths, ["/late-get", "/late-post", "/late-h2"]);
        for request in &seen {
            assert_eq!(request.header("lameduck-handoff"), Some(POD), "{request:?}");
        }
        assert_eq!(seen[1].body, b"a body to hand off");
        app_untouched(&pods);
        assert_eq!(handed_off(&proxy), 4.0);
        for (protocol, count) in [("http1", 2.0), ("http2", 1.0), ("tcp", 1.0)] {
            assert_eq!(
                proxy.metric(&format!(
                    "lameduck_handoffs_total{{protocol=\"{protocol}\"}}"
                )),
                count,
                "{protocol}"
            );
        }
        let status = proxy.status();
        assert!(
            status.contains(
                "4 connections after the lame duck: 4 handed off to the Service, 0 refused at once"
            ),
            "{status}"
        );

        // With no more late connections, the proxy exits at its SIGTERM.
        let stopped = Instant::now();
        app_exited(&mut proxy);
        eprintln!("exited {:?} after its SIGTERM", stopped.elapsed());
        let summary = proxy
            .logs
            .wait_event("late connections after the lame duck (handed off or refused)");
        assert_eq!(summary["fields"]["handed_off"], 4, "{summary}");
    });
}

/// The node's rules still send every second new connection to the leaving pod itself: each
/// hand-off that comes back is reset unread and dialled again, so that every late request and
/// stream reaches the other pod whole (a POST's body, a stream's first bytes sent again), and
/// the loops are counted.
#[test]
fn a_handoff_that_comes_back_to_its_pod_is_dialled_again() {
    in_netns(
        "a_handoff_that_comes_back_to_its_pod_is_dialled_again",
        || {
            let (pods, _dir, mut proxy) = late(Endpoints::Alternating, "handoff-loop");

            // Each TCP stream dials anew, and its first dial comes back (the rules' counter is the
            // Service port's own).
            for round in 0..6 {
                let payload = format!("stream {round}");
                let mut expected = b"other:".to_vec();
                expected.extend_from_slice(payload.as_bytes());
                assert_eq!(late_stream(payload.as_bytes()), expected);
            }
            // The first HTTP hand-off dials too (its pool is empty), and comes back: the POST goes
            // again, its body whole.
            let response = late_request(&post("/late-post", "sent again whole"));
            assert_eq!(response.status, 200);
            let seen = pods.other.seen();
            assert_eq!(seen.len(), 1, "{seen:?}");
            assert_eq!(seen[0].body, b"sent again whole");

            // Each stream's first dial, and the POST's, came back.
            assert_eq!(proxy.metric("lameduck_handoff_loops_total"), 7.0);
            app_untouched(&pods);
            // A loop is not a late connection: only the 7 clients' count.
            assert_eq!(handed_off(&proxy), 7.0);
            app_exited(&mut proxy);
        },
    );
}

/// A stream whose hand-off the other end resets before any byte comes back (a leaving pod that
/// refuses it, a proxy that takes it for its own loop) never reached an app: it is dialled
/// again, its first bytes sent again, and reaches the other pod.
#[test]
fn a_handoff_reset_before_any_answer_is_dialled_again() {
    in_netns("a_handoff_reset_before_any_answer_is_dialled_again", || {
        let (_pods, _dir, mut proxy) = late(Endpoints::ResettingFirst, "handoff-reset");
        for round in 0..4 {
            let payload = format!("stream {round}");
            let mut expected = b"other:".to_vec();
            expected.extend_from_slice(payload.as_bytes());
            assert_eq!(late_stream(payload.as_bytes()), expected);
        }
        assert_eq!(
            proxy.metric("lameduck_handoffs_total{protocol=\"tcp\"}"),
            4.0
        );
        let metrics = proxy.get("/metrics").body;
        assert!(
            !metrics.contains("lameduck_handoff_failures_total{protocol=\"tcp\"}"),
            "no hand-off failed: {metrics}"
        );
        app_exited(&mut proxy);
    });
}

/// One hop at most, and only what the Services configured take: a late request that another
/// leaving pod handed off already is answered 503 (marked refused, for that pod to draw
/// again), not handed on; a late connection to a pod port without a hand-off is reset; one
/// whose Service has no endpoint gets the proxy's 502, counted as a failed hand-off.
#[test]
fn a_late_connection_is_handed_off_once_and_only_where_configured() {
    in_netns(
        "a_late_connection_is_handed_off_once_and_only_where_configured",
        || {
            let (pods, _dir, mut proxy) = late(Endpoints::OtherOnly, "handoff-once");

            let response = late_request(
                b"GET /second-hop HTTP/1.1\r\nHost: app.local\r\nlameduck-handoff: 10.78.0.9\r\n\r\n",
            );
            assert_eq!(response.status, 503);
            assert_eq!(response.header("lameduck-handoff"), Some("refused"));

            let mut bare = TcpStream::connect(addr(POD, BARE_PORT)).unwrap();
            let (close, _) = wait_close(&mut bare, PATIENCE);
            assert_eq!(close, support::Close::Reset);

            // A Service port no endpoint serves: every dial refused, the request answered 502
            // by the proxy, and counted as a failed hand-off.
            let mut nowhere = send_raw(addr(POD, NOWHERE_PORT), &get("/nowhere"));
            let response = read_response(&mut nowhere).expect("an answer");
            assert_eq!(response.status, 502);
            assert_eq!(
                proxy.metric("lameduck_handoff_failures_total{protocol=\"http1\"}"),
                1.0
            );

            assert!(pods.other.seen_paths().is_empty());
            assert!(pods.app.seen_paths().is_empty());
            assert_eq!(
                proxy.metric(
                    "lameduck_late_connections_total{direction=\"inbound\",fate=\"refused\"}"
                ),
                1.0
            );
            app_exited(&mut proxy);
        },
    );
}

/// The mark is the proxies' own: a serving pod's proxy drops it, in the fast lane (a GET) and
/// in hyper's path (a POST), so that no app ever sees it.
#[test]
fn the_handoff_mark_never_reaches_an_app() {
    let app = Backend::start();
    let proxy = support::backend::proxy_for(&app, &[]);
    for request in [
        &b"GET /marked HTTP/1.1\r\nHost: app.local\r\nlameduck-handoff: 10.78.0.2\r\n\r\n"[..],
        &b"POST /marked HTTP/1.1\r\nHost: app.local\r\nLameduck-Handoff: 10.78.0.2\r\ncontent-length: 2\r\n\r\nhi"[..],
    ] {
        let mut stream = send_raw(proxy.inbound[0], request);
        assert_eq!(read_response(&mut stream).unwrap().status, 200);
    }
    let seen = app.seen();
    assert_eq!(seen.len(), 2);
    for request in seen {
        assert_eq!(request.header("lameduck-handoff"), None, "{request:?}");
    }
}
