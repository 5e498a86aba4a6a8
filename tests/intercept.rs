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

/// Runs a command inside the current thread's network namespace; panics with its output.
fn run(program: &str, args: &[&str]) {
    let out = Command::new(program).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
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
    if let Some(why) = unsupported() {
        return support::skip(test, why);
    }
    // The test's name in the namespace's: tests run in parallel.
    let tag: String = test.split('_').map(|word| &word[..1]).collect();
    let Some(netns) = NetNs::new(&tag) else {
        return support::skip(
            test,
            "cannot make a network namespace (needs root and ip(8))",
        );
    };
    Arc::new(netns).run(work);
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
