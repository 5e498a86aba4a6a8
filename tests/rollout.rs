//! A rolling update behind a Service, played with real processes (docs/pod-lifecycle.md, "The
//! lame duck"): no request is lost however long the cluster takes to forget a deleted pod.
//!
//! - A "node": a network namespace with a bridge; every pod (the kubelet simulation of
//!   `pod/kubelet.rs`, inject's default spec: interception on) in a namespace of its own behind
//!   a veth on that bridge, the node as its default route.
//! - A ClusterIP Service as kube-proxy's iptables mode makes it, in the node's `nat` table: a
//!   DNAT per endpoint chosen with `-m statistic --mode random`, conntrack keeping existing
//!   flows on their pod while new ones follow the rules of the moment. A pod becomes an
//!   endpoint once it is ready; a deleted one stops being one a propagation delay P after its
//!   deletion started (or, when it is stopped without deletion, once its readiness has failed
//!   twice, 2 s apart, and P more).
//! - Clients in a namespace of their own call the ClusterIP: HTTP/1.1 on keep-alive
//!   connections, and on a new connection per request. A request fails when its client gets
//!   anything but a 200, cannot connect, or loses a connection under a request the app saw; a
//!   keep-alive connection closed before any byte of its response, for a request the app never
//!   saw, is retried on a new connection, as every HTTP client does.
//! - A Deployment of 3 replicas rolled from one version to the next, maxSurge 1,
//!   maxUnavailable 0: a new pod, ready, an endpoint; then an old pod deleted; and so on.
//!
//! One test per profile, each in namespaces and addresses of its own. The same rollout without
//! the proxy must lose requests: the harness checks itself.

#[path = "pod/kubelet.rs"]
#[allow(dead_code)]
mod kubelet;
mod support;
#[path = "pod/testapp.rs"]
mod testapp;

use std::collections::HashMap;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use kubelet::{Image, NetNs, Pod};
use serde::Deserialize;
use support::BIN;
use support::backend::Backend;
use testapp::{Answer, Tally, status_of, upstream_ids};

const REPLICAS: usize = 3;
const APP_PORT: u16 = 8080;
/// The pod's HTTP/2 app (a relay to the upstream, which speaks HTTP/2: the proxy keeps the
/// client's HTTP version towards the app), behind the Service's second port.
const H2_APP_PORT: u16 = 8081;
const KEEP_ALIVE_CLIENTS: usize = 4;
const NEW_CONNECTION_CLIENTS: usize = 2;
const H2_CLIENTS: usize = 2;
/// Between two requests of one client: about 250 requests a second in all.
const PACE: Duration = Duration::from_millis(20);

/// The workload: the pod test's app, with room in its grace budget for a lame duck longer
/// than the slowest propagation profiled here.
const DEPLOYMENT: &str = "\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: shop
spec:
  selector:
    matchLabels: {app: shop}
  template:
    metadata:
      labels: {app: shop}
    spec:
      terminationGracePeriodSeconds: 60
      containers:
        - name: app
          image: testapp:MODE
          ports:
            - containerPort: 8080
        - name: app-h2
          image: testapp:relay
          ports:
            - containerPort: 8081
";

/// How a profile's pods go away, and with what.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Profile {
    /// How long the endpoints keep a deleted pod.
    propagation: Duration,
    /// `graceful` or `immediate` (exits at once on SIGTERM).
    app: &'static str,
    /// Stopped without deletion (graceful node shutdown): the endpoint goes when readiness
    /// fails.
    without_deletion: bool,
    /// lameduck injected (false: the harness's own check that it can see losses).
    meshed: bool,
    /// Annotations of the pod template (`{a: b, …}` flow style), besides none.
    annotations: &'static str,
    /// Who calls the Service.
    caller: Caller,
}

/// Who calls the Service.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Caller {
    /// Clients in a namespace of their own, straight to the ClusterIP.
    Direct,
    /// Clients inside a meshed pod: their calls go through its own lameduck (interception on),
    /// with outbound retries on or off; half of them POST.
    Meshed { retries: bool },
}

/// The caller pod's index (its address), never an endpoint of the Service.
const CALLER_INDEX: usize = 20;

