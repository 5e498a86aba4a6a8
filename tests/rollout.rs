//! Rolling updates behind a Service, played with real processes as a real cluster has them
//! (docs/pod-lifecycle.md, "The lame duck"): no request is lost however long the nodes take to
//! forget a deleted pod, each at its own time, busy services and quiet ones alike.
//!
//! - A "node": a network namespace with a bridge; every pod (the kubelet simulation of
//!   `pod/kubelet.rs`, inject's default spec: interception on, probes rewritten, a grace period
//!   of 20 s by annotation) in a namespace of its own behind a veth on that bridge, the node as
//!   its default route. The node's own address (`status.hostIP`) is on an interface of its own
//!   (its loopback); the kubelet's readiness probes of the app containers leave from the bridge's address, as on
//!   flannel, kubenet and Cilium, every second.
//! - Client nodes: namespaces of their own, each with its own copy of the Service's rules as
//!   kube-proxy's iptables mode makes them (a DNAT per endpoint chosen with `-m statistic --mode
//!   random`, in `OUTPUT`; conntrack keeps existing flows on their pod, new ones follow the
//!   rules of the moment). The node holds a copy too (in `PREROUTING`), for the pods on it.
//!   A pod becomes an endpoint of every copy once it is ready; once a pod is deleted, each copy
//!   forgets it at its own time, P × (1 ± 0.5), drawn from the profile's seed (when it is
//!   stopped without deletion: once its readiness has failed twice, 2 s apart, then so).
//! - Each client node runs a keep-alive HTTP/1.1 client and one that opens a new connection per
//!   request; two HTTP/2 clients beside them. A request fails when its client gets anything but
//!   a 200, cannot connect, or loses a connection under a request the app saw; a keep-alive
//!   connection closed before any byte of its response, for a request the app never saw, is
//!   retried on a new connection, as every HTTP client does.
//! - Busy: four client nodes, every client pausing 30 ms between requests (about 250 requests a
//!   second). Quiet: three client nodes, every client pausing a second (about 2 requests a
//!   second per pod).
//! - A Deployment of 3 replicas rolled from one version to the next, maxSurge 1,
//!   maxUnavailable 0, once the clients have sent for 10 s: a new pod, ready, an endpoint; then
//!   an old pod deleted; and so on.
//!
//! One test per profile, each in namespaces and addresses of its own. The harness checks
//! itself: the same rollout without the proxy loses requests, and the kubelet's probes, when
//! inject leaves them on the app's port, keep every lame duck open to its maximum.

#[path = "pod/kubelet.rs"]
#[allow(dead_code)]
mod kubelet;
mod support;
#[path = "pod/testapp.rs"]
mod testapp;

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use kubelet::{HOST_IP, Image, NetNs, Pod, Probes};
use serde::Deserialize;
use support::BIN;
use support::backend::Backend;
use testapp::{Answer, Tally, status_of, upstream_ids};

const REPLICAS: usize = 3;
const APP_PORT: u16 = 8080;
/// The pod's HTTP/2 app (a relay to the upstream, which speaks HTTP/2: the proxy keeps the
/// client's HTTP version towards the app), behind the Service's second port.
const H2_APP_PORT: u16 = 8081;
const H2_CLIENTS: usize = 2;
/// The lame duck's maximum inject derives from the grace period of the annotation (20 s):
/// four fifths.
const LAME_DUCK_MAX: Duration = Duration::from_secs(16);
/// How long the clients send before the rollout starts: the span over which the proxy measures
/// its rate before a lame duck.
const WARM: Duration = Duration::from_secs(10);

/// The workload: the pod test's app with a readiness probe every second, an HTTP/2 relay with
/// a TCP one, and a grace period of 20 s for the proxy. The probes wait 5 s for their answer,
/// so that a busy 2-core machine does not fail them.
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
      annotations: {lameduck.io/shutdown-grace-period: GRACE ANNOTATIONS}
    spec:
      containers:
        - name: app
          image: testapp:MODE
          ports:
            - containerPort: 8080
          readinessProbe:
            httpGet: {path: /healthz, port: 8080}
            periodSeconds: 1
            timeoutSeconds: 5
        - name: app-h2
          image: testapp:relay
          ports:
            - containerPort: 8081
          readinessProbe:
            tcpSocket: {port: 8081}
            periodSeconds: 1
            timeoutSeconds: 5
TCP_APP";

/// The opaque TCP app (a line echo) behind the Service's third port, in the profiles with TCP
/// clients.
const TCP_CONTAINER: &str = "        - name: app-tcp
          image: testapp:echo
          ports:
            - containerPort: 8082
          readinessProbe:
            tcpSocket: {port: 8082}
            periodSeconds: 1
            timeoutSeconds: 5
";
const TCP_APP_PORT: u16 = 8082;

/// How much the clients send.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Load {
    /// Four client nodes, 30 ms between a client's requests; and the HTTP/2 clients.
    Busy,
    /// Three client nodes, a second between a client's requests: about 2 requests a second
    /// per pod.
    Quiet,
}

impl Load {
    fn client_nodes(self) -> usize {
        match self {
            Load::Busy => 4,
            Load::Quiet => 3,
        }
    }

    fn pace(self) -> Duration {
        match self {
            Load::Busy => Duration::from_millis(30),
            Load::Quiet => Duration::from_secs(1),
        }
    }
}

