//! Transparent interception: real NAT rules in a network namespace of the test's own redirect
//! the app's connections to the proxy's `orig-dst` routes, and each goes on to where it was
//! going (`SO_ORIGINAL_DST`). The proxy runs under a uid of its own, exempt from the rules, as in
//! a pod.

mod support;

use std::net::{IpAddr, SocketAddr, TcpStream};
use std::process::Command;
use std::sync::Arc;

use support::backend::{Backend, get, read_response, send_raw};
use support::netns::NetNs;
use support::netns::run;
use support::{BIN, Proxy, wait_close};

/// The proxy's uid: the NAT rules leave its own connections alone.
const PROXY_UID: &str = "4321";
/// The "pod's" own addresses (on its loopback interface).
const POD_V4: &str = "10.77.0.2";
const POD_V6: &str = "fd77::2";
const OUTBOUND_PORT: u16 = 4140;
const ADMIN_PORT: u16 = 14191;

/// Why this machine cannot run these tests, if it cannot.
fn unsupported() -> Option<&'static str> {
    let runs = |program: &str| {
        Command::new(program)
            .arg("--version")
            .output()
            .is_ok_and(|out| out.status.success())
    };
    if !runs("iptables-nft") || !runs("ip6tables-nft") {
        return Some("iptables-nft is not installed (Debian package iptables)");
    }
    if !runs("setpriv") {
        return Some("setpriv is not installed (util-linux)");
    }
    None
}

/// The pod's own addresses, on its loopback interface.
fn add_pod_addresses() {
    run("ip", &["addr", "add", &format!("{POD_V4}/32"), "dev", "lo"]);
    let v6 = format!("{POD_V6}/128");
    run("ip", &["-6", "addr", "add", &v6, "dev", "lo", "nodad"]);
}

/// The NAT rules a pod's init container would install for its outbound traffic: every TCP
/// connection to the pod's addresses on `ports` goes to the proxy, except the proxy's own.
fn intercept_outbound(ports: &[u16]) {
    let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
    for (iptables, pod) in [("iptables-nft", POD_V4), ("ip6tables-nft", POD_V6)] {
        let owner = [
            "-t",
            "nat",
            "-A",
            "OUTPUT",
            "-p",
            "tcp",
            "-m",
            "owner",
            "--uid-owner",
            PROXY_UID,
            "-j",
            "RETURN",
        ];
        run(iptables, &owner);
        let redirect = [
            "-t",
            "nat",
            "-A",
            "OUTPUT",
            "-p",
            "tcp",
            "-d",
            pod,
            "-m",
            "multiport",
            "--dports",
            &ports.join(","),
            "-j",
            "REDIRECT",
            "--to-ports",
            &OUTBOUND_PORT.to_string(),
        ];
        run(iptables, &redirect);
    }
}

fn start_proxy() -> Proxy {
    let mut setpriv = Command::new("setpriv");
    setpriv.args([
        &format!("--reuid={PROXY_UID}"),
        &format!("--regid={PROXY_UID}"),
        "--clear-groups",
        BIN,
    ]);
    // Both families on one port: the IPv6 listener must leave IPv4 to the other.
    Proxy::start_command(
        &mut setpriv,
        &[
            "--outbound",
            &format!("0.0.0.0:{OUTBOUND_PORT}=orig-dst"),
            "--outbound",
            &format!("[::]:{OUTBOUND_PORT}=orig-dst"),
            &format!("--admin=0.0.0.0:{ADMIN_PORT}"),
        ],
    )
}

fn in_netns(test: &'static str, work: impl FnOnce() + Send + 'static) {
    support::netns::in_netns(test, unsupported(), work);
}

