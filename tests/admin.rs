//! The admin server of docs/admin.md: liveness and readiness through the shutdown, the
//! loopback-only shutdown endpoint, `/connections` and `/metrics`.

mod support;

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use support::*;

const FORBIDDEN: &str = "Requests are only permitted from localhost.\n";

#[test]
fn probes_answer_live_and_ready() {
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&["--inbound", &echo.route("127.0.0.1:0")]);
    let live = proxy.get("/live");
    assert_eq!((live.status, live.body.as_str()), (200, "live\n"));
    let ready = proxy.get("/ready");
    assert_eq!((ready.status, ready.body.as_str()), (200, "ready\n"));
    assert_eq!(http(proxy.admin, "HEAD", "/ready", &[]).status, 200);
    assert_eq!(proxy.get("/nothing-here").status, 404);
    let held = echo_connect(proxy.inbound[0]);
    proxy.signal(libc::SIGTERM);
    wait_until("/ready turns 503", PATIENCE, || {
        proxy.get("/ready").status == 503
    });
    assert_eq!(proxy.get("/ready").body, "not ready\n");
    assert_eq!(proxy.get("/live").body, "live\n");
    drop(held);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn shutdown_is_disabled_by_default() {
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&["--inbound", &echo.route("127.0.0.1:0")]);
    let response = proxy.post("/shutdown");
    assert_eq!(
        (response.status, response.body.as_str()),
        (404, "shutdown endpoint is not enabled\n")
    );
    thread::sleep(Duration::from_millis(200));
    assert!(proxy.is_running());
    assert_eq!(
        proxy.get("/ready").status,
        200,
        "a refused shutdown changes nothing"
    );
    echo_connect(proxy.inbound[0]);
}

#[test]
fn shutdown_only_answers_post_on_its_exact_path() {
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&[
        "--inbound",
        &echo.route("127.0.0.1:0"),
        "--shutdown-endpoint",
    ]);
    for method in ["GET", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH"] {
        let response = http(proxy.admin, method, "/shutdown", &[]);
        assert_eq!(response.status, 405, "{method} /shutdown");
        assert_eq!(
            response.header("allow").as_deref(),
            Some("POST"),
            "{method} /shutdown"
        );
    }
    for path in ["/shutdown/", "/SHUTDOWN", "/shutdown/now", "//shutdown"] {
        assert_eq!(
            http(proxy.admin, "POST", path, &[]).status,
            404,
            "POST {path}"
        );
    }
    thread::sleep(Duration::from_millis(200));
    assert!(proxy.is_running());
    assert_eq!(
        proxy.get("/ready").status,
        200,
        "nothing above started a shutdown"
    );
    // The query string is ignored (documented): this is the shutdown endpoint.
    assert_eq!(http(proxy.admin, "POST", "/shutdown?x", &[]).status, 200);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn shutdown_refuses_foreign_host_and_any_origin() {
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&[
        "--inbound",
        &echo.route("127.0.0.1:0"),
        "--shutdown-endpoint",
    ]);
    let cases: &[&[(&str, &str)]] = &[
        &[("Host", "evil.example:4191")],
        &[("Host", "127.0.0.1.nip.io")],
        &[("Host", "localhost.evil.example")],
        &[
            ("Origin", "http://evil.example"),
            ("Content-Type", "application/x-www-form-urlencoded"),
        ],
        &[
            ("Origin", "http://evil.example"),
            ("Content-Type", "text/plain"),
        ],
        &[("Origin", "null")],
        &[("Origin", "http://localhost:4191")],
    ];
    for headers in cases {
        let response = http(proxy.admin, "POST", "/shutdown", headers);
        assert_eq!(
            (response.status, response.body.as_str()),
            (403, FORBIDDEN),
            "{headers:?}"
        );
    }
    thread::sleep(Duration::from_millis(200));
    assert!(proxy.is_running());
    assert_eq!(proxy.get("/ready").status, 200);

    // Loopback names with and without ports pass.
    let held = echo_connect(proxy.inbound[0]);
    for host in ["localhost", "127.0.0.1", "[::1]:4191", "localhost:4191"] {
        assert_eq!(
            http(proxy.admin, "POST", "/shutdown", &[("Host", host)]).status,
            200,
            "Host: {host}"
        );
    }
    // An HTTP/1.0 request without Host comes from no browser: allowed.
    let mut raw = TcpStream::connect(proxy.admin).unwrap();
    raw.write_all(b"POST /shutdown HTTP/1.0\r\n\r\n").unwrap();
    let mut answer = Vec::new();
    raw.read_to_end(&mut answer).unwrap();
    assert_eq!(parse_response(&answer).status, 200);
    drop(held);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn a_thousand_parallel_shutdowns_start_exactly_one_drain() {
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&[
        "--inbound",
        &echo.route("127.0.0.1:0"),
        "--shutdown-endpoint",
    ]);
    let mut held = echo_connect(proxy.inbound[0]);
    let admin = proxy.admin;
    let workers: Vec<_> = (0..100)
        .map(|_| {
            thread::spawn(move || {
                (0..10)
                    .map(|_| http(admin, "POST", "/shutdown", &[]).status)
                    .collect::<Vec<u16>>()
            })
        })
        .collect();
    let statuses: Vec<u16> = workers
        .into_iter()
        .flat_map(|worker| worker.join().unwrap())
        .collect();
    assert_eq!(statuses.len(), 1000);
    assert!(
        statuses.iter().all(|&status| status == 200),
        "{:?}",
        statuses.iter().filter(|&&s| s != 200).collect::<Vec<_>>()
    );
    proxy.logs.wait_event("shutdown started");
    assert_eq!(
        proxy.logs.events("shutdown started").len(),
        1,
        "exactly one drain"
    );
    echo_round_trip(&mut held, b"still draining");
    drop(held);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    assert_eq!(proxy.logs.events("shutdown started").len(), 1);
}