/// How a profile's pods go away, and with what.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Profile {
    /// How long the rules of the nodes keep a deleted pod: each copy P × (1 ± 0.5).
    propagation: Duration,
    /// `graceful` or `immediate` (exits at once on SIGTERM).
    app: &'static str,
    /// Stopped without deletion (graceful node shutdown): the endpoint goes when readiness
    /// fails.
    without_deletion: bool,
    /// lameduck injected (false: the harness's own check that it can see losses).
    meshed: bool,
    /// Annotations of the pod template besides the grace period (`, a: b, …`).
    annotations: &'static str,
    /// The proxy's grace period, by annotation.
    grace: &'static str,
    /// An opaque TCP app, and a client per client node that opens a connection per line.
    tcp: bool,
    caller: Caller,
    load: Load,
    /// The seed of the forgetting times.
    seed: u64,
}

/// Who calls the Service.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Caller {
    /// Clients on client nodes of their own, straight to the ClusterIP.
    Direct,
    /// Clients inside a meshed pod on the node: their calls go through its own lameduck
    /// (interception on), with outbound retries on or off; half of them POST.
    Meshed { retries: bool },
}

/// The caller pod's index (its address), never an endpoint of the Service.
const CALLER_INDEX: usize = 20;

/// xorshift64*: the forgetting times of a profile, the same at every run.
struct Seeded(u64);

impl Seeded {
    /// A number in [0, 1).
    fn unit(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// One copy of the Service's rules: a node's (in `PREROUTING`, for its pods) or a client node's
/// (in `OUTPUT`, for its own connections), with its endpoints of the moment.
struct Rules {
    netns: Arc<NetNs>,
    hook: &'static str,
    endpoints: Mutex<Vec<Ipv4Addr>>,
}

/// The node, the client nodes and the Service of one profile.
struct Cluster {
    tag: String,
    /// The profile's own second octet block: pods in 10.(100+k).0.0/24, client node j in
    /// 10.(110+k).j.0/24, the ClusterIP 10.96.k.10.
    k: u8,
    node: Arc<NetNs>,
    client_nodes: Vec<Arc<NetNs>>,
    service: SocketAddr,
    upstream: Backend,
    /// The node's copy first, then each client node's.
    rules: Vec<Rules>,
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
    fn new(tag: &str, k: u8, client_nodes: usize) -> Result<Cluster, &'static str> {
        let node = Arc::new(NetNs::new(&format!("{tag}-node")).ok_or("no network namespaces")?);
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
        // The node's own address (status.hostIP), on an interface of its own (its loopback):
        // not the address its probes leave from on the pod network.
        sh(&[
            "ip",
            "-n",
            n,
            "addr",
            "add",
            &format!("{HOST_IP}/32"),
            "dev",
            "lo",
        ]);
        // The node routes between the client nodes and the pods (no sysctl(8) needed:
        // /proc/sys/net is the writing thread's namespace's).
        node.run(|| std::fs::write("/proc/sys/net/ipv4/ip_forward", "1"))
            .expect("ip_forward in the node's namespace");
        let service = SocketAddr::from(([10, 96, k, 10], 80));
        let mut rules = vec![Rules {
            netns: node.clone(),
            hook: "PREROUTING",
            endpoints: Mutex::new(Vec::new()),
        }];
        let mut clients = Vec::new();
        for j in 0..client_nodes {
            let netns =
                Arc::new(NetNs::new(&format!("{tag}-c{j}")).ok_or("no network namespaces")?);
            let net = format!("10.{}.{j}", 110 + k);
            support::netns::veth(
                &netns,
                &node,
                &format!("c{k}{j}"),
                &[&format!("{net}.2/24")],
                &[&format!("{net}.1/24")],
            );
            sh(&[
                "ip",
                "-n",
                netns.name(),
                "route",
                "add",
                "default",
                "via",
                &format!("{net}.1"),
            ]);
            rules.push(Rules {
                netns: netns.clone(),
                hook: "OUTPUT",
                endpoints: Mutex::new(Vec::new()),
            });
            clients.push(netns);
        }
        for copy in &rules {
            let jumps = format!(
                "*nat\n:LAMEDUCK-SVC - [0:0]\n:LAMEDUCK-SVC2 - [0:0]\n:LAMEDUCK-SVC3 - [0:0]\n\
                 :LAMEDUCK-HAIRPIN - [0:0]\n\
                 -A {hook} -d {ip}/32 -p tcp --dport 80 -j LAMEDUCK-SVC\n\
                 -A {hook} -d {ip}/32 -p tcp --dport 81 -j LAMEDUCK-SVC2\n\
                 -A {hook} -d {ip}/32 -p tcp --dport 82 -j LAMEDUCK-SVC3\n\
                 -A POSTROUTING -j LAMEDUCK-HAIRPIN\nCOMMIT\n",
                hook = copy.hook,
                ip = service.ip()
            );
            restore(&copy.netns, &jumps)?;
        }
        let upstream_addr: SocketAddr = format!("{node_ip}:0").parse().unwrap();
        let upstream = node.run(move || Backend::start_on(upstream_addr));
        Ok(Cluster {
            tag: tag.into(),
            k,
            node,
            client_nodes: clients,
            service,
            upstream,
            rules,
        })
    }

    fn pod_ip(&self, index: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 100 + self.k, 0, 10 + index as u8)
    }