#[test]
fn redirected_connections_reach_their_original_destination_through_the_proxy() {
    in_netns(
        "redirected_connections_reach_their_original_destination_through_the_proxy",
        || {
            add_pod_addresses();
            let v4 = Backend::start_on(SocketAddr::new(POD_V4.parse().unwrap(), 0));
            let v6 = Backend::start_on(SocketAddr::new(POD_V6.parse().unwrap(), 0));
            intercept_outbound(&[v4.addr.port(), v6.addr.port()]);
            let proxy = start_proxy();

            for backend in [&v4, &v6] {
                // The app calls the backend's own address; the rules send it to the proxy.
                let mut client = send_raw(backend.addr, &get("/intercepted"));
                let response = read_response(&mut client).unwrap();
                assert_eq!(response.status, 200, "{}: {response:?}", backend.addr);
                assert_eq!(backend.seen_paths(), ["/intercepted"]);
                // Still open: the proxy lists it, going where it was sent.
                let open = proxy.open_connections();
                assert_eq!(open.len(), 1, "{open:?}");
                assert_eq!(open[0]["target"], backend.addr.to_string());
                assert_eq!(open[0]["direction"], "outbound");
                assert_eq!(open[0]["protocol"], "http1");
                drop(client);
                proxy.wait_open_connections(0);
            }
            assert_eq!(
                proxy.metric(
                    "lameduck_connections_total{direction=\"outbound\",protocol=\"http1\"}"
                ),
                2.0
            );
        },
    );
}

#[test]
fn connections_with_nowhere_to_go_are_refused_and_counted() {
    in_netns(
        "connections_with_nowhere_to_go_are_refused_and_counted",
        || {
            // The admin port is redirected too (a misconfigured rule): forwarding such a
            // connection would send it to the proxy itself.
            add_pod_addresses();
            intercept_outbound(&[ADMIN_PORT]);
            let proxy = start_proxy();
            let outbound: SocketAddr = format!("127.0.0.1:{OUTBOUND_PORT}").parse().unwrap();
            let pod: IpAddr = POD_V4.parse().unwrap();
            for (addr, reason) in [
                // Sent to the proxy's port itself: no original destination.
                (outbound, "not_redirected"),
                // Redirected, but bound for one of the proxy's own listeners.
                (SocketAddr::new(pod, ADMIN_PORT), "to_proxy"),
            ] {
                let mut client = TcpStream::connect(addr).unwrap();
                let (close, _) = wait_close(&mut client, support::PATIENCE);
                assert_eq!(close, support::Close::Reset, "{addr}");
                assert_eq!(
                    proxy.metric(&format!(
                        "lameduck_connections_refused_total{{direction=\"outbound\",reason=\"{reason}\"}}"
                    )),
                    1.0,
                    "{addr}"
                );
            }
            assert_eq!(proxy.open_connections().len(), 0);
            assert_eq!(proxy.get("/ready").status, 200);
        },
    );
}

/// Runs `lameduck iptables ARGS` in the current thread's network namespace; returns its
/// status, standard output and standard error.
fn lameduck_iptables(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(BIN)
        .arg("iptables")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The NAT rules of both families as `iptables-save` lists them (without its comments).
fn nat_rules() -> String {
    let mut rules = String::new();
    for save in ["iptables-nft-save", "ip6tables-nft-save"] {
        let out = Command::new(save).args(["-t", "nat"]).output().unwrap();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if !line.starts_with('#') {
                rules.push_str(line);
                rules.push('\n');
            }
        }
    }
    rules
}

/// A pod's namespace and its peer's, linked; None (and the test skipped, saying why) when this
/// machine cannot make them.
fn pod_and_peer_for(test: &str, tag: char) -> Option<(Arc<NetNs>, Arc<NetNs>)> {
    if let Some(why) = unsupported() {
        support::skip(test, why);
        return None;
    }
    let linked = pod_and_peer(tag);
    if linked.is_none() {
        support::skip(
            test,
            "cannot make a network namespace (needs root and ip(8))",
        );
    }
    linked
}

