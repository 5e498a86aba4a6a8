//! A pod goes away and no request is lost (docs/pod-lifecycle.md), end to end: the pod template
//! that `lameduck inject` writes is started and deleted the kubelet's way by real processes
//! (see `pod/kubelet.rs`), under load, while the app calls an upstream for every request. In
//! the explicit mode the load comes through the proxy's inbound port and the app calls out
//! through an outbound route; with interception (the default) peers in a namespace of their
//! own call the pod's IP and the app's port, the app calls the upstream's own address, and the
//! NAT rules of the pod's init container send both through the proxy.
//!
//! The load: keep-alive clients that keep their connections until the proxy asks them to go
//! away, and clients that open a new connection per request; both keep coming for two seconds
//! after the deletion (endpoints leave kube-proxy, ingresses and client pools slowly), then
//! only requests on connections already open are sent. A request fails when its client gets
//! anything but a 200, a refused connection while the pod was still an endpoint, or a
//! connection closed under it after the app saw it. A keep-alive connection closed before
//! any byte of a response, for a request the app never saw, is what every HTTP client retries
//! on a new connection: counted as retried, not failed.

#[path = "pod/kubelet.rs"]
#[allow(dead_code)]
mod kubelet;
mod support;
#[path = "pod/testapp.rs"]
mod testapp;

use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kubelet::{Deletion, NetNs, Pod, http_status};
use serde::Deserialize;
use support::backend::Backend;
use testapp::{Tally, images, status_of, upstream_ids};

const INBOUND: u16 = 4143;
/// The app's own init container, and the id of its one call to the upstream.
const APP_INIT: &str = "wait-for-upstream";
const APP_INIT_ID: u64 = 4242;
/// With interception: the pod's and its peer's addresses on the veth pair between them.
const POD_IP: [u8; 4] = [10, 79, 0, 2];
const PEER_IP: [u8; 4] = [10, 79, 0, 1];
const APP_PORT: u16 = 8080;
/// How long new connections keep coming after the deletion.
const ENDPOINT_PROPAGATION: Duration = Duration::from_secs(2);
const KEEP_ALIVE_CLIENTS: usize = 6;
const NEW_CONNECTION_CLIENTS: usize = 3;

fn here() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// What the test adds to `tests/pod/deployment.yaml` before injecting it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// Nothing.
    AsIs,
    /// An init container of the app's that calls the upstream before the app starts, as one
    /// waiting for its database would.
    AppInit,
    /// The app container's own preStop hook, an `httpGet` (which cannot run after another,
    /// so inject adds none of its own there) that takes 4 s to answer.
    AppHttpHook,
}

/// The injected pod spec of `tests/pod/deployment.yaml` with the app image `testapp:MODE`,
/// intercepted or in the explicit mode, with the test's `shape`.
fn injected_pod_spec(mode: &str, native: bool, intercept: bool, shape: Shape) -> serde_json::Value {
    let mut input = std::fs::read_to_string(here().join("tests/pod/deployment.yaml"))
        .unwrap()
        .replace("testapp:MODE", &format!("testapp:{mode}"));
    if intercept {
        input = input.replace(
            "lameduck.io/intercept: disabled",
            "lameduck.io/intercept: enabled",
        );
    }
    if shape == Shape::AppHttpHook {
        input = input.replace(
            "          securityContext:\n",
            "          lifecycle: {preStop: {httpGet: {path: '/hook-sleep?s=4', port: 8080}}}\n          securityContext:\n",
        );
    }
    if shape == Shape::AppInit {
        input = input.replace(
            "      containers:\n",
            &format!("      initContainers:\n        - {{name: {APP_INIT}, image: testapp:wait}}\n      containers:\n"),
        );
    }
    let args: &[&str] = if native {
        &[]
    } else {
        &["--native-sidecar=false"]
    };
    let (code, yaml, err) = support::inject(&input, args);
    assert_eq!(code, 0, "{err}");
    let document =
        serde_norway::Value::deserialize(serde_norway::Deserializer::from_str(&yaml)).unwrap();
    serde_json::to_value(document).unwrap()["spec"]["template"]["spec"].clone()
}

/// A pod ready to serve: where its peers run and call it, and its upstream.
struct Running {
    pod: Pod,
    upstream: Backend,
    /// The namespace the load runs in: the pod's own (explicit mode) or its peer's.
    peers: Arc<NetNs>,
    /// Where the load calls: the proxy's inbound port, or the pod's IP and the app's port.
    target: SocketAddr,
}

