//! An HTTP test backend (HTTP/1.1 and HTTP/2 prior knowledge on one port) that records every
//! request it sees, and a small raw HTTP/1 client that reads responses off the wire.

use std::collections::HashMap;
use std::convert::Infallible;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What the backend saw of one request.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub path: String,
    /// The request target as it arrived (origin form, or absolute form).
    pub uri: String,
    /// Which of the backend's connections it came on (0 for the first accepted).
    pub connection: usize,
    pub version: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// The body was read to its end (a body cut short or malformed reads as empty).
    pub complete: bool,
}

impl Seen {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }
}

type Body = BoxBody<Bytes, std::io::Error>;

pub struct Backend {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Seen>>>,
}

impl Backend {
    pub fn start() -> Backend {
        Backend::start_on("127.0.0.1:0".parse().unwrap())
    }

    /// A backend listening on `listen` (port 0: any).
    pub fn start_on(listen: SocketAddr) -> Backend {
        let (tx, rx) = std::sync::mpsc::channel();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let recorded = seen.clone();
        thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::bind(listen).await.unwrap();
                tx.send(listener.local_addr().unwrap()).unwrap();
                for connection in 0.. {
                    let Ok((stream, _)) = listener.accept().await else {
                        continue;
                    };
                    let recorded = recorded.clone();
                    tokio::spawn(async move {
                        let service = hyper::service::service_fn(move |request| {
                            handle(request, connection, recorded.clone())
                        });
                        let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                            .serve_connection_with_upgrades(TokioIo::new(stream), service)
                            .await;
                    });
                }
            });
        });
        Backend {
            addr: rx.recv().unwrap(),
            seen,
        }
    }

    pub fn route(&self, listen: &str) -> String {
        format!("{listen}={}", self.addr)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    pub fn seen_paths(&self) -> Vec<String> {
        self.seen().into_iter().map(|seen| seen.path).collect()
    }
}

fn query(request: &Request<Incoming>) -> HashMap<String, String> {
    request
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn full(status: StatusCode, body: impl Into<Bytes>) -> Response<Body> {
    let mut response = Response::new(
        Full::new(body.into())
            .map_err(|never| match never {})
            .boxed(),
    );
    *response.status_mut() = status;
    response
}

/// A body of `chunks` chunks of `size` bytes, one every `interval`, then an error if `fail`.
fn streamed(chunks: usize, size: usize, interval: Duration, fail: bool) -> Body {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(1);
    tokio::spawn(async move {
        for _ in 0..chunks {
            if tx
                .send(Ok(Frame::data(Bytes::from(vec![b'x'; size]))))
                .await
                .is_err()
            {
                return;
            }
            tokio::time::sleep(interval).await;
        }
        if fail {
            let _ = tx
                .send(Err(std::io::Error::other("the backend died")))
                .await;
        }
    });
    StreamBody::new(tokio_stream_from(rx)).boxed()
}

fn tokio_stream_from<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures_util::Stream<Item = T> + Send + 'static {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

async fn handle(
    mut request: Request<Incoming>,
    connection: usize,
    recorded: Arc<Mutex<Vec<Seen>>>,
) -> Result<Response<Body>, Infallible> {
    let q = query(&request);
    let num = |key: &str, default: u64| q.get(key).and_then(|v| v.parse().ok()).unwrap_or(default);
    let path = request.uri().path().to_string();
    let uri = request.uri().to_string();
    let method = request.method().to_string();
    let version = format!("{:?}", request.version());
    let headers = request
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let upgrade = hyper::upgrade::on(&mut request);
    // `/early` answers without reading the request body (an app rejecting an upload early).
    let (body, complete) = if path == "/ws" || path == "/early" {
        (Vec::new(), true)
    } else {
        match request.into_body().collect().await {
            Ok(body) => (body.to_bytes().to_vec(), true),
            Err(_) => (Vec::new(), false),
        }
    };
    let seen = Seen {
        method,
        path: request_path(&path, &q),
        uri,
        connection,
        version,
        headers,
        body: body.clone(),
        complete,
    };
    recorded.lock().unwrap().push(seen);

    let response = match path.as_str() {
        "/delay" => {
            tokio::time::sleep(Duration::from_millis(num("ms", 0))).await;
            full(StatusCode::OK, vec![b'x'; num("size", 2) as usize])
        }
        "/slow" => {
            let chunks = num("chunks", 10) as usize;
            let size = num("size", 1024) as usize;
            let mut response = Response::new(streamed(
                chunks,
                size,
                Duration::from_millis(num("interval", 20)),
                false,
            ));
            response
                .headers_mut()
                .insert("content-length", (chunks * size).into());
            response
        }
        "/forever" => Response::new(streamed(usize::MAX, 1024, Duration::from_millis(50), false)),
        // Server-sent events, forever: a 1 KiB event every 50 ms.
        "/events" => {
            let mut response =
                Response::new(streamed(usize::MAX, 1024, Duration::from_millis(50), false));
            response
                .headers_mut()
                .insert("content-type", "text/event-stream".parse().unwrap());
            response
        }
        "/die" => {
            let mut response = Response::new(streamed(
                num("chunks", 40) as usize,
                10_000,
                Duration::from_millis(5),
                true,
            ));
            response
                .headers_mut()
                .insert("content-length", num("length", 1_000_000).into());
            response
        }
        "/hang" => std::future::pending().await,
        "/echo" => full(StatusCode::OK, body),
        "/early" => full(StatusCode::OK, "early"),
        "/hop" => {
            let mut response = full(StatusCode::OK, "hop");
            let headers = response.headers_mut();
            headers.insert("connection", "x-secret".parse().unwrap());
            headers.insert("x-secret", "1".parse().unwrap());
            headers.insert("keep-alive", "timeout=5".parse().unwrap());
            headers.insert("proxy-connection", "keep-alive".parse().unwrap());
            headers.insert("x-kept", "yes".parse().unwrap());
            response
        }
        "/ws" => {
            tokio::spawn(async move {
                if let Ok(upgraded) = upgrade.await {
                    let mut io = TokioIo::new(upgraded);
                    let mut buf = [0u8; 4096];
                    loop {
                        match io.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                if io.write_all(&buf[..n]).await.is_err() {
                                    break;
                                }
                            }
                        }
                    }
                }
            });
            let mut response = full(StatusCode::SWITCHING_PROTOCOLS, Bytes::new());
            response
                .headers_mut()
                .insert("upgrade", "websocket".parse().unwrap());
            response
                .headers_mut()
                .insert("connection", "upgrade".parse().unwrap());
            response
        }
        _ => full(StatusCode::OK, "ok"),
    };
    Ok(response)
}