/// A pod's namespace and its peer's, linked.
fn pod_and_peer(tag: char) -> Option<(Arc<NetNs>, Arc<NetNs>)> {
    let pod = Arc::new(NetNs::new(&format!("{tag}-pod"))?);
    let peer = Arc::new(NetNs::new(&format!("{tag}-peer"))?);
    // The peer end has a second IPv4 address, for a skipped CIDR.
    support::netns::veth(
        &pod,
        &peer,
        &format!("l{tag}"),
        &["10.78.0.2/24", "fd78::2/64"],
        &["10.78.0.1/24", "10.78.0.3/24", "fd78::1/64"],
    );
    Some((pod, peer))
}

/// The proxy of an intercepted pod, in `pod`, under [`PROXY_UID`].
fn start_pod_proxy(pod: &Arc<NetNs>) -> Arc<Proxy> {
    let mut setpriv = Command::new("setpriv");
    setpriv.args([
        &format!("--reuid={PROXY_UID}"),
        &format!("--regid={PROXY_UID}"),
        "--clear-groups",
        BIN,
    ]);
    let proxy = pod.run(move || {
        Proxy::start_command(
            &mut setpriv,
            &[
                "--inbound",
                "0.0.0.0:4143=orig-dst",
                "--inbound",
                "[::]:4143=orig-dst",
                "--outbound",
                "0.0.0.0:4140=orig-dst",
                "--outbound",
                "[::]:4140=orig-dst",
                "--admin=[::]:4191",
            ],
        )
    });
    Arc::new(proxy)
}

/// Waits (boundedly) until `addr` accepts connections (a fresh veth takes a moment).
fn reachable(addr: SocketAddr) {
    support::wait_until(&format!("{addr} reachable"), support::PATIENCE, || {
        TcpStream::connect_timeout(&addr, std::time::Duration::from_millis(200)).is_ok()
    });
}

fn get_status(addr: SocketAddr, path: &str) -> u16 {
    let mut client = send_raw(addr, &get(path));
    read_response(&mut client).unwrap().status
}