/// A pod ready to serve, or why it cannot run here.
fn running_pod(
    tag: &str,
    mode: &str,
    native: bool,
    intercept: bool,
    shape: Shape,
) -> Result<Running, &'static str> {
    if Command::new("python3").arg("--version").output().is_err() {
        return Err("no python3 for the test app");
    }
    if intercept
        && Command::new("iptables-nft")
            .arg("--version")
            .output()
            .is_err()
    {
        return Err("no iptables-nft for the pod's init container (Debian package iptables)");
    }
    let spec = injected_pod_spec(mode, native, intercept, shape);
    let mut pod = Pod::new(tag, spec, images())?;
    let (peers, target, upstream) = if intercept {
        // The pod's peers and its upstream, outside it as in a cluster; the app calls the
        // upstream's own address, and nothing in the spec is changed.
        let peers = Arc::new(
            NetNs::new(&format!("{tag}-peers"))
                .ok_or("cannot make a network namespace (needs root and ip(8))")?,
        );
        let pod_ip = SocketAddr::from((POD_IP, 0)).ip();
        let peer_ip = SocketAddr::from((PEER_IP, 0)).ip();
        support::netns::veth(
            &pod.netns,
            &peers,
            &format!("p{}", &tag[..1]),
            &[&format!("{pod_ip}/24")],
            &[&format!("{peer_ip}/24")],
        );
        let upstream = peers.run(move || Backend::start_on(SocketAddr::new(peer_ip, 0)));
        pod.add_env("app", "UPSTREAM", &upstream.addr.to_string());
        if shape == Shape::AppInit {
            pod.add_env(APP_INIT, "UPSTREAM", &upstream.addr.to_string());
            pod.add_env(APP_INIT, "ID", &APP_INIT_ID.to_string());
        }
        (peers, SocketAddr::new(pod_ip, APP_PORT), upstream)
    } else {
        // The upstream the app calls, outside the pod in a real cluster; here in its network
        // namespace on a port of its own. The outbound route to it is the test's one addition
        // to what inject wrote, as an operator would add it.
        let upstream = pod.netns.run(Backend::start);
        pod.add_env(
            "lameduck-proxy",
            "LAMEDUCK_OUTBOUND",
            &format!("127.0.0.1:4140={}", upstream.addr),
        );
        let target = SocketAddr::from(([127, 0, 0, 1], INBOUND));
        (pod.netns.clone(), target, upstream)
    };
    pod.start();
    let ready = peers.run(move || {
        let deadline = Instant::now() + support::PATIENCE;
        while Instant::now() < deadline {
            if status_of(target, "/work?id=ready") == Some(200) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    });
    assert!(ready, "the pod never served:\n{}", pod.timeline.text());
    Ok(Running {
        pod,
        upstream,
        peers,
        target,
    })
}

/// Clients inside the pod's network namespace, like the peers of a real pod.
struct Load {
    stop: Arc<AtomicBool>,
    deleted_at: Arc<Mutex<Option<Instant>>>,
    tally: Arc<Mutex<Tally>>,
    clients: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start(peers: &Arc<NetNs>, target: SocketAddr) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let deleted_at = Arc::new(Mutex::new(None));
        let tally = Arc::new(Mutex::new(Tally::default()));
        let ids = Arc::new(AtomicU64::new(1));
        let mut clients = Vec::new();
        for index in 0..KEEP_ALIVE_CLIENTS + NEW_CONNECTION_CLIENTS {
            let keep_alive = index < KEEP_ALIVE_CLIENTS;
            let (stop, deleted_at, tally, ids) =
                (stop.clone(), deleted_at.clone(), tally.clone(), ids.clone());
            clients.push(peers.spawn(move || {
                client(target, keep_alive, &stop, &deleted_at, &tally, &ids);
            }));
        }
        Load {
            stop,
            deleted_at,
            tally,
            clients,
        }
    }

    /// Waits (boundedly) until the load flows: as many requests answered as a few rounds of
    /// every client.
    fn flowing(&self) {
        let enough = 5 * (KEEP_ALIVE_CLIENTS + NEW_CONNECTION_CLIENTS);
        support::wait_until("the load flows", support::PATIENCE, || {
            self.tally.lock().unwrap().ok >= enough
        });
    }

    fn deleted(&self) {
        *self.deleted_at.lock().unwrap() = Some(Instant::now());
    }

    fn finish(self) -> Tally {
        self.stop.store(true, Ordering::SeqCst);
        for client in self.clients {
            client.join().unwrap();
        }
        Arc::try_unwrap(self.tally).unwrap().into_inner().unwrap()
    }
}