#[test]
fn connections_lists_a_held_connection_with_its_fields() {
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&["--inbound", &echo.route("127.0.0.1:0")]);
    let since = Instant::now();
    let mut held = echo_connect(proxy.inbound[0]);
    echo_round_trip(&mut held, b"12345");
    // The echo reached the client before the proxy counted the bytes it wrote.
    wait_until("the echoed bytes are counted", PATIENCE, || {
        proxy.open_connections()[0]["bytes_to_peer"] == 10
    });
    let response = proxy.get("/connections");
    assert_eq!(response.status, 200);
    assert_eq!(
        response.header("content-type").as_deref(),
        Some("application/json")
    );
    let json: serde_json::Value = serde_json::from_str(&response.body).unwrap();
    let list = json["connections"].as_array().unwrap();
    assert_eq!(list.len(), 1, "{json}");
    let conn = &list[0];
    assert!(conn["id"].as_u64().is_some());
    assert_eq!(conn["direction"], "inbound");
    assert_eq!(conn["protocol"], "tcp");
    assert_eq!(conn["peer"], held.local_addr().unwrap().to_string());
    assert_eq!(conn["target"], echo.addr.to_string());
    let age = conn["age_ms"].as_u64().unwrap();
    assert!(age <= since.elapsed().as_millis() as u64, "{conn}");
    assert_eq!(conn["bytes_from_peer"], 10);
    assert_eq!(conn["bytes_to_peer"], 10);
    assert_eq!(conn["requests_in_flight"], 0);
    assert_eq!(conn["state"], "open");

    // Browsers are refused; the list is private to the pod.
    let response = http(
        proxy.admin,
        "GET",
        "/connections",
        &[("Origin", "http://evil.example")],
    );
    assert_eq!((response.status, response.body.as_str()), (403, FORBIDDEN));
    let response = http(
        proxy.admin,
        "GET",
        "/connections",
        &[("Host", "evil.example")],
    );
    assert_eq!(response.status, 403);

    drop(held);
    wait_until("the connection leaves the list", PATIENCE, || {
        proxy.get("/connections").body.trim() == "{\"connections\": [\n]}"
    });
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