#[test]
fn lameduck_iptables_sends_the_pods_traffic_through_the_proxy_and_skips_what_it_is_told() {
    let Some((pod, peer)) = pod_and_peer_for(
        "lameduck_iptables_sends_the_pods_traffic_through_the_proxy_and_skips_what_it_is_told",
        'i',
    ) else {
        return;
    };
    // The peer: a server on every address, and one on a port the pod skips.
    let (server, skipped) = peer.run(|| {
        let any: SocketAddr = "[::]:0".parse().unwrap();
        (Backend::start_on(any), Backend::start_on(any))
    });
    let (server_port, skipped_port) = (server.addr.port(), skipped.addr.port());
    let peer_v4: IpAddr = "10.78.0.1".parse().unwrap();
    let peer_v6: IpAddr = "fd78::1".parse().unwrap();
    let pod_v4: IpAddr = "10.78.0.2".parse().unwrap();
    let pod_v6: IpAddr = "fd78::2".parse().unwrap();

    let app_port = pod.run(move || {
        let skipped_port = skipped_port.to_string();
        let args = [
            "--proxy-uid",
            PROXY_UID,
            "--skip-outbound-ports",
            &skipped_port,
            "--skip-outbound-cidrs",
            "10.78.0.3/32,fd78::3",
        ];
        let (status, _, stderr) = lameduck_iptables(&args);
        assert_eq!(status, Some(0), "{stderr}");
        let installed = nat_rules();
        // Twice changes nothing.
        let (status, _, stderr) = lameduck_iptables(&args);
        assert_eq!(status, Some(0), "{stderr}");
        assert_eq!(nat_rules(), installed);
        assert!(installed.contains("LAMEDUCK_OUTPUT"), "{installed}");
        let app = Backend::start_on("[::]:0".parse().unwrap());
        let port = app.addr.port();
        std::mem::forget(app);
        port
    });
    let proxy = start_pod_proxy(&pod);
    let count = {
        let (pod, proxy) = (pod.clone(), proxy.clone());
        move |direction: &'static str| {
            let proxy = proxy.clone();
            pod.run(move || {
                proxy.metric(&format!(
                    "lameduck_connections_total{{direction=\"{direction}\",protocol=\"http1\"}}"
                ))
            })
        }
    };

    // Inbound, from the peer: the app's port goes through the proxy, the admin port does not.
    peer.run(move || {
        reachable(SocketAddr::new(pod_v4, 4191));
        for pod_ip in [pod_v4, pod_v6] {
            assert_eq!(get_status(SocketAddr::new(pod_ip, app_port), "/in"), 200);
            let ready = support::http(SocketAddr::new(pod_ip, 4191), "GET", "/ready", &[]);
            assert_eq!(ready.status, 200, "{pod_ip}");
        }
    });
    assert_eq!(count("inbound"), 2.0);
    // A connection held open is listed, going to the pod's address and the app's port.
    let held = peer.run(move || {
        let mut held = send_raw(SocketAddr::new(pod_v4, app_port), &get("/held"));
        assert_eq!(read_response(&mut held).unwrap().status, 200);
        held
    });
    let listed = {
        let proxy = proxy.clone();
        pod.run(move || proxy.open_connections())
    };
    assert!(
        listed.iter().any(|conn| conn["direction"] == "inbound"
            && conn["target"] == SocketAddr::new(pod_v4, app_port).to_string()),
        "{listed:?}"
    );
    drop(held);

    // Outbound, from the app: through the proxy, whose own connection is not redirected again;
    // skipped ports and CIDRs go straight out.
    pod.run(move || {
        for peer_ip in [peer_v4, peer_v6] {
            assert_eq!(
                get_status(SocketAddr::new(peer_ip, server_port), "/out"),
                200
            );
        }
    });
    assert_eq!(count("outbound"), 2.0);
    assert_eq!(server.seen_paths(), ["/out", "/out"]);
    pod.run(move || {
        assert_eq!(
            get_status(SocketAddr::new(peer_v4, skipped_port), "/skipped-port"),
            200
        );
        let skipped_cidr: IpAddr = "10.78.0.3".parse().unwrap();
        assert_eq!(
            get_status(SocketAddr::new(skipped_cidr, server_port), "/skipped-cidr"),
            200
        );
    });
    assert_eq!(
        count("outbound"),
        2.0,
        "skipped traffic went through the proxy"
    );
    assert_eq!(server.seen_paths(), ["/out", "/out", "/skipped-cidr"]);
    assert_eq!(skipped.seen_paths(), ["/skipped-port"]);
}

/// The rules of each option set, as `--dry-run` prints them, against the golden files in
/// `tests/iptables/` (the files are the review copy of what a pod gets).
#[test]
fn lameduck_iptables_dry_run_prints_the_rules_of_each_option_set() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/iptables");
    for (golden, args) in [
        ("default.rules", vec![]),
        (
            "skips.rules",
            vec![
                "--skip-inbound-ports",
                "22,4191,9090",
                "--skip-outbound-ports",
                "25,443,3306,5432,6379,8080,8081,8082,8083,8084,8085,8086,8087,8088,8089,8090",
                "--skip-outbound-cidrs",
                "10.0.0.0/8,169.254.169.254,fd00::/8",
            ],
        ),
        (
            "ports.rules",
            vec![
                "--inbound-port",
                "15006",
                "--outbound-port",
                "15001",
                "--admin-port",
                "15021",
                "--proxy-uid",
                "1337",
                "--backend",
                "legacy",
            ],
        ),
    ] {
        let mut all = vec!["--dry-run"];
        all.extend(args);
        let (status, rules, stderr) = lameduck_iptables(&all);
        assert_eq!(status, Some(0), "{golden}: {stderr}");
        let path = dir.join(golden);
        if std::env::var_os("LAMEDUCK_UPDATE_GOLDEN").is_some() {
            std::fs::write(&path, &rules).unwrap();
        }
        let expected = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            rules, expected,
            "{golden} (LAMEDUCK_UPDATE_GOLDEN=1 rewrites it)"
        );
    }
    // Bad values: a clear error, status 2, nothing printed.
    for bad in [
        vec!["--skip-outbound-cidrs", "10.0.0.0/33"],
        vec!["--skip-inbound-ports", "0"],
        vec!["--inbound-port", "4140"],
        vec!["--backend", "ebpf"],
    ] {
        let mut all = vec!["--dry-run"];
        all.extend(bad.iter().copied());
        let (status, out, stderr) = lameduck_iptables(&all);
        assert_eq!(status, Some(2), "{bad:?}: {stderr}");
        assert!(out.is_empty(), "{bad:?}: {out}");
        assert!(
            stderr.contains("lameduck") || stderr.contains("error"),
            "{stderr}"
        );
    }
}

