//! The app's own probes, run by the proxy for the kubelet (docs/kubernetes.md, "Probes"): the
//! kubelet asks `/app-health/<container>/<probe>` on the admin port, the proxy runs the probe
//! the app declared against the app and answers with what the kubelet would have concluded.
//! Probes keep their meaning (a failing app fails its probe), and they never reach the inbound
//! routes, so they never keep a lame duck open, wherever they come from.

mod support;

use std::convert::Infallible;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper::{Request, Response};
use support::scripted::{After, Scripted, read_request};
use support::{EchoServer, Proxy};

/// A proxy that runs `probes` (the JSON of `--app-probes`) against the app on 127.0.0.1.
fn prober(probes: &str, extra: &[&str]) -> Proxy {
    let mut command = support::command();
    command.env("LAMEDUCK_APP_PROBES", probes);
    let mut args = vec!["--inbound", "127.0.0.1:0=127.0.0.1:9"];
    args.extend_from_slice(extra);
    Proxy::start_command(&mut command, &args)
}

/// `GET path` on the admin server as the kubelet sends it.
fn kubelet_get(proxy: &Proxy, path: &str) -> support::HttpResponse {
    support::http(
        proxy.admin,
        "GET",
        path,
        &[("User-Agent", "kube-probe/1.33")],
    )
}

/// The status of `GET path`, if it can be had (the proxy may be exiting).
fn probe_status(admin: SocketAddr, path: &str) -> Option<u16> {
    let mut stream = std::net::TcpStream::connect(admin).ok()?;
    stream.set_read_timeout(Some(support::PATIENCE)).ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).ok()?;
    std::str::from_utf8(raw.get(9..12)?).ok()?.parse().ok()
}

fn answer(status: &str, extra: &str) -> String {
    format!("HTTP/1.1 {status}\r\nContent-Length: 0\r\n{extra}\r\n")
}

#[test]
fn an_http_probe_answers_what_the_app_answered() {
    let app = Scripted::start(|path| match path {
        "/healthz" => (answer("200 OK", ""), After::Close),
        "/sick" => (answer("500 Internal Server Error", ""), After::Close),
        "/missing" => (answer("404 Not Found", ""), After::Close),
        "/moved" => (answer("302 Found", "Location: /healthz\r\n"), After::Close),
        "/away" => (
            answer("302 Found", "Location: http://elsewhere.example/\r\n"),
            After::Close,
        ),
        "/loop" => (answer("302 Found", "Location: /loop\r\n"), After::Close),
        _ => (String::new(), After::Hang),
    });
    let port = app.addr.port();
    let closed = support::closed_port();
    let get = |path: &str| {
        format!(
            r#"{{"httpGet": {{"path": "{path}", "port": {port},
                 "httpHeaders": [{{"name": "X-Probe", "value": "ready"}}]}}}}"#
        )
    };
    let probes = format!(
        r#"{{"/app-health/app/readyz": {healthz}, "/app-health/app/livez": {sick},
             "/app-health/app/startupz": {missing}, "/app-health/moved/readyz": {moved},
             "/app-health/away/readyz": {away}, "/app-health/loop/readyz": {looping},
             "/app-health/hang/readyz": {hang}, "/app-health/gone/readyz": {gone}}}"#,
        healthz = get("/healthz"),
        sick = get("/sick"),
        missing = get("/missing"),
        moved = get("/moved"),
        away = get("/away"),
        looping = get("/loop"),
        hang = get("/hang"),
        gone = r#"{"httpGet": {"path": "/", "port": PORT}}"#
            .replace("PORT", &closed.addr.port().to_string()),
    );
    let proxy = prober(&probes, &[]);
    let ready = kubelet_get(&proxy, "/app-health/app/readyz");
    assert_eq!(ready.status, 200, "{}", ready.body);
    // Sent as the kubelet sends it: the probe's headers, the kubelet's agent, the pod's address.
    let head = app.heads.lock().unwrap()[0].clone();
    for line in [
        "GET /healthz HTTP/1.1",
        "x-probe: ready",
        "user-agent: kube-probe/1.33",
        &format!("host: 127.0.0.1:{port}"),
    ] {
        assert!(
            head.to_ascii_lowercase()
                .contains(&line.to_ascii_lowercase()),
            "{line} in {head}"
        );
    }
    // A failing app still fails: its own status reaches the kubelet.
    assert_eq!(kubelet_get(&proxy, "/app-health/app/livez").status, 500);
    assert_eq!(kubelet_get(&proxy, "/app-health/app/startupz").status, 404);
    // Redirects as the kubelet takes them: followed on the same host, a pass to another one,
    // a failure after ten.
    let before = app.heads.lock().unwrap().len();
    assert_eq!(kubelet_get(&proxy, "/app-health/moved/readyz").status, 200);
    let followed: Vec<String> = app.heads.lock().unwrap()[before..]
        .iter()
        .map(|head| head.lines().next().unwrap().to_string())
        .collect();
    assert_eq!(followed, ["GET /moved HTTP/1.1", "GET /healthz HTTP/1.1"]);
    assert_eq!(kubelet_get(&proxy, "/app-health/away/readyz").status, 200);
    let looping = kubelet_get(&proxy, "/app-health/loop/readyz");
    assert_eq!(looping.status, 503);
    assert!(looping.body.contains("10 redirects"), "{}", looping.body);
    // No answer within the probe's timeout (the kubelet's default, 1 s), or no app at all.
    let started = Instant::now();
    let hang = kubelet_get(&proxy, "/app-health/hang/readyz");
    assert_eq!(hang.status, 503);
    assert!(hang.body.contains("no answer within 1s"), "{}", hang.body);
    assert!(started.elapsed() >= Duration::from_millis(900));
    let gone = kubelet_get(&proxy, "/app-health/gone/readyz");
    assert_eq!(gone.status, 503);
    assert!(gone.body.contains("cannot connect"), "{}", gone.body);
    // Paths the app declared no probe for, and other methods.
    assert_eq!(kubelet_get(&proxy, "/app-health/app/other").status, 404);
    assert_eq!(
        support::http(proxy.admin, "POST", "/app-health/app/readyz", &[]).status,
        405
    );
}