#[test]
fn metrics_count_what_was_forwarded() {
    let echo = EchoServer::start();
    let mut proxy = Proxy::start(&[
        "--inbound",
        &format!("{}/tcp", echo.route("127.0.0.1:0")),
        "--outbound",
        &echo.route("127.0.0.1:0"),
    ]);
    let response = proxy.get("/metrics");
    assert!(
        response
            .header("content-type")
            .unwrap()
            .starts_with("application/openmetrics-text")
    );
    assert_eq!(
        proxy.metric("lameduck_shutdown_phase{phase=\"serving\"}"),
        1.0
    );
    assert_eq!(
        proxy.metric("lameduck_shutdown_started_timestamp_seconds"),
        0.0
    );

    let mut first = echo_connect(proxy.inbound[0]);
    echo_round_trip(&mut first, &[7u8; 1000]);
    let mut second = echo_connect(proxy.inbound[0]);
    let outbound = echo_connect(proxy.outbound[0]);
    assert_eq!(
        proxy.metric("lameduck_connections_open{direction=\"inbound\",protocol=\"tcp\"}"),
        2.0
    );
    assert_eq!(
        proxy.metric("lameduck_connections_open{direction=\"outbound\",protocol=\"tcp\"}"),
        1.0
    );
    // Bytes of open connections count at once, not only when they close.
    assert_eq!(
        proxy.metric("lameduck_bytes_from_peer_total{direction=\"inbound\"}"),
        1010.0
    );
    assert_eq!(
        proxy.metric("lameduck_bytes_to_peer_total{direction=\"inbound\"}"),
        1010.0
    );
    assert_eq!(
        proxy.metric("lameduck_bytes_from_peer_total{direction=\"outbound\"}"),
        5.0
    );

    drop(first);
    echo_round_trip(&mut second, b"x");
    wait_until("the closed connection leaves the gauge", PATIENCE, || {
        proxy.metric("lameduck_connections_open{direction=\"inbound\",protocol=\"tcp\"}") == 1.0
    });
    assert_eq!(
        proxy.metric("lameduck_connections_total{direction=\"inbound\",protocol=\"tcp\"}"),
        2.0
    );
    assert_eq!(
        proxy.metric("lameduck_connections_total{direction=\"outbound\",protocol=\"tcp\"}"),
        1.0
    );
    assert_eq!(
        proxy.metric("lameduck_bytes_from_peer_total{direction=\"inbound\"}"),
        1011.0,
        "closed connections keep their bytes"
    );

    proxy.signal(libc::SIGTERM);
    wait_until("the phase gauge says draining", PATIENCE, || {
        proxy.metric("lameduck_shutdown_phase{phase=\"draining\"}") == 1.0
    });
    assert!(proxy.metric("lameduck_shutdown_started_timestamp_seconds") > 1.7e9);
    drop(second);
    drop(outbound);
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
}