/// The node, the clients' namespace and the Service of one profile.
struct Cluster {
    tag: String,
    /// The profile's own second octet block: pods in 10.(100+k).0.0/24, clients in
    /// 10.(110+k).0.0/24, the ClusterIP 10.96.k.10.
    k: u8,
    node: Arc<NetNs>,
    clients: Arc<NetNs>,
    service: SocketAddr,
    upstream: Backend,
    endpoints: Mutex<Vec<Ipv4Addr>>,
}

fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Cluster {
    fn new(tag: &str, k: u8) -> Result<Cluster, &'static str> {
        let node = Arc::new(NetNs::new(&format!("{tag}-node")).ok_or("no network namespaces")?);
        let clients =
            Arc::new(NetNs::new(&format!("{tag}-clients")).ok_or("no network namespaces")?);
        let node_ip = format!("10.{}.0.1", 100 + k);
        let n = node.name();
        sh(&["ip", "-n", n, "link", "add", "br0", "type", "bridge"]);
        sh(&[
            "ip",
            "-n",
            n,
            "addr",
            "add",
            &format!("{node_ip}/24"),
            "dev",
            "br0",
        ]);
        sh(&["ip", "-n", n, "link", "set", "br0", "up"]);
        // The node routes between the clients and the pods (no sysctl(8) needed: /proc/sys/net
        // is the writing thread's namespace's).
        node.run(|| std::fs::write("/proc/sys/net/ipv4/ip_forward", "1"))
            .expect("ip_forward in the node's namespace");
        let client_net = 110 + k;
        support::netns::veth(
            &clients,
            &node,
            &format!("c{k}"),
            &[&format!("10.{client_net}.0.2/24")],
            &[&format!("10.{client_net}.0.1/24")],
        );
        sh(&[
            "ip",
            "-n",
            clients.name(),
            "route",
            "add",
            "default",
            "via",
            &format!("10.{client_net}.0.1"),
        ]);
        let service = SocketAddr::from(([10, 96, k, 10], 80));
        let rules = format!(
            "*nat\n:LAMEDUCK-SVC - [0:0]\n:LAMEDUCK-SVC2 - [0:0]\n\
             -A PREROUTING -d {ip}/32 -p tcp --dport 80 -j LAMEDUCK-SVC\n\
             -A PREROUTING -d {ip}/32 -p tcp --dport 81 -j LAMEDUCK-SVC2\nCOMMIT\n",
            ip = service.ip()
        );
        restore(&node, &rules)?;
        let upstream_addr: SocketAddr = format!("{node_ip}:0").parse().unwrap();
        let upstream = node.run(move || Backend::start_on(upstream_addr));
        Ok(Cluster {
            tag: tag.into(),
            k,
            node,
            clients,
            service,
            upstream,
            endpoints: Mutex::new(Vec::new()),
        })
    }

    fn pod_ip(&self, index: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 100 + self.k, 0, 10 + index as u8)
    }

    /// kube-proxy's rules for the endpoints of the moment, replaced in one restore.
    fn sync(&self, endpoints: &[Ipv4Addr]) {
        let mut rules = String::from("*nat\n");
        for (chain, port) in [("LAMEDUCK-SVC", APP_PORT), ("LAMEDUCK-SVC2", H2_APP_PORT)] {
            rules.push_str(&format!(":{chain} - [0:0]\n-F {chain}\n"));
            for (index, ip) in endpoints.iter().enumerate() {
                let left = endpoints.len() - index;
                let chance = if left > 1 {
                    format!(
                        "-m statistic --mode random --probability {:.5} ",
                        1.0 / left as f64
                    )
                } else {
                    String::new()
                };
                rules.push_str(&format!(
                    "-A {chain} -p tcp {chance}-j DNAT --to-destination {ip}:{port}\n"
                ));
            }
        }
        rules.push_str("COMMIT\n");
        restore(&self.node, &rules).expect("kube-proxy's rules");
    }

    fn add_endpoint(&self, ip: Ipv4Addr) {
        let mut endpoints = self.endpoints.lock().unwrap();
        endpoints.push(ip);
        self.sync(&endpoints);
    }

    fn remove_endpoint(&self, ip: Ipv4Addr) {
        let mut endpoints = self.endpoints.lock().unwrap();
        endpoints.retain(|endpoint| *endpoint != ip);
        self.sync(&endpoints);
    }

    /// A pod of version `version`, started and ready (an endpoint is the caller's to add), its
    /// proxy's environment extended by `proxy_env`.
    fn start_pod(&self, index: usize, profile: Profile, proxy_env: &[(&str, &str)]) -> Pod {
        let mut input = DEPLOYMENT.replace("testapp:MODE", &format!("testapp:{}", profile.app));
        if !profile.annotations.is_empty() {
            input = input.replace(
                "      labels: {app: shop}\n    spec:",
                &format!(
                    "      labels: {{app: shop}}\n      annotations: {}\n    spec:",
                    profile.annotations
                ),
            );
        }
        if !profile.meshed {
            // Without the proxy the graceful app's keep-alive clients would hold its
            // shutdown up to the grace period; a short one keeps the check quick.
            input = input.replace(
                "terminationGracePeriodSeconds: 60",
                "terminationGracePeriodSeconds: 5",
            );
        }
        let spec = if profile.meshed {
            let (code, yaml, err) = support::inject(&input, &[]);
            assert_eq!(code, 0, "{err}");
            let document =
                serde_norway::Value::deserialize(serde_norway::Deserializer::from_str(&yaml))
                    .unwrap();
            serde_json::to_value(document).unwrap()["spec"]["template"]["spec"].clone()
        } else {
            let document =
                serde_norway::Value::deserialize(serde_norway::Deserializer::from_str(&input))
                    .unwrap();
            serde_json::to_value(document).unwrap()["spec"]["template"]["spec"].clone()
        };
        let tag = format!("{}{index}", self.tag);
        let mut pod = Pod::new(&tag, spec, images(self.upstream.addr)).expect("a pod");
        let ip = self.pod_ip(index);
        let link = format!("p{}{index}", self.k);
        support::netns::veth(&pod.netns, &self.node, &link, &[&format!("{ip}/24")], &[]);
        let node_end = format!("{link}b{}", std::process::id() % 100_000);
        sh(&[
            "ip",
            "-n",
            self.node.name(),
            "link",
            "set",
            &node_end,
            "master",
            "br0",
        ]);
        sh(&[
            "ip",
            "-n",
            pod.netns.name(),
            "route",
            "add",
            "default",
            "via",
            &format!("10.{}.0.1", 100 + self.k),
        ]);
        pod.add_env("app", "UPSTREAM", &self.upstream.addr.to_string());
        for (name, value) in proxy_env {
            pod.add_env("lameduck-proxy", name, value);
        }
        pod.start();
        let target = SocketAddr::from((ip, APP_PORT));
        let h2_target = SocketAddr::from((ip, H2_APP_PORT));
        self.node.run(move || {
            support::wait_until("the pod serves", support::PATIENCE, || {
                status_of(target, "/work?id=0") == Some(200)
                    && status_of(h2_target, "/work?id=0") == Some(200)
            });
        });
        pod
    }
}