#[test]
fn a_tcp_probe_passes_while_the_app_listens() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let proxy = prober(
        &format!(r#"{{"/app-health/app/livez": {{"tcpSocket": {{"port": {port}}}}}}}"#),
        &[],
    );
    assert_eq!(kubelet_get(&proxy, "/app-health/app/livez").status, 200);
    drop(listener);
    assert_eq!(kubelet_get(&proxy, "/app-health/app/livez").status, 503);
}

#[test]
fn an_https_probe_does_not_verify_the_apps_certificate() {
    let app = tls_app();
    let proxy = prober(
        &format!(
            r#"{{"/app-health/app/readyz": {{"httpGet": {{"scheme": "HTTPS", "port": {}, "path": "/healthz"}}}}}}"#,
            app.port()
        ),
        &[],
    );
    let ready = kubelet_get(&proxy, "/app-health/app/readyz");
    assert_eq!(ready.status, 200, "{}", ready.body);
}

#[test]
fn a_grpc_probe_asks_the_health_service_of_the_app() {
    let (addr, asked) = grpc_health_app();
    let probes = format!(
        r#"{{"/app-health/app/readyz": {{"grpc": {{"port": {port}, "service": "shop"}}}},
             "/app-health/app/livez": {{"grpc": {{"port": {port}}}}}}}"#,
        port = addr.port()
    );
    let proxy = prober(&probes, &[]);
    let ready = kubelet_get(&proxy, "/app-health/app/readyz");
    assert_eq!(ready.status, 200, "{}", ready.body);
    let live = kubelet_get(&proxy, "/app-health/app/livez");
    assert_eq!(live.status, 503);
    assert!(
        live.body.contains("not serving (status 2)"),
        "{}",
        live.body
    );
    assert_eq!(*asked.lock().unwrap(), ["shop", ""]);
}