fn request_path(path: &str, q: &HashMap<String, String>) -> String {
    match q.get("id") {
        Some(id) => format!("{path}?id={id}"),
        None => path.to_string(),
    }
}

/// A response read off the wire by [`read_response`].
#[derive(Debug)]
pub struct WireResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl WireResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }
}

/// Reads one HTTP/1.1 response (Content-Length or chunked) from `stream`. A connection closed
/// (FIN or RST) before any byte of the response is `ConnectionAborted`: the case in which HTTP
/// clients retry a request on a fresh connection.
pub fn read_response(stream: &mut TcpStream) -> std::io::Result<WireResponse> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let read = match stream.read(&mut byte) {
            Err(error) if head.is_empty() && error.kind() == ErrorKind::ConnectionReset => 0,
            read => read?,
        };
        if read == 0 {
            let kind = match head.is_empty() {
                true => ErrorKind::ConnectionAborted,
                false => ErrorKind::UnexpectedEof,
            };
            let head = String::from_utf8_lossy(&head);
            return Err(std::io::Error::new(
                kind,
                format!("closed in the head: {head:?}"),
            ));
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|line| line.split(' ').nth(1))
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let response = WireResponse {
        status,
        headers,
        body: Vec::new(),
    };
    let mut body = Vec::new();
    if let Some(length) = response.header("content-length") {
        let length: usize = length.parse().unwrap();
        body.resize(length, 0);
        stream.read_exact(&mut body)?;
    } else if response
        .header("transfer-encoding")
        .is_some_and(|te| te.contains("chunked"))
    {
        loop {
            let mut line = Vec::new();
            while !line.ends_with(b"\r\n") {
                if stream.read(&mut byte)? == 0 {
                    return Err(ErrorKind::UnexpectedEof.into());
                }
                line.push(byte[0]);
            }
            let size = usize::from_str_radix(String::from_utf8_lossy(&line).trim(), 16).unwrap();
            let mut chunk = vec![0u8; size + 2];
            stream.read_exact(&mut chunk)?;
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    } else if status >= 200 && status != 204 && status != 304 {
        stream.read_to_end(&mut body)?;
    }
    Ok(WireResponse { body, ..response })
}

/// Sends raw bytes on a fresh connection to `addr`.
pub fn send_raw(addr: SocketAddr, bytes: &[u8]) -> TcpStream {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(super::PATIENCE)).unwrap();
    stream.write_all(bytes).unwrap();
    stream
}

/// `GET path` with HTTP/1.1 keep-alive.
pub fn get(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: app.local\r\n\r\n").into_bytes()
}

/// The proxy with one inbound route (protocol `auto`) to `backend`, and `extra` flags.
pub fn proxy_for(backend: &Backend, extra: &[&str]) -> super::Proxy {
    let route = backend.route("127.0.0.1:0");
    let mut args = vec!["--inbound", route.as_str()];
    args.extend_from_slice(extra);
    super::Proxy::start(&args)
}