/// Runs `body` on a thread inside a new network namespace in which lo is up and also carries
/// 10.77.0.1, a non-loopback address. Everything the body creates (the proxy process, sockets)
/// lives in that namespace. Needs root, as CI has.
fn in_private_network<T: Send + 'static>(body: impl FnOnce() -> T + Send + 'static) -> T {
    thread::spawn(move || {
        // SAFETY: unshare(CLONE_NEWNET) changes only the calling thread's network namespace.
        let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert_eq!(
            rc,
            0,
            "unshare(CLONE_NEWNET) needs root: {}",
            std::io::Error::last_os_error()
        );
        for args in [
            &["link", "set", "lo", "up"][..],
            &["addr", "add", "10.77.0.1/32", "dev", "lo"],
        ] {
            let status = std::process::Command::new("ip")
                .args(args)
                .status()
                .expect("run ip(8)");
            assert!(status.success(), "ip {args:?}");
        }
        body()
    })
    .join()
    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// A request to `admin` from the source address `from`.
fn request_from(
    from: IpAddr,
    admin: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> HttpResponse {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(admin),
        socket2::Type::STREAM,
        None,
    )
    .unwrap();
    socket.bind(&SocketAddr::new(from, 0).into()).unwrap();
    socket
        .connect(&admin.into())
        .unwrap_or_else(|error| panic!("connect {from} -> {admin}: {error}"));
    http_on(socket.into(), method, path, headers)
}

#[test]
fn shutdown_from_non_loopback_is_forbidden_whatever_the_headers_say() {
    in_private_network(|| {
        let echo = EchoServer::start();
        let mut proxy = Proxy::start(&[
            "--inbound",
            &echo.route("127.0.0.1:0"),
            "--admin=0.0.0.0:0",
            "--shutdown-endpoint",
        ]);
        let outside: IpAddr = "10.77.0.1".parse().unwrap();
        let admin = SocketAddr::new(outside, proxy.admin.port());
        let spoofs: &[&[(&str, &str)]] = &[
            &[],
            &[("X-Forwarded-For", "127.0.0.1")],
            &[("X-Real-IP", "127.0.0.1")],
            &[("Forwarded", "for=127.0.0.1")],
            &[("Forwarded", "for=\"[::1]\"")],
            &[("Host", "localhost")],
        ];
        for headers in spoofs {
            let response = request_from(outside, admin, "POST", "/shutdown", headers);
            assert_eq!(
                (response.status, response.body.as_str()),
                (403, FORBIDDEN),
                "{headers:?}"
            );
            let response = request_from(outside, admin, "GET", "/connections", headers);
            assert_eq!(response.status, 403, "/connections {headers:?}");
            let response = request_from(outside, admin, "GET", "/status", headers);
            assert_eq!(response.status, 403, "/status {headers:?}");
            // The inbound quiesce is not on the admin port at all (a Unix socket in the pod).
            for path in ["/quiesce", "/drain", "/prestop"] {
                let response = request_from(outside, admin, "POST", path, headers);
                assert_eq!(response.status, 404, "{path} {headers:?}");
            }
        }
        // A PROXY-protocol header claiming loopback is just a bad request line here.
        let socket =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        socket.bind(&SocketAddr::new(outside, 0).into()).unwrap();
        socket.connect(&admin.into()).unwrap();
        let mut stream: TcpStream = socket.into();
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        stream
            .write_all(b"PROXY TCP4 127.0.0.1 127.0.0.1 1234 4191\r\nPOST /shutdown HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .unwrap();
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        assert!(
            !String::from_utf8_lossy(&answer).contains(" 200 "),
            "{}",
            String::from_utf8_lossy(&answer)
        );

        // Still serving a second later: nothing above started a shutdown.
        thread::sleep(Duration::from_secs(1));
        assert!(proxy.is_running());
        let mut held = echo_connect(proxy.inbound[0]);
        assert_eq!(proxy.get("/ready").status, 200);
        // Public probes are open to everyone.
        assert_eq!(
            request_from(outside, admin, "GET", "/ready", &[]).status,
            200
        );

        // Every loopback source is allowed.
        for from in ["127.0.0.1", "127.0.0.2"] {
            let from: IpAddr = from.parse().unwrap();
            let response = request_from(
                from,
                SocketAddr::new(from, proxy.admin.port()),
                "POST",
                "/shutdown",
                &[],
            );
            assert_eq!(response.status, 200, "from {from}");
        }
        wait_until("the drain started", PATIENCE, || {
            proxy.get("/ready").status == 503
        });
        echo_round_trip(&mut held, b"draining");
        drop(held);
        assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    });
}

#[test]
fn dual_stack_admin_judges_mapped_and_v6_peers() {
    in_private_network(|| {
        let echo = EchoServer::start();
        let mut proxy = Proxy::start(&[
            "--inbound",
            &echo.route("127.0.0.1:0"),
            "--admin=[::]:0",
            "--shutdown-endpoint",
        ]);
        let port = proxy.admin.port();
        let held = echo_connect(proxy.inbound[0]);
        // 10.77.0.1 over IPv4 reaches the dual-stack socket as ::ffff:10.77.0.1.
        let outside: IpAddr = "10.77.0.1".parse().unwrap();
        let response = request_from(
            outside,
            SocketAddr::new(outside, port),
            "POST",
            "/shutdown",
            &[],
        );
        assert_eq!(response.status, 403);
        thread::sleep(Duration::from_millis(200));
        assert_eq!(proxy.get("/ready").status, 200);
        // ::1 and ::ffff:127.0.0.1 are loopback.
        let v6: IpAddr = "::1".parse().unwrap();
        assert_eq!(
            request_from(v6, SocketAddr::new(v6, port), "POST", "/shutdown", &[]).status,
            200
        );
        let v4: IpAddr = "127.0.0.1".parse().unwrap();
        assert_eq!(
            request_from(v4, SocketAddr::new(v4, port), "POST", "/shutdown", &[]).status,
            200
        );
        drop(held);
        assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    });
}