/// The kubelet's probes reach the admin port, never an inbound route: they cannot keep a lame
/// duck open, whatever address they come from, where connections to the route do.
#[test]
fn probes_never_keep_the_lame_duck_open() {
    let echo = EchoServer::start();
    let route = echo.route("127.0.0.1:0");
    let lame_duck = |probe_the_route: bool| -> u64 {
        let probes = format!(
            r#"{{"/app-health/app/readyz": {{"tcpSocket": {{"port": {}}}}}}}"#,
            echo.addr.port()
        );
        let mut proxy = prober(
            &probes,
            &[
                "--inbound",
                &route,
                "--lame-duck-max",
                "4s",
                "--lame-duck-min",
                "1s",
                "--shutdown-grace-period",
                "10s",
            ],
        );
        let stop = Arc::new(AtomicBool::new(false));
        let kubelet = {
            let (stop, admin, inbound) = (stop.clone(), proxy.admin, proxy.inbound[1]);
            thread::spawn(move || {
                let mut passed = 0;
                while !stop.load(Ordering::SeqCst) {
                    match probe_the_route {
                        // A TCP probe as it was: a connection to the app's port, no byte.
                        true => drop(std::net::TcpStream::connect(inbound)),
                        false => {
                            let response = probe_status(admin, "/app-health/app/readyz");
                            passed += usize::from(response.is_some_and(|status| status == 200));
                        }
                    }
                    thread::sleep(Duration::from_millis(100));
                }
                passed
            })
        };
        thread::sleep(Duration::from_millis(300));
        proxy.signal(libc::SIGTERM);
        let over = proxy.logs.wait_for("the lame duck's end", |line| {
            line.contains("lame duck over")
        });
        stop.store(true, Ordering::SeqCst);
        let passed = kubelet.join().unwrap();
        assert!(
            probe_the_route || passed >= 5,
            "the app's probe passed {passed} times"
        );
        proxy.wait_exit(support::PATIENCE);
        let over: serde_json::Value = serde_json::from_str(&over).unwrap();
        over["fields"]["lasted_ms"].as_u64().unwrap()
    };
    let rewritten = lame_duck(false);
    assert!(
        rewritten < 2_500,
        "probes on the admin port held the lame duck {rewritten} ms (its minimum is 1 s)"
    );
    let through_the_route = lame_duck(true);
    assert!(
        through_the_route >= 3_900,
        "connections to the route every 100 ms kept it only {through_the_route} ms (max 4 s)"
    );
}

/// An HTTPS app with a self-signed certificate that answers 200 to anything.
fn tls_app() -> SocketAddr {
    let certified = rcgen::generate_simple_self_signed(vec!["shop.internal".into()]).unwrap();
    let chain = vec![certified.cert.der().clone()];
    let key =
        rustls::pki_types::PrivateKeyDer::try_from(certified.key_pair.serialize_der()).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .unwrap();
    let config = Arc::new(config);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let config = config.clone();
            thread::spawn(move || {
                let mut connection = rustls::ServerConnection::new(config).unwrap();
                let mut tls = rustls::Stream::new(&mut connection, &mut stream);
                if read_request(&mut tls).is_none() {
                    return;
                }
                let _ = tls.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
                let _ = tls.flush();
            });
        }
    });
    addr
}

/// A gRPC app whose health service says `SERVING` for the service `shop` and `NOT_SERVING`
/// for the whole server; records the services it was asked about.
fn grpc_health_app() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let asked = Arc::new(Mutex::new(Vec::new()));
    let record = asked.clone();
    thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let record = record.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(
                        move |request: Request<hyper::body::Incoming>| {
                            let record = record.clone();
                            async move {
                                assert_eq!(request.uri().path(), "/grpc.health.v1.Health/Check");
                                let body = request.into_body().collect().await.unwrap().to_bytes();
                                // A frame of a HealthCheckRequest: its field 1 is the service.
                                let service = match body.get(5..) {
                                    Some([0x0a, length, name @ ..])
                                        if name.len() == *length as usize =>
                                    {
                                        String::from_utf8(name.to_vec()).unwrap()
                                    }
                                    _ => String::new(),
                                };
                                let status = if service == "shop" { 1 } else { 2 };
                                record.lock().unwrap().push(service);
                                let mut trailers = hyper::HeaderMap::new();
                                trailers.insert("grpc-status", "0".parse().unwrap());
                                let frames = futures_util::stream::iter([
                                    Ok::<_, Infallible>(Frame::data(Bytes::from(vec![
                                        0, 0, 0, 0, 2, 0x08, status,
                                    ]))),
                                    Ok(Frame::trailers(trailers)),
                                ]);
                                let mut response = Response::new(StreamBody::new(frames));
                                response
                                    .headers_mut()
                                    .insert("content-type", "application/grpc".parse().unwrap());
                                Ok::<_, Infallible>(response)
                            }
                        },
                    );
                    let _ = hyper::server::conn::http2::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
                });
            }
        });
    });
    (addr, asked)
}