/// `iptables-nft-restore --noflush` in `netns`.
fn restore(netns: &NetNs, rules: &str) -> Result<(), &'static str> {
    let mut child = Command::new("ip")
        .args([
            "netns",
            "exec",
            netns.name(),
            "iptables-nft-restore",
            "--noflush",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|_| "no iptables-nft-restore (Debian package iptables)")?;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(rules.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    if !out.status.success() {
        panic!("{rules}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// The pod test's images, and the HTTP/2 app: a lameduck relaying to the upstream.
fn images(upstream: SocketAddr) -> HashMap<String, Image> {
    let mut images = testapp::images();
    images.insert(
        "testapp:relay".into(),
        Image {
            entrypoint: [
                "/usr/local/bin/lameduck",
                "--inbound",
                &format!("0.0.0.0:{H2_APP_PORT}={upstream}"),
                "--admin",
                "127.0.0.1:9191",
                "--shutdown-grace-period",
                "20s",
            ]
            .map(String::from)
            .to_vec(),
            files: vec![("/usr/local/bin/lameduck".into(), BIN.into())],
        },
    );
    images
}

/// One client of the Service: requests until `stop`, on one keep-alive connection at a time,
/// or a new connection per request.
fn client(
    service: SocketAddr,
    keep_alive: bool,
    post: bool,
    stop: &AtomicBool,
    tally: &Mutex<Tally>,
    ids: &AtomicU64,
) {
    let mut connection: Option<(TcpStream, bool)> = None;
    while !stop.load(Ordering::SeqCst) {
        thread::sleep(PACE);
        if connection.is_none() {
            match TcpStream::connect_timeout(&service, Duration::from_secs(2)) {
                Ok(stream) => {
                    stream
                        .set_read_timeout(Some(Duration::from_secs(30)))
                        .unwrap();
                    connection = Some((stream, false));
                }
                Err(error) => {
                    tally
                        .lock()
                        .unwrap()
                        .failed
                        .push(format!("connect: {error}"));
                    continue;
                }
            }
        }
        let (stream, reused) = connection.as_mut().unwrap();
        let id = ids.fetch_add(1, Ordering::SeqCst);
        let answer = testapp::exchange(stream, id, keep_alive, *reused, post);
        match tally.lock().unwrap().record(id, answer, false) {
            true => *reused = true,
            false => connection = None,
        }
    }
}

/// An HTTP/2 client of the Service, as gRPC's or Go's: one connection at a time, requests on
/// it until it ends; a request the connection's end (a GOAWAY above it, a reset) took is sent
/// again on a new connection, which is right only if the app never saw it (checked against
/// the upstream's record afterwards, as for HTTP/1).
fn h2_client(service: SocketAddr, stop: &AtomicBool, tally: &Mutex<Tally>, ids: &AtomicU64) {
    use http_body_util::{BodyExt, Empty};
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut sender: Option<hyper::client::conn::http2::SendRequest<Empty<bytes::Bytes>>> = None;
        while !stop.load(Ordering::SeqCst) {
            tokio::time::sleep(PACE).await;
            if sender.as_ref().is_none_or(|sender| sender.is_closed()) {
                let connect = tokio::net::TcpStream::connect(service);
                let stream = match tokio::time::timeout(Duration::from_secs(2), connect).await {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(error)) => {
                        let failure = format!("h2 connect: {error}");
                        tally.lock().unwrap().failed.push(failure);
                        continue;
                    }
                    Err(_) => {
                        let failure = "h2 connect: timed out".to_string();
                        tally.lock().unwrap().failed.push(failure);
                        continue;
                    }
                };
                let io = TokioIo::new(stream);
                match hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await {
                    Ok((handle, connection)) => {
                        tokio::spawn(connection);
                        sender = Some(handle);
                    }
                    Err(error) => {
                        let failure = format!("h2 handshake: {error}");
                        tally.lock().unwrap().failed.push(failure);
                        continue;
                    }
                }
            }
            let id = ids.fetch_add(1, Ordering::SeqCst);
            let request = hyper::Request::get(format!("http://{service}/work?id={id}"))
                .body(Empty::new())
                .unwrap();
            let handle = sender.as_mut().expect("connected above");
            let response = match handle.send_request(request).await {
                Ok(response) => {
                    let status = response.status().as_u16();
                    response.into_body().collect().await.map(|_| status)
                }
                Err(error) => Err(error),
            };
            let answer = match response {
                Ok(200) => Answer::Ok { closing: false },
                Ok(status) => Answer::Failed(format!("h2 id {id}: {status}")),
                Err(_) => Answer::Retry,
            };
            let mut tally = tally.lock().unwrap();
            tally.ok_h2 += usize::from(matches!(answer, Answer::Ok { .. }));
            if !tally.record(id, answer, false) {
                sender = None;
            }
        }
    });
}

/// Rolls 3 replicas from one version to the next under load; returns what the clients saw,
/// and each old pod's lame duck as its proxy logged it.
fn rollout(tag: &str, k: u8, profile: Profile) -> Option<Run> {
    if Command::new("python3").arg("--version").output().is_err() {
        support::skip(tag, "no python3 for the test app");
        return None;
    }
    let cluster = match Cluster::new(tag, k) {
        Ok(cluster) => Arc::new(cluster),
        Err(why) => {
            support::skip(tag, why);
            return None;
        }
    };
    let mut old: Vec<(usize, Pod)> = Vec::new();
    for index in 0..REPLICAS {
        let pod = cluster.start_pod(index, profile, &[]);
        cluster.add_endpoint(cluster.pod_ip(index));
        old.push((index, pod));
    }
    // A meshed caller: its clients run in its network namespace, where its lameduck intercepts
    // their calls (only the proxy's own uid is left alone).
    let caller = match profile.caller {
        Caller::Direct => None,
        Caller::Meshed { retries } => {
            let env: &[(&str, &str)] = match retries {
                true => &[],
                false => &[("LAMEDUCK_HTTP_RETRIES", "false")],
            };
            let meshed = Profile {
                meshed: true,
                app: "graceful",
                ..profile
            };
            Some(cluster.start_pod(CALLER_INDEX, meshed, env))
        }
    };
    let client_netns = match &caller {
        Some(pod) => pod.netns.clone(),
        None => cluster.clients.clone(),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let posts = Arc::new(Mutex::new(Tally::default()));
    let ids = Arc::new(AtomicU64::new(1));
    let mut clients: Vec<_> = (0..KEEP_ALIVE_CLIENTS + NEW_CONNECTION_CLIENTS)
        .map(|index| {
            // Behind a meshed caller every other client POSTs.
            let post = caller.is_some() && index % 2 == 1;
            let tally = match post {
                true => posts.clone(),
                false => tally.clone(),
            };
            let (stop, ids) = (stop.clone(), ids.clone());
            let service = cluster.service;
            let keep_alive = index < KEEP_ALIVE_CLIENTS;
            client_netns.spawn(move || client(service, keep_alive, post, &stop, &tally, &ids))
        })
        .collect();
    if profile.meshed && caller.is_none() {
        for _ in 0..H2_CLIENTS {
            let (stop, tally, ids) = (stop.clone(), tally.clone(), ids.clone());
            let service = SocketAddr::new(cluster.service.ip(), 81);
            clients.push(
                cluster
                    .clients
                    .spawn(move || h2_client(service, &stop, &tally, &ids)),
            );
        }
    }
    support::wait_until("the load flows", support::PATIENCE, || {
        tally.lock().unwrap().ok >= 50
    });
    let started = Instant::now();
    let mut deletions = Vec::new();
    let mut new_pods = Vec::new();
    for (step, (index, pod)) in old.into_iter().enumerate() {
        let fresh = REPLICAS + step;
        let pod_new = cluster.start_pod(fresh, profile, &[]);
        cluster.add_endpoint(cluster.pod_ip(fresh));
        new_pods.push(pod_new);
        let cluster = cluster.clone();
        deletions.push(thread::spawn(move || {
            let mut pod = pod;
            let ip = cluster.pod_ip(index);
            // The endpoints controller and kube-proxy, P behind.
            let forget = {
                let cluster = cluster.clone();
                thread::spawn(move || {
                    if profile.without_deletion {
                        // The endpoint stays until readiness fails twice, 2 s apart.
                        let admin = SocketAddr::from((ip, 4191));
                        let mut failures = 0;
                        while failures < 2 {
                            thread::sleep(Duration::from_secs(2));
                            let status = cluster.node.run(move || status_of(admin, "/ready"));
                            failures = if status == Some(200) { 0 } else { failures + 1 };
                        }
                    }
                    thread::sleep(profile.propagation);
                    cluster.remove_endpoint(ip);
                })
            };
            let deletion = pod.delete();
            forget.join().unwrap();
            // How long its lame duck lasted, as its proxy logged it.
            let lame_ducks: Vec<u64> = pod
                .timeline
                .text()
                .lines()
                .filter(|line| line.contains("lame duck over"))
                .filter_map(|line| {
                    line.split("lasted_ms=")
                        .nth(1)?
                        .split(' ')
                        .next()?
                        .parse()
                        .ok()
                })
                .collect();
            assert!(
                deletion.killed.is_empty() || !profile.meshed,
                "{}",
                pod.timeline.text()
            );
            lame_ducks
        }));
        // maxSurge 1: the next new pod once this old one is terminating.
    }
    let mut lame_ducks = Vec::new();
    for deletion in deletions {
        lame_ducks.extend(deletion.join().unwrap());
    }
    let took = started.elapsed();
    thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::SeqCst);
    for client in clients {
        client.join().unwrap();
    }
    drop(new_pods);
    let mut tally = Arc::try_unwrap(tally).unwrap().into_inner().unwrap();
    // A retried request must be one the app never saw.
    let seen = upstream_ids(&cluster.upstream);
    let lost: Vec<u64> = tally
        .retried_ids
        .iter()
        .filter(|id| seen.contains(id))
        .copied()
        .collect();
    for id in lost {
        tally
            .failed
            .push(format!("id {id}: the app saw it, its client got no answer"));
    }
    eprintln!(
        "{tag}: P = {:?}, app {}{}{}: {} answered ({} over HTTP/2), {} retried, {} failed; \
         rollout {:.1} s; lame ducks {lame_ducks:?} ms",
        profile.propagation,
        profile.app,
        if profile.without_deletion {
            ", stopped without deletion"
        } else {
            ""
        },
        if profile.annotations.is_empty() {
            String::new()
        } else {
            format!(", {}", profile.annotations)
        },
        tally.ok,
        tally.ok_h2,
        tally.retried,
        tally.failed.len(),
        took.as_secs_f64()
    );
    let posts = Arc::try_unwrap(posts).unwrap().into_inner().unwrap();
    // A failed POST is right only if the app saw it (it may have acted on it).
    let posts_unreached: Vec<String> = posts
        .failed
        .iter()
        .filter(|why| {
            why.strip_prefix("id ")
                .and_then(|rest| rest.split(':').next()?.parse::<u64>().ok())
                .is_none_or(|id| !seen.contains(&id))
        })
        .cloned()
        .collect();
    // The caller's retries, from its proxy's metrics.
    let retried = caller.as_ref().map(|_| {
        let admin = SocketAddr::from((cluster.pod_ip(CALLER_INDEX), 4191));
        let metrics = cluster
            .node
            .run(move || support::http(admin, "GET", "/metrics", &[]).body);
        let sum = |outcome: &str| -> f64 {
            metrics
                .lines()
                .filter(|line| {
                    line.starts_with("lameduck_http_retries_total{")
                        && line.contains(&format!("outcome=\"{outcome}\""))
                })
                .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
                .fold(0.0, |total, value| total + value)
        };
        (sum("retried"), sum("budget_exhausted"))
    });
    if let Some((retried, exhausted)) = retried {
        eprintln!(
            "{tag}: meshed caller: {} POSTs answered, {} failed ({} never reached a callee); \
             its proxy retried {retried} requests, {exhausted} over the budget",
            posts.ok,
            posts.failed.len(),
            posts_unreached.len()
        );
    }
    drop(caller);
    Some(Run {
        tally,
        posts,
        posts_unreached,
        retried,
        lame_ducks,
    })
}

/// What one rollout's clients saw.
struct Run {
    /// The GETs (all requests, without a meshed caller).
    tally: Tally,
    /// A meshed caller's POSTs.
    posts: Tally,
    /// Of the failed POSTs, those the app never saw.
    posts_unreached: Vec<String>,
    /// A meshed caller's proxy: requests retried, and refused a retry by the budget.
    retried: Option<(f64, f64)>,
    /// Each old pod's lame duck, as its proxy logged it.
    lame_ducks: Vec<u64>,
}

fn profile(propagation_ms: u64, app: &'static str) -> Profile {
    Profile {
        propagation: Duration::from_millis(propagation_ms),
        app,
        without_deletion: false,
        meshed: true,
        annotations: "",
        caller: Caller::Direct,
    }
}

/// The rollout of `profile` loses no request, over HTTP/1.1 and HTTP/2, and each old pod's
/// proxy ran its lame duck.
fn zero_loss(tag: &str, k: u8, profile: Profile) {
    let Some(Run {
        tally, lame_ducks, ..
    }) = rollout(tag, k, profile)
    else {
        return;
    };
    assert!(
        tally.failed.is_empty(),
        "{tag}: {} failed (the first 10: {:?})",
        tally.failed.len(),
        &tally.failed[..tally.failed.len().min(10)]
    );
    assert!(tally.ok > 500, "{tag}: only {} answered", tally.ok);
    assert!(tally.ok_h2 > 100, "{tag}: only {} over HTTP/2", tally.ok_h2);
    assert_eq!(lame_ducks.len(), REPLICAS, "{tag}: {lame_ducks:?}");
}

#[test]
fn rollout_loses_nothing_when_endpoints_forget_in_half_a_second() {
    zero_loss("ro05", 1, profile(500, "graceful"));
}

#[test]
fn rollout_loses_nothing_when_endpoints_forget_in_two_seconds_app_exits_at_once() {
    zero_loss("ro2i", 2, profile(2_000, "immediate"));
}

#[test]
fn rollout_loses_nothing_when_endpoints_forget_in_ten_seconds() {
    zero_loss("ro10", 3, profile(10_000, "graceful"));
}

#[test]
fn rollout_loses_nothing_when_endpoints_forget_in_ten_seconds_app_exits_at_once() {
    zero_loss("ro1i", 6, profile(10_000, "immediate"));
}

/// Graceful node shutdown and some evictions stop a pod without deleting it: its endpoint goes
/// only once its readiness has failed (twice, 2 s apart), then P.
#[test]
fn pods_stopped_without_deletion_lose_nothing() {
    let mut stopped = profile(500, "graceful");
    stopped.without_deletion = true;
    zero_loss("rons", 4, stopped);
}

/// The fixed period still works (and shows what the adaptive one saves: every pod waits it).
#[test]
fn a_fixed_five_second_lame_duck_loses_nothing_either() {
    let mut fixed = profile(500, "graceful");
    fixed.annotations = "{lameduck.io/lame-duck-period: 5s}";
    zero_loss("rofx", 7, fixed);
}

/// Behind a load balancer that takes 30 s to forget a pod, with a lame duck allowed to last 45 s.
/// Slow (about a minute): `cargo test --test rollout -- --ignored`.
#[test]
#[ignore]
fn rollout_loses_nothing_when_endpoints_forget_in_thirty_seconds() {
    let mut slow = profile(30_000, "graceful");
    slow.annotations = "{lameduck.io/shutdown-grace-period: 60s, lameduck.io/lame-duck-max: 45s}";
    zero_loss("ro30", 8, slow);
}

/// The harness can see a loss: the same rollout without lameduck (the app signalled at once,
/// its endpoint forgotten 2 s later) loses requests.
#[test]
fn without_the_proxy_the_same_rollout_loses_requests() {
    let profile = Profile {
        propagation: Duration::from_secs(2),
        app: "graceful",
        without_deletion: false,
        meshed: false,
        annotations: "",
        caller: Caller::Direct,
    };
    let Some(Run { tally, .. }) = rollout("rono", 5, profile) else {
        return;
    };
    assert!(
        !tally.failed.is_empty(),
        "no request failed without the proxy: the harness cannot see a loss"
    );
}

/// A meshed caller (its app's calls to the ClusterIP through its own lameduck) while the callee
/// Deployment, without a proxy, rolls with endpoints that forget a deleted pod after 10 s.
fn meshed_caller(tag: &str, k: u8, app: &'static str, retries: bool) -> Option<Run> {
    let profile = Profile {
        propagation: Duration::from_secs(10),
        app,
        without_deletion: false,
        meshed: false,
        annotations: "",
        caller: Caller::Meshed { retries },
    };
    rollout(tag, k, profile)
}

/// Every GET is answered and every failed POST was seen by the callee's app, and the caller's
/// retries stayed within their budget.
fn caller_loses_nothing(tag: &str, run: Option<Run>) {
    let Some(run) = run else { return };
    assert!(
        run.tally.failed.is_empty(),
        "{tag}: {} GETs failed (the first 10: {:?})",
        run.tally.failed.len(),
        &run.tally.failed[..run.tally.failed.len().min(10)]
    );
    assert!(
        run.posts_unreached.is_empty(),
        "{tag}: POSTs that never reached a callee failed: {:?}",
        run.posts_unreached
    );
    assert!(
        run.tally.ok > 300,
        "{tag}: only {} GETs answered",
        run.tally.ok
    );
    assert!(
        run.posts.ok > 100,
        "{tag}: only {} POSTs answered",
        run.posts.ok
    );
    // Whether anything needed a retry depends on which pooled connections the rollout cut;
    // without_retries_a_meshed_caller_sees_its_callee_roll shows that some do.
    let (_, exhausted) = run.retried.expect("a meshed caller");
    assert_eq!(exhausted, 0.0, "{tag}: retries went over the budget");
}

#[test]
fn a_meshed_caller_loses_nothing_while_its_callee_rolls() {
    caller_loses_nothing("rmcg", meshed_caller("rmcg", 9, "graceful", true));
}

#[test]
fn a_meshed_caller_loses_nothing_while_its_callee_rolls_and_exits_at_once() {
    caller_loses_nothing("rmci", meshed_caller("rmci", 10, "immediate", true));
}

/// The harness can see what retries save: the same rollout with the caller's retries off fails
/// requests.
#[test]
fn without_retries_a_meshed_caller_sees_its_callee_roll() {
    let Some(run) = meshed_caller("rmcn", 11, "graceful", false) else {
        return;
    };
    assert!(
        !run.tally.failed.is_empty() || !run.posts.failed.is_empty(),
        "no request failed without retries: the harness cannot see what they save"
    );
    assert_eq!(run.retried, Some((0.0, 0.0)));
}