fn client(
    addr: SocketAddr,
    keep_alive: bool,
    stop: &AtomicBool,
    deleted_at: &Mutex<Option<Instant>>,
    tally: &Mutex<Tally>,
    ids: &AtomicU64,
) {
    let mut connection: Option<(TcpStream, bool)> = None;
    while !stop.load(Ordering::SeqCst) {
        let deleted = *deleted_at.lock().unwrap();
        let still_an_endpoint = deleted.is_none_or(|at| at.elapsed() < ENDPOINT_PROPAGATION);
        if connection.is_none() {
            if !still_an_endpoint {
                // The endpoint is gone: this client goes to other pods now.
                break;
            }
            match TcpStream::connect(addr) {
                Ok(stream) => {
                    stream
                        .set_read_timeout(Some(Duration::from_secs(30)))
                        .unwrap();
                    if deleted.is_some() {
                        tally.lock().unwrap().new_connections_after_deletion += 1;
                    }
                    connection = Some((stream, false));
                }
                Err(error) => {
                    tally
                        .lock()
                        .unwrap()
                        .failed
                        .push(format!("connect while still an endpoint: {error}"));
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
            }
        }
        let (stream, reused) = connection.as_mut().unwrap();
        let id = ids.fetch_add(1, Ordering::SeqCst);
        let answer = testapp::exchange(stream, id, keep_alive, *reused, false);
        let serves_on = tally.lock().unwrap().record(id, answer, deleted.is_some());
        match serves_on {
            true => *reused = true,
            false => connection = None,
        }
    }
}

/// Runs the load across a deletion, and checks what docs/pod-lifecycle.md promises.
fn delete_under_load(tag: &str, mode: &str, native: bool, intercept: bool) {
    let Running {
        mut pod,
        upstream,
        peers,
        target,
    } = match running_pod(tag, mode, native, intercept, Shape::AsIs) {
        Ok(running) => running,
        Err(why) => return support::skip(tag, why),
    };
    // The app container as its spec says (the hooks run the same way): another user than the
    // proxy's, no capabilities, a read-only root filesystem, the shared volume included.
    let (code, out) = pod.exec(
        "app",
        &[
            "sh",
            "-c",
            "id -u; grep CapBnd /proc/self/status; touch /tmp/lameduck-ro-check",
        ],
    );
    assert_ne!(code, Some(0), "the root filesystem is writable: {out}");
    assert!(
        out.starts_with("1000\n")
            && out.contains("CapBnd:\t0000000000000000")
            && out.contains("Read-only"),
        "{out}"
    );
    let load = Load::start(&peers, target);
    load.flowing();
    if intercept {
        // The load and the app's calls went through the proxy, not around it.
        let metrics = pod.netns.run(|| {
            support::http(
                SocketAddr::from(([127, 0, 0, 1], 4191)),
                "GET",
                "/metrics",
                &[],
            )
            .body
        });
        for direction in ["inbound", "outbound"] {
            let sample = format!(
                "lameduck_connections_total{{direction=\"{direction}\",protocol=\"http1\"}} "
            );
            let count: f64 = metrics
                .lines()
                .find_map(|line| line.strip_prefix(&sample))
                .and_then(|value| value.trim().parse().ok())
                .unwrap_or(0.0);
            assert!(
                count > 0.0,
                "{tag}: no {direction} connection through the proxy:\n{metrics}"
            );
        }
    }
    load.deleted();
    let deletion = pod.delete();
    let tally = load.finish();
    let timeline = pod.timeline.text();
    let report = report(&tally, &deletion);
    eprintln!("{tag}: {report}\n{timeline}");

    assert!(
        tally.failed.is_empty(),
        "{tag}: failed requests (the first 10 of {}): {:?}\n{report}\n{timeline}",
        tally.failed.len(),
        &tally.failed[..tally.failed.len().min(10)]
    );
    let unanswered: Vec<_> = upstream_ids(&upstream)
        .into_iter()
        .filter(|id| !tally.answered.contains(id))
        .collect();
    assert!(
        unanswered.is_empty(),
        "{tag}: the app served requests whose client got no response: {unanswered:?}"
    );
    assert!(
        tally.ok_after_deletion > 0 && tally.new_connections_after_deletion > 0,
        "{tag}: the load did not go on after the deletion: {report}"
    );
    assert!(
        deletion.killed.is_empty(),
        "{tag}: SIGKILLed: {report}\n{timeline}"
    );
    // The hook waited for the inbound drain and said so; the app was signalled after it.
    let (_, hook_took, hook_code) = deletion
        .hooks
        .iter()
        .find(|(name, _, _)| name == "app")
        .expect("the app's preStop hook ran");
    assert_eq!(*hook_code, Some(0), "{tag}: {timeline}");
    assert!(timeline.contains("ok inbound drained"), "{tag}: {timeline}");
    let prestop_ended = pod.timeline.when("preStop hook of app ended").unwrap();
    let app_signalled = pod.timeline.when("SIGTERM to app").unwrap();
    assert!(prestop_ended <= app_signalled);
    assert!(
        *hook_took >= Duration::from_secs(2),
        "{tag}: the hook returned after {hook_took:?}, within the lame-duck period"
    );
    // The proxy was signalled last (legacy mode: its own preStop hook waited for the app to
    // exit), and went at once; everything exited cleanly.
    let order: Vec<&str> = deletion
        .exits
        .iter()
        .map(|(name, _, _)| name.as_str())
        .collect();
    assert_eq!(order, ["app", "lameduck-proxy"], "{tag}");
    for (name, _, status) in &deletion.exits {
        assert_eq!(status.code(), Some(0), "{tag}: {name}: {timeline}");
    }
    let proxy_signalled = pod.timeline.when("SIGTERM to lameduck-proxy").unwrap();
    let proxy_exited = pod
        .timeline
        .when("container lameduck-proxy exited")
        .unwrap();
    assert!(
        proxy_exited - proxy_signalled < Duration::from_secs(1),
        "{tag}: the proxy took {:?} after its SIGTERM",
        proxy_exited - proxy_signalled
    );
    // What `kubectl describe pod` shows of the proxy's exit: its termination message.
    let message = pod.termination_message("lameduck-proxy");
    assert!(
        message.starts_with("lameduck: shutdown by SIGTERM: drained in ")
            && message.contains("; lame duck "),
        "{tag}: the proxy's termination message: {message:?}\n{timeline}"
    );
    if mode == "graceful" {
        // Its last call went through the outbound route during its own shutdown.
        assert!(
            upstream.seen().iter().any(|seen| seen.path == "/flush"),
            "{tag}: {timeline}"
        );
    }
}

fn report(tally: &Tally, deletion: &Deletion) -> String {
    format!(
        "{} requests answered ({} after the deletion, {} new connections after it), {} retried \
         on a new connection, {} failed; preStop hook {:?}; exits {:?}; deletion took {:?}",
        tally.ok,
        tally.ok_after_deletion,
        tally.new_connections_after_deletion,
        tally.retried,
        tally.failed.len(),
        deletion.hooks,
        deletion
            .exits
            .iter()
            .map(|(name, at, status)| format!("{name} at {at:?} ({status})"))
            .collect::<Vec<_>>(),
        deletion.took
    )
}

#[test]
fn deleting_a_pod_under_load_loses_no_request_with_a_graceful_app() {
    delete_under_load("graceful", "graceful", true, false);
}

#[test]
fn deleting_a_pod_under_load_loses_no_request_with_an_app_that_exits_at_once() {
    delete_under_load("immediate", "immediate", true, false);
}

/// Legacy mode: the proxy is an ordinary container, and the kubelet runs its preStop hook and
/// signals it at t = 0 with the app. Its hook quiesces the inbound side and then waits until
/// the app container has exited (its holder, started by the app's postStart hook, dies with
/// it), so the outbound side stays open for the app's own shutdown.
#[test]
fn deleting_a_legacy_pod_under_load_loses_no_request_and_keeps_outbound_for_the_app() {
    delete_under_load("legacy", "graceful", false, false);
}

/// With interception (inject's default): the NAT rules of the pod's init container send the
/// peers' calls and the app's own calls through the proxy, and the deletion keeps its promise:
/// inbound quiesced first, outbound open until the app has exited.
#[test]
fn deleting_an_intercepted_pod_under_load_loses_no_request() {
    delete_under_load("intercepted", "graceful", true, true);
}

/// A preStop hook also runs before the kubelet restarts a container whose liveness probe
/// failed; no SIGTERM reaches the proxy then, and inbound must serve again once the app is
/// back (its postStart hook).
#[test]
fn a_restarted_app_container_is_served_again() {
    let Running {
        mut pod, upstream, ..
    } = match running_pod("restart", "graceful", true, false, Shape::AsIs) {
        Ok(running) => running,
        Err(why) => return support::skip("a_restarted_app_container_is_served_again", why),
    };
    for round in 1..=2 {
        let code = pod.restart("app");
        assert_eq!(code, Some(0), "round {round}:\n{}", pod.timeline.text());
        let served = pod.netns.run(move || {
            let deadline = Instant::now() + support::PATIENCE;
            while Instant::now() < deadline {
                if http_status(INBOUND, &format!("/work?id={}", 1_000_000 + round)) == Some(200)
                    && http_status(4191, "/ready") == Some(200)
                {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            false
        });
        assert!(
            served,
            "round {round}: not served again:\n{}",
            pod.timeline.text()
        );
    }
    assert!(upstream_ids(&upstream).contains(&1_000_002));
    let deletion = pod.delete();
    assert!(deletion.killed.is_empty(), "{}", pod.timeline.text());
}

/// Legacy mode has no proxy before the app containers: an init container of the app's that
/// calls out (waiting for a dependency) reaches its upstream directly and the pod starts,
/// where NAT rules installed first would send its connection to a port nobody listens on yet
/// and leave the pod in Init. Then the app's own traffic goes through the proxy as usual.
#[test]
fn a_legacy_intercepted_pods_init_containers_reach_the_network() {
    let test = "a_legacy_intercepted_pods_init_containers_reach_the_network";
    let Running {
        mut pod,
        upstream,
        peers,
        target,
    } = match running_pod("legacyinit", "graceful", false, true, Shape::AppInit) {
        Ok(running) => running,
        Err(why) => return support::skip(test, why),
    };
    let timeline = pod.timeline.text();
    assert!(upstream_ids(&upstream).contains(&APP_INIT_ID), "{timeline}");
    let ended = |name: &str| {
        let needle = format!("init container {name} ended");
        pod.timeline
            .when(&needle)
            .unwrap_or_else(|| panic!("{needle}?\n{timeline}"))
    };
    assert!(
        ended(APP_INIT) < ended("lameduck-init"),
        "the NAT rules came first:\n{timeline}"
    );
    assert_eq!(
        peers.run(move || status_of(target, "/work?id=77")),
        Some(200)
    );
    assert!(upstream_ids(&upstream).contains(&77), "{timeline}");
    let deletion = pod.delete();
    assert!(deletion.killed.is_empty(), "{}", pod.timeline.text());
}

/// An app container whose own preStop hook is an `httpGet` (the app's own wait, 4 s here) has
/// no room for lameduck's, and the kubelet signals it when its hook returns. The proxy's own
/// preStop hook, which the kubelet runs at the start of the pod's termination, quiesces the
/// inbound side meanwhile: the lame duck and the drain happen before the app's SIGTERM, and
/// no request is lost.
#[test]
fn the_proxys_own_prestop_starts_the_lame_duck_when_the_apps_hook_is_not_ours() {
    let tag = "httphook";
    let Running {
        mut pod,
        upstream,
        peers,
        target,
    } = match running_pod(tag, "graceful", true, false, Shape::AppHttpHook) {
        Ok(running) => running,
        Err(why) => return support::skip(tag, why),
    };
    let load = Load::start(&peers, target);
    load.flowing();
    load.deleted();
    let deletion = pod.delete();
    let tally = load.finish();
    let timeline = pod.timeline.text();
    let report = report(&tally, &deletion);
    assert!(
        tally.failed.is_empty(),
        "{tag}: failed requests (the first 10 of {}): {:?}\n{report}\n{timeline}",
        tally.failed.len(),
        &tally.failed[..tally.failed.len().min(10)]
    );
    assert!(tally.ok_after_deletion > 0, "{tag}: {report}");
    let unanswered: Vec<_> = upstream_ids(&upstream)
        .into_iter()
        .filter(|id| !tally.answered.contains(id))
        .collect();
    assert!(unanswered.is_empty(), "{tag}: {unanswered:?}\n{timeline}");
    let when = |what: &str| {
        pod.timeline
            .when(what)
            .unwrap_or_else(|| panic!("{what}?\n{timeline}"))
    };
    assert!(timeline.contains("ok inbound drained"), "{tag}: {timeline}");
    assert!(
        when("preStop hook of lameduck-proxy ended") <= when("SIGTERM to app"),
        "{tag}: the app was signalled before the inbound drain ended:\n{timeline}"
    );
    assert!(deletion.killed.is_empty(), "{tag}: {report}\n{timeline}");
}