    /// kube-proxy's rules of one copy for its endpoints of the moment, replaced in one restore.
    fn sync(copy: &Rules, endpoints: &[Ipv4Addr]) {
        let mut rules = String::from("*nat\n");
        for (chain, port) in [
            ("LAMEDUCK-SVC", APP_PORT),
            ("LAMEDUCK-SVC2", H2_APP_PORT),
            ("LAMEDUCK-SVC3", TCP_APP_PORT),
        ] {
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
        // A pod's connection that the rules send back to that very pod leaves with the
        // node's address on the bridge (kube-proxy's hairpin masquerade): a pod drops a packet
        // from its own address.
        rules.push_str(":LAMEDUCK-HAIRPIN - [0:0]\n-F LAMEDUCK-HAIRPIN\n");
        for ip in endpoints {
            rules.push_str(&format!(
                "-A LAMEDUCK-HAIRPIN -s {ip}/32 -d {ip}/32 -j MASQUERADE\n"
            ));
        }
        rules.push_str("COMMIT\n");
        restore(&copy.netns, &rules).expect("kube-proxy's rules");
    }

    /// A ready pod becomes an endpoint of every copy.
    fn add_endpoint(&self, ip: Ipv4Addr) {
        for copy in &self.rules {
            let mut endpoints = copy.endpoints.lock().unwrap();
            endpoints.push(ip);
            Cluster::sync(copy, &endpoints);
        }
    }

    /// One copy forgets a pod.
    fn forget(&self, copy: usize, ip: Ipv4Addr) {
        let copy = &self.rules[copy];
        let mut endpoints = copy.endpoints.lock().unwrap();
        endpoints.retain(|endpoint| *endpoint != ip);
        Cluster::sync(copy, &endpoints);
    }

    /// A pod of the profile, started and ready (an endpoint is the caller's to add), its
    /// proxy's environment extended by `proxy_env`, and the kubelet probing it from the
    /// bridge's address.
    fn start_pod(&self, index: usize, profile: Profile, proxy_env: &[(&str, &str)]) -> RunningPod {
        let input = DEPLOYMENT
            .replace("testapp:MODE", &format!("testapp:{}", profile.app))
            .replace("GRACE", profile.grace)
            .replace(" ANNOTATIONS", profile.annotations)
            .replace("TCP_APP", if profile.tcp { TCP_CONTAINER } else { "" });
        let document = |yaml: &str| {
            let value =
                serde_norway::Value::deserialize(serde_norway::Deserializer::from_str(yaml))
                    .unwrap();
            serde_json::to_value(value).unwrap()["spec"]["template"]["spec"].clone()
        };
        let spec = if profile.meshed {
            let (code, yaml, err) = support::inject(&input, &[]);
            assert_eq!(code, 0, "{err}");
            document(&yaml)
        } else {
            // Without the proxy the graceful app's keep-alive clients would hold its shutdown
            // up to the grace period; a short one keeps the check quick.
            let mut spec = document(&input);
            spec["terminationGracePeriodSeconds"] = 5.into();
            spec
        };
        let tag = format!("{}{index}", self.tag);
        let mut pod = Pod::new(&tag, spec, images(self.upstream.addr)).expect("a pod");
        let ip = self.pod_ip(index);
        pod.set_ip(ip);
        let link = format!("p{}{index}", self.k);
        support::netns::veth(&pod.netns, &self.node, &link, &[&format!("{ip}/24")], &[]);
        let node_end = format!("{link}b{}", std::process::id() % 100_000);
        let set_node_end = |what: &[&str]| {
            let node = self.node.name();
            sh(&[&["ip", "-n", node, "link", "set", &node_end][..], what].concat());
        };
        set_node_end(&["master", "br0"]);
        // The kubelet's hairpin mode (hairpin-veth): a pod's connection that the node's rules
        // send back to that very pod goes back out the port it came in on.
        set_node_end(&["type", "bridge_slave", "hairpin", "on"]);
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
        if matches!(profile.caller, Caller::Meshed { .. }) && !profile.meshed {
            // The callees close each connection after 5 requests, as servers bound keep-alive:
            // the caller's proxy dials some 40 times a second, each dial a draw of the rules.
            pod.add_env("app", "KEEP_ALIVE_REQUESTS", "5");
            // An app that exits at once may die with a POST it read and never passed on: it
            // prints each request it reads, before it can exit, so that such a POST counts as
            // one that reached it.
            pod.add_env("app", "RECORD_READS", "1");
        }
        for (name, value) in proxy_env {
            pod.add_env("lameduck-proxy", name, value);
        }
        pod.start();
        let target = SocketAddr::from((ip, APP_PORT));
        let h2_target = SocketAddr::from((ip, H2_APP_PORT));
        let tcp_target = profile.tcp.then_some(SocketAddr::from((ip, TCP_APP_PORT)));
        self.node.run(move || {
            support::wait_until("the pod serves", support::PATIENCE, || {
                status_of(target, "/work?id=0") == Some(200)
                    && status_of(h2_target, "/work?id=0") == Some(200)
                    && tcp_target.is_none_or(|tcp| echo(tcp, 0).is_ok())
            });
        });
        let probes = Probes::start(&pod, &self.node, ip);
        RunningPod { pod, probes }
    }
}

/// A pod and the kubelet's probes of it.
struct RunningPod {
    pod: Pod,
    probes: Probes,
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

/// One client of the Service: requests until `stop`, one every `pace`, on one keep-alive
/// connection at a time, or a new connection per request.
fn client(
    service: SocketAddr,
    keep_alive: bool,
    post: bool,
    pace: Duration,
    stop: &AtomicBool,
    tally: &Mutex<Tally>,
    ids: &AtomicU64,
) {
    let mut connection: Option<(TcpStream, bool)> = None;
    while !stop.load(Ordering::SeqCst) {
        thread::sleep(pace);
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

/// One line through an opaque TCP stream to `service`, on a connection of its own: an error
/// unless the same line comes back.
fn echo(service: SocketAddr, id: u64) -> Result<(), String> {
    use std::io::{BufRead, BufReader};
    let stream = TcpStream::connect_timeout(&service, Duration::from_secs(2))
        .map_err(|error| format!("tcp connect: {error}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let line = format!("tcp {id}\n");
    (&stream)
        .write_all(line.as_bytes())
        .map_err(|error| format!("tcp id {id}: {error}"))?;
    let mut back = String::new();
    BufReader::new(&stream)
        .read_line(&mut back)
        .map_err(|error| format!("tcp id {id}: {error}"))?;
    match back == line {
        true => Ok(()),
        false => Err(format!("tcp id {id}: echoed {back:?}")),
    }
}

/// An opaque TCP client of the Service: a line on a new connection, one every `pace`.
fn tcp_client(
    service: SocketAddr,
    pace: Duration,
    stop: &AtomicBool,
    tally: &Mutex<Tally>,
    ids: &AtomicU64,
) {
    while !stop.load(Ordering::SeqCst) {
        thread::sleep(pace);
        let id = ids.fetch_add(1, Ordering::SeqCst);
        let echoed = echo(service, id);
        let mut tally = tally.lock().unwrap();
        match echoed {
            Ok(()) => {
                tally.ok += 1;
                tally.ok_tcp += 1;
            }
            Err(why) => tally.failed.push(why),
        }
    }
}

/// An HTTP/2 client of the Service, as gRPC's or Go's: one connection at a time, requests on
/// it until it ends; a request the connection's end (a GOAWAY above it, a reset) took is sent
/// again on a new connection, which is right only if the app never saw it (checked against
/// the upstream's record afterwards, as for HTTP/1).
fn h2_client(
    service: SocketAddr,
    pace: Duration,
    stop: &AtomicBool,
    tally: &Mutex<Tally>,
    ids: &AtomicU64,
) {
    use http_body_util::{BodyExt, Empty};
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut sender: Option<hyper::client::conn::http2::SendRequest<Empty<bytes::Bytes>>> = None;
        while !stop.load(Ordering::SeqCst) {
            tokio::time::sleep(pace).await;
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

/// One old pod's deletion, as its proxy and the copies of the rules saw it.
#[derive(Debug)]
struct Gone {
    /// From the deletion to the moment the last copy of the rules forgot the pod.
    last_forgot: Duration,
    /// The lame duck, as its proxy logged it.
    lame_duck: Option<Duration>,
    /// Late connections its proxy saw (refused or handed off), how long it lingered for them,
    /// how many it handed off and how many of its hand-offs came back to it.
    late: u64,
    lingered: Duration,
    handed_off: u64,
    loops: u64,
    /// The kubelet's probes of the pod that passed and failed, over its whole life.
    probes: (u64, u64),
    /// Its proxy's last word on the lame duck: why it was still open, or why it ended.
    why: String,
    /// Its proxy's log from the lame duck's end on, for a failure's message.
    tail: Tail,
    /// The requests its app read, where it records them (a meshed caller's callees).
    read: HashSet<u64>,
}

/// Some lines of a log, shown whole only where a message asks for them.
struct Tail(String);

impl std::fmt::Debug for Tail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} lines", self.0.lines().count())
    }
}

/// The first number after `field=` in a log line.
fn logged_number(line: &str, field: &str) -> Option<u64> {
    line.split(&format!("{field}="))
        .nth(1)?
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// Rolls 3 replicas from one version to the next under load; returns what the clients saw,
/// and each old pod's deletion.
fn rollout(tag: &str, k: u8, profile: Profile) -> Option<Run> {
    if Command::new("python3").arg("--version").output().is_err() {
        support::skip(tag, "no python3 for the test app");
        return None;
    }
    let cluster = match Cluster::new(tag, k, profile.load.client_nodes()) {
        Ok(cluster) => Arc::new(cluster),
        Err(why) => {
            support::skip(tag, why);
            return None;
        }
    };
    let mut old: Vec<(usize, RunningPod)> = Vec::new();
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
    let flowing_since = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let posts = Arc::new(Mutex::new(Tally::default()));
    let ids = Arc::new(AtomicU64::new(1));
    let pace = profile.load.pace();
    // On each client node (or in the caller pod): a keep-alive client and one that opens a
    // new connection per request; behind a meshed caller, every other one POSTs.
    let homes: Vec<Arc<NetNs>> = match &caller {
        Some(caller) => vec![caller.pod.netns.clone(); cluster.client_nodes.len()],
        None => cluster.client_nodes.clone(),
    };
    let mut clients = Vec::new();
    for home in &homes {
        for keep_alive in [true, false] {
            let post = caller.is_some() && !keep_alive;
            let tally = match post {
                true => posts.clone(),
                false => tally.clone(),
            };
            let (stop, ids, service) = (stop.clone(), ids.clone(), cluster.service);
            clients.push(
                home.spawn(move || client(service, keep_alive, post, pace, &stop, &tally, &ids)),
            );
        }
    }
    if profile.tcp {
        for home in &homes {
            let (stop, tally, ids) = (stop.clone(), tally.clone(), ids.clone());
            let service = SocketAddr::new(cluster.service.ip(), 82);
            clients.push(home.spawn(move || tcp_client(service, pace, &stop, &tally, &ids)));
        }
    }
    if profile.meshed && caller.is_none() && profile.load == Load::Busy {
        for index in 0..H2_CLIENTS {
            let (stop, tally, ids) = (stop.clone(), tally.clone(), ids.clone());
            let service = SocketAddr::new(cluster.service.ip(), 81);
            clients.push(
                homes[index % homes.len()]
                    .spawn(move || h2_client(service, pace, &stop, &tally, &ids)),
            );
        }
    }
    let flowing = match profile.load {
        Load::Busy => 50,
        Load::Quiet => 5,
    };
    support::wait_until("the load flows", support::PATIENCE, || {
        tally.lock().unwrap().ok >= flowing
    });
    // The old pods of a real rollout have served their clients for a while: long enough here
    // that the rate their proxies measure before the lame duck (over its last 10 s) is the
    // load's, not that of the harness's checks while the pods started, which a Service never
    // sends (it routes to a pod once it is ready).
    thread::sleep(WARM.saturating_sub(flowing_since.elapsed()));
    let mut seeded = Seeded(profile.seed);
    let started = Instant::now();
    let mut deletions = Vec::new();
    let mut new_pods = Vec::new();
    for (index, pod) in old {
        let fresh = REPLICAS + new_pods.len();
        let pod_new = cluster.start_pod(fresh, profile, &[]);
        cluster.add_endpoint(cluster.pod_ip(fresh));
        new_pods.push(pod_new);
        // Each copy of the rules forgets the pod at its own time.
        let delays: Vec<Duration> = (0..cluster.rules.len())
            .map(|_| profile.propagation.mul_f64(0.5 + seeded.unit()))
            .collect();
        let cluster = cluster.clone();
        deletions.push(thread::spawn(move || {
            let RunningPod { mut pod, probes } = pod;
            let ip = cluster.pod_ip(index);
            let deleted = Instant::now();
            // The endpoints controller and each node's kube-proxy, each its own delay behind.
            let forgetting: Vec<_> = delays
                .into_iter()
                .enumerate()
                .map(|(copy, delay)| {
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
                        thread::sleep(delay);
                        cluster.forget(copy, ip);
                        deleted.elapsed()
                    })
                })
                .collect();
            let deletion = pod.delete();
            let last_forgot = forgetting
                .into_iter()
                .map(|forget| forget.join().unwrap())
                .max()
                .unwrap_or_default();
            let log = pod.timeline.text();
            let lame_duck = log
                .lines()
                .find(|line| line.contains("lame duck over"))
                .and_then(|line| logged_number(line, "lasted_ms"))
                .map(Duration::from_millis);
            let late_line = log.lines().find(|line| {
                line.contains("late connections after the lame duck (handed off or refused)")
            });
            let late = late_line
                .and_then(|line| logged_number(line, "late_connections"))
                .unwrap_or(0);
            let lingered = late_line
                .and_then(|line| logged_number(line, "lingered_ms"))
                .map_or(Duration::ZERO, Duration::from_millis);
            let handed_off = late_line
                .and_then(|line| logged_number(line, "handed_off"))
                .unwrap_or(0);
            let loops = late_line
                .and_then(|line| logged_number(line, "handoff_loops"))
                .unwrap_or(0);
            assert!(
                deletion.killed.is_empty() || !profile.meshed,
                "{}",
                pod.timeline.text()
            );
            let why = log
                .lines()
                .filter(|line| {
                    line.contains("lame duck still open") || line.contains("lame duck over")
                })
                .nth_back(1)
                .unwrap_or_default()
                .to_string();
            let tail = log
                .lines()
                .filter(|line| line.contains("[lameduck-proxy]") || line.contains("kubelet"))
                .skip_while(|line| !line.contains("lame duck over"))
                .collect::<Vec<_>>()
                .join("\n");
            let read = log
                .lines()
                .filter_map(|line| line.split("app: read id=").nth(1)?.trim().parse().ok())
                .collect();
            Gone {
                why,
                tail: Tail(tail),
                read,
                last_forgot,
                lame_duck,
                late,
                lingered,
                handed_off,
                loops,
                probes: probes.counts(),
            }
        }));
        // maxSurge 1: the next new pod once this old one is terminating.
    }
    let gone: Vec<Gone> = deletions
        .into_iter()
        .map(|deletion| deletion.join().unwrap())
        .collect();
    let took = started.elapsed();
    thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::SeqCst);
    for client in clients {
        client.join().unwrap();
    }
    let new_probes: Vec<(u64, u64)> = new_pods.iter().map(|pod| pod.probes.counts()).collect();
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
    for gone in &gone {
        eprintln!("{tag}:   {}", gone.why);
    }
    let pods: Vec<String> = gone
        .iter()
        .map(|gone| {
            format!(
                "lame duck {} s, last copy forgot it at {:.1} s, {} late ({} handed off, {} loops), lingered {:.1} s",
                gone.lame_duck
                    .map_or("-".into(), |lasted| format!("{:.1}", lasted.as_secs_f64())),
                gone.last_forgot.as_secs_f64(),
                gone.late,
                gone.handed_off,
                gone.loops,
                gone.lingered.as_secs_f64(),
            )
        })
        .collect();
    eprintln!(
        "{tag}: P = {:?} ± 50 %, {:?} load, app {}{}{}: {} answered ({} over HTTP/2, {} over TCP), \
         {} retried, {} failed; rollout {:.1} s; {}",
        profile.propagation,
        profile.load,
        profile.app,
        if profile.without_deletion {
            ", stopped without deletion"
        } else {
            ""
        },
        profile.annotations,
        tally.ok,
        tally.ok_h2,
        tally.ok_tcp,
        tally.retried,
        tally.failed.len(),
        took.as_secs_f64(),
        pods.join("; ")
    );
    let posts = Arc::try_unwrap(posts).unwrap().into_inner().unwrap();
    // A failed POST is right only if the app saw it (it may have acted on it): the upstream
    // got its call, or an app read it and exited before making the call.
    let read: HashSet<u64> = gone
        .iter()
        .flat_map(|gone| gone.read.iter().copied())
        .collect();
    let id_of = |why: &String| {
        why.strip_prefix("id ")
            .and_then(|rest| rest.split(':').next()?.parse::<u64>().ok())
    };
    let posts_unreached: Vec<String> = posts
        .failed
        .iter()
        .filter(|why| id_of(why).is_none_or(|id| !seen.contains(&id) && !read.contains(&id)))
        .cloned()
        .collect();
    let posts_read_only = posts
        .failed
        .iter()
        .filter_map(id_of)
        .filter(|id| !seen.contains(id) && read.contains(id))
        .count();
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
            "{tag}: meshed caller: {} POSTs answered, {} failed ({} never reached a callee, \
             {posts_read_only} read by an app that exited before its call); its proxy retried \
             {retried} requests, {exhausted} over the budget",
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
        gone,
        new_probes,
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
    /// Each old pod's deletion.
    gone: Vec<Gone>,
    /// The kubelet's probes of the new pods: passed, failed.
    new_probes: Vec<(u64, u64)>,
}

fn profile(propagation_ms: u64, app: &'static str, seed: u64) -> Profile {
    Profile {
        propagation: Duration::from_millis(propagation_ms),
        app,
        without_deletion: false,
        meshed: true,
        annotations: "",
        grace: "20s",
        tcp: false,
        caller: Caller::Direct,
        load: Load::Busy,
        seed,
    }
}

/// The rollout of `profile` loses no request, over HTTP/1.1 (and HTTP/2 when busy); each old
/// pod's lame duck lasted until the last copy of the rules forgot it (what the proxy could not
/// see, it still waited for), and no connection came late; the kubelet's probes of the app,
/// through the admin port, passed.
fn zero_loss(tag: &str, k: u8, profile: Profile) -> Option<Run> {
    let run = rollout(tag, k, profile)?;
    let tally = &run.tally;
    assert!(
        tally.failed.is_empty(),
        "{tag}: {} failed (the first 10: {:?})",
        tally.failed.len(),
        &tally.failed[..tally.failed.len().min(10)]
    );
    let (answered, over_h2) = match profile.load {
        Load::Busy => (500, 100),
        Load::Quiet => (40, 0),
    };
    assert!(tally.ok > answered, "{tag}: only {} answered", tally.ok);
    assert!(
        tally.ok_h2 >= over_h2,
        "{tag}: only {} over HTTP/2",
        tally.ok_h2
    );
    assert_eq!(run.gone.len(), REPLICAS);
    for gone in &run.gone {
        let lame_duck = gone
            .lame_duck
            .unwrap_or_else(|| panic!("{tag}: no lame duck: {gone:?}"));
        // The preStop hook starts the lame duck a few milliseconds after the deletion.
        assert!(
            lame_duck + Duration::from_millis(250) >= gone.last_forgot.min(LAME_DUCK_MAX),
            "{tag}: the lame duck ended before the last copy of the rules forgot the pod: {gone:?}"
        );
        assert_eq!(gone.late, 0, "{tag}: {gone:?}");
        assert!(
            gone.probes.0 > 0,
            "{tag}: the kubelet's probes never passed: {gone:?}"
        );
    }
    for (passed, failed) in &run.new_probes {
        assert!(
            *passed > 0 && *failed == 0,
            "{tag}: the kubelet's probes of a new pod: {passed} passed, {failed} failed"
        );
    }
    Some(run)
}

/// At a short propagation, with the kubelet probing from the bridge's address every second,
/// each lame duck ends once the nodes' clients have moved on, not at its maximum: the probes go
/// to the admin port and are no traffic. (Every node forgets the pod within 0.75 s, so a source
/// of new connections sent its last before then, and its window, 20 of its mean gaps counted
/// from the start, ends before 0.75 + 20 × 0.75 s: short of the 16 s maximum.)
#[test]
fn rollout_loses_nothing_when_nodes_forget_in_half_a_second_probed_from_the_bridge() {
    let Some(run) = zero_loss("ro05", 1, profile(500, "graceful", 1)) else {
        return;
    };
    for gone in &run.gone {
        let lasted = gone.lame_duck.expect("a lame duck");
        assert!(
            lasted + Duration::from_millis(100) < LAME_DUCK_MAX,
            "ro05: the lame duck lasted {lasted:?}, to its maximum: {gone:?}"
        );
    }
}

/// The harness sees what the probes from the bridge did before inject pointed them at the admin
/// port: left on the app's port, the kubelet's probe every second is a new connection from an
/// address that is not `status.hostIP`, and every lame duck lasts its maximum.
#[test]
fn probes_left_on_the_apps_port_keep_every_lame_duck_to_its_maximum() {
    let mut unrewritten = profile(500, "graceful", 2);
    unrewritten.annotations = ", lameduck.io/rewrite-probes: disabled";
    let Some(run) = rollout("ropr", 12, unrewritten) else {
        return;
    };
    assert!(run.tally.failed.is_empty(), "ropr: {:?}", run.tally.failed);
    for gone in &run.gone {
        let lasted = gone.lame_duck.expect("a lame duck");
        assert!(
            lasted >= LAME_DUCK_MAX - Duration::from_millis(100),
            "ropr: the probes from the bridge did not hold the lame duck: {gone:?}"
        );
    }
}

#[test]
fn rollout_loses_nothing_when_nodes_forget_in_half_a_second_app_exits_at_once() {
    zero_loss("ro5i", 14, profile(500, "immediate", 13));
}

#[test]
fn rollout_loses_nothing_when_nodes_forget_in_two_seconds() {
    zero_loss("ro02", 15, profile(2_000, "graceful", 14));
}

#[test]
fn rollout_loses_nothing_when_nodes_forget_in_two_seconds_app_exits_at_once() {
    zero_loss("ro2i", 2, profile(2_000, "immediate", 3));
}

#[test]
fn rollout_loses_nothing_when_nodes_forget_in_ten_seconds() {
    zero_loss("ro10", 3, profile(10_000, "graceful", 4));
}

#[test]
fn rollout_loses_nothing_when_nodes_forget_in_ten_seconds_app_exits_at_once() {
    zero_loss("ro1i", 6, profile(10_000, "immediate", 5));
}

/// About 2 requests a second per pod: a second without a new connection says nothing there, and
/// the lame duck lasts while nodes may still send. It cannot end early by chance: the six
/// clients send at most one request a second each, so a pod's rate over the 10 s before its
/// lame duck stays near 2 a second (about 20 of the 60 requests; 4 a second if all three
/// keep-alive clients sit on it). Only at 6.25 a second would 100 gaps (16 s) fit within the
/// maximum, which takes nearly every request of all six clients on one pod: each lame duck
/// lasts its 16 s, beyond the 15 s by which the last copy has forgotten the pod.
#[test]
fn a_quiet_service_loses_nothing_when_nodes_forget_in_ten_seconds() {
    let mut quiet = profile(10_000, "graceful", 6);
    quiet.load = Load::Quiet;
    zero_loss("roqt", 13, quiet);
}

/// Graceful node shutdown and some evictions stop a pod without deleting it: its endpoint goes
/// only once its readiness has failed (twice, 2 s apart), then P.
#[test]
fn pods_stopped_without_deletion_lose_nothing() {
    let mut stopped = profile(500, "graceful", 7);
    stopped.without_deletion = true;
    zero_loss("rons", 4, stopped);
}

/// The fixed period still works (and shows what the adaptive one saves: every pod waits it).
#[test]
fn a_fixed_five_second_lame_duck_loses_nothing_either() {
    let mut fixed = profile(500, "graceful", 8);
    fixed.annotations = ", lameduck.io/lame-duck-period: 5s";
    let Some(run) = rollout("rofx", 7, fixed) else {
        return;
    };
    assert!(run.tally.failed.is_empty(), "rofx: {:?}", run.tally.failed);
    for gone in &run.gone {
        assert_eq!(
            gone.lame_duck.map(|lasted| lasted.as_secs()),
            Some(5),
            "{gone:?}"
        );
    }
}

/// The harness can see a loss: the same rollout without lameduck (the app signalled at once,
/// each copy of the rules forgetting its pod 1 to 3 s later) loses requests. Not by luck: the
/// graceful app closes its listener at its SIGTERM, and while a client node's copy still points
/// there (at least 1 s, half of P), each of its new connections to that pod is refused or
/// reset. Four client nodes each open one a request (every 30 ms plus the request, about 25 a
/// second), each to that pod one time in four: at least 4 × 25 / 4 × 1 s, 25 expected losses
/// per pod, 75 for the rollout; as a Poisson count, the chance of none is e^-75.
#[test]
fn without_the_proxy_the_same_rollout_loses_requests() {
    let mut unmeshed = profile(2_000, "graceful", 9);
    unmeshed.meshed = false;
    let Some(run) = rollout("rono", 5, unmeshed) else {
        return;
    };
    assert!(
        !run.tally.failed.is_empty(),
        "no request failed without the proxy: the harness cannot see a loss"
    );
}

/// A meshed caller (its app's calls to the ClusterIP through its own lameduck) while the callee
/// Deployment, without a proxy, rolls with copies of the rules that forget a deleted pod after
/// 10 s ± 50 %.
fn meshed_caller(tag: &str, k: u8, app: &'static str, retries: bool, seed: u64) -> Option<Run> {
    let mut callee = profile(10_000, app, seed);
    callee.meshed = false;
    callee.caller = Caller::Meshed { retries };
    rollout(tag, k, callee)
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
    let read: usize = run.gone.iter().map(|gone| gone.read.len()).sum();
    assert!(
        read > 0,
        "{tag}: the old callees recorded no request read: a POST an app read and died with \
         would look like one that never reached it"
    );
    // Whether anything needed a retry depends on which pooled connections the rollout cut;
    // without_retries_a_meshed_caller_sees_its_callee_roll shows that some do.
    let (_, exhausted) = run.retried.expect("a meshed caller");
    assert_eq!(exhausted, 0.0, "{tag}: retries went over the budget");
}

#[test]
fn a_meshed_caller_loses_nothing_while_its_callee_rolls() {
    caller_loses_nothing("rmcg", meshed_caller("rmcg", 9, "graceful", true, 10));
}

#[test]
fn a_meshed_caller_loses_nothing_while_its_callee_rolls_and_exits_at_once() {
    caller_loses_nothing("rmci", meshed_caller("rmci", 10, "immediate", true, 11));
}

/// The harness can see what retries save: the same rollout, the callee's app exiting at once,
/// with the caller's retries off fails requests. Not by luck: a callee pod's app exits at its
/// SIGTERM while the node's copy of the rules still points there for at least 5 s (half of P),
/// and each connection the caller's proxy dials there is refused. Its eight clients send about
/// 200 requests a second, and the callees close each connection after 5: some 40 dials a
/// second, one in four to that pod: at least 40 / 4 × 5 s, 50 expected failures per pod; as a
/// Poisson count, the chance of none is e^-50.
#[test]
fn without_retries_a_meshed_caller_sees_its_callee_roll() {
    let Some(run) = meshed_caller("rmcn", 11, "immediate", false, 12) else {
        return;
    };
    assert!(
        !run.tally.failed.is_empty() || !run.posts.failed.is_empty(),
        "no request failed without retries: the harness cannot see what they save"
    );
    assert_eq!(run.retried, Some((0.0, 0.0)));
}

/// The pods of a hand-off profile: nodes that forget a deleted pod after 30 s ± 50 % (up to
/// 45 s, as a slow cloud load balancer), a lame duck of at most 2 s, an opaque TCP app beside
/// the HTTP ones, a grace period of 60 s; with `handoff`, the proxy hands late connections to
/// the Service (named by annotation: the ClusterIP, as no cluster DNS runs here; inject finds
/// the Service in its stream itself, tests/inject.rs).
fn handoff_profile(k: u8, seed: u64, handoff: bool) -> Profile {
    let annotations = match handoff {
        true => format!(
            ", lameduck.io/lame-duck-max: 2s, lameduck.io/handoff: \"{APP_PORT}=10.96.{k}.10:80,{H2_APP_PORT}=10.96.{k}.10:81,{TCP_APP_PORT}=10.96.{k}.10:82\""
        ),
        false => ", lameduck.io/lame-duck-max: 2s".to_string(),
    };
    Profile {
        annotations: Box::leak(annotations.into_boxed_str()),
        grace: "60s",
        tcp: true,
        ..profile(30_000, "graceful", seed)
    }
}

/// Hand-off: with a lame duck of at most 2 s while nodes keep sending for up to 45 s, no request
/// and no TCP stream is lost (HTTP/1.1 keep-alive and new connections, HTTP/2, opaque TCP):
/// every late connection went to another pod of the Service, none was refused; each pod's
/// proxy lingered while they came; and the node's own copy of the rules, which still sends the
/// hand-offs back to the pod they left (at least one dial in six while it keeps the pod, for at
/// least 13 s of TCP hand-offs at some 20 a second: e^-40 for none), was caught and dialled
/// again.
#[test]
fn with_handoff_a_short_lame_duck_loses_nothing_when_nodes_forget_in_thirty_seconds() {
    let k = 16;
    let Some(run) = rollout("rhof", k, handoff_profile(k, 15, true)) else {
        return;
    };
    let tally = &run.tally;
    if !tally.failed.is_empty() {
        // What each pod's proxy did after its lame duck, to tell why.
        for gone in &run.gone {
            eprintln!("rhof: a pod after its lame duck:\n{}", gone.tail.0);
        }
    }
    assert!(
        tally.failed.is_empty(),
        "rhof: {} failed (the first 10: {:?})",
        tally.failed.len(),
        &tally.failed[..tally.failed.len().min(10)]
    );
    assert!(
        tally.ok > 1000 && tally.ok_h2 > 100 && tally.ok_tcp > 500,
        "rhof: only {} answered, {} over HTTP/2, {} over TCP",
        tally.ok,
        tally.ok_h2,
        tally.ok_tcp
    );
    for gone in &run.gone {
        let lame_duck = gone.lame_duck.expect("a lame duck");
        assert!(
            lame_duck <= Duration::from_millis(2_500),
            "rhof: the lame duck lasted {lame_duck:?}: {gone:?}"
        );
        assert!(
            gone.handed_off > 0 && gone.handed_off == gone.late,
            "rhof: every late connection is handed off: {gone:?}\n{}",
            gone.tail.0
        );
    }
    let loops: u64 = run.gone.iter().map(|gone| gone.loops).sum();
    assert!(loops > 0, "rhof: no hand-off came back: {:?}", run.gone);
}

/// The harness sees what the hand-off saves: the same rollout without it refuses late
/// connections, and clients fail. Not by luck: each pod's lame duck ends within 2 s while
/// every copy of the rules keeps it for at least 15 s, and each client node opens some 50
/// connections a second, one in four or so to that pod: hundreds refused per pod.
#[test]
fn without_handoff_the_same_rollout_refuses_late_connections() {
    let k = 17;
    let Some(run) = rollout("rhon", k, handoff_profile(k, 16, false)) else {
        return;
    };
    assert!(
        !run.tally.failed.is_empty(),
        "rhon: no request failed without the hand-off"
    );
    for gone in &run.gone {
        assert!(
            gone.late > 0 && gone.handed_off == 0,
            "rhon: late connections are refused: {gone:?}"
        );
    }
}