/// Rules that do not exempt the proxy (a wrong uid) send its own outbound connections back to
/// it: each comes from one of its own ports and is refused, once, instead of forwarded round
/// and round. The app's request fails (502), the proxy stays healthy and holds nothing.
#[test]
fn the_proxys_own_connections_sent_back_to_it_are_refused_not_forwarded_again() {
    let Some((pod, peer)) = pod_and_peer_for(
        "the_proxys_own_connections_sent_back_to_it_are_refused_not_forwarded_again",
        'l',
    ) else {
        return;
    };
    let server = peer.run(|| Backend::start_on("[::]:0".parse().unwrap()));
    let server_port = server.addr.port();
    pod.run(|| {
        let (status, _, stderr) = lameduck_iptables(&["--proxy-uid", "9999"]);
        assert_eq!(status, Some(0), "{stderr}");
    });
    let proxy = start_pod_proxy(&pod);
    let descriptors = |pid: i32| {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .count()
    };
    let before = descriptors(proxy.pid());
    let in_pod = proxy.clone();
    pod.run(move || {
        let peer: IpAddr = "10.78.0.1".parse().unwrap();
        support::wait_until("the peer is reachable", support::PATIENCE, || {
            get_status(SocketAddr::new(peer, server_port), "/") == 502
        });
        for round in 1..=3 {
            assert_eq!(get_status(SocketAddr::new(peer, server_port), "/"), 502);
            let refused = in_pod.metric(
                "lameduck_connections_refused_total{direction=\"outbound\",reason=\"loop\"}",
            );
            assert!(refused >= f64::from(round + 1), "round {round}: {refused}");
        }
        in_pod.wait_open_connections(0);
        assert_eq!(in_pod.get("/ready").status, 200);
    });
    assert!(server.seen_paths().is_empty(), "{:?}", server.seen_paths());
    let after = descriptors(proxy.pid());
    assert!(
        after <= before + 2,
        "descriptors: {before} before, {after} after"
    );
}

/// Without the tool, or without the capabilities, `lameduck iptables` says which and exits 1,
/// having installed nothing.
#[test]
fn lameduck_iptables_says_what_is_missing() {
    let test = "lameduck_iptables_says_what_is_missing";
    if let Some(why) = unsupported() {
        return support::skip(test, why);
    }
    let Some(netns) = NetNs::new("ipt-missing") else {
        return support::skip(
            test,
            "cannot make a network namespace (needs root and ip(8))",
        );
    };
    Arc::new(netns).run(|| {
        // No iptables on the PATH.
        let out = Command::new(BIN)
            .arg("iptables")
            .env("PATH", "/nonexistent")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("iptables-nft-save not found"), "{stderr}");
        // Not root, no capabilities.
        let out = Command::new("setpriv")
            .args([
                "--reuid=4321",
                "--regid=4321",
                "--clear-groups",
                BIN,
                "iptables",
            ])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("NET_ADMIN and NET_RAW"), "{stderr}");
        assert!(!nat_rules().contains("LAMEDUCK"), "{}", nat_rules());
    });
}
