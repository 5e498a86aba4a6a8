//! What the pod tests run in their pods and how their clients talk to them: the images (the
//! lameduck binary, the test app `app.py`), and one HTTP/1.1 exchange judged as a client of a
//! real service would judge it. Shared by tests/pod.rs and tests/rollout.rs, each of which uses
//! part of it.

#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::io::{ErrorKind, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use crate::kubelet::Image;
use crate::support::BIN;
use crate::support::backend::{Backend, read_response};

/// The images: `lameduck:<version>` and `lameduck-init:<version>` (the binary), and
/// `testapp:graceful`, `testapp:immediate` (app.py), `testapp:echo` (a line echo on port 8082,
/// opaque TCP) and `testapp:wait` (an init container that calls `$UPSTREAM` once with
/// `id=$ID` and fails unless it answers).
pub fn images() -> HashMap<String, Image> {
    let app = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/pod/app.py")
        .display()
        .to_string();
    let mut images = HashMap::new();
    for image in [
        lameduck::commands::inject::DEFAULT_IMAGE,
        lameduck::commands::inject::DEFAULT_INIT_IMAGE,
    ] {
        images.insert(
            image.to_string(),
            Image {
                entrypoint: vec!["/usr/local/bin/lameduck".into()],
                files: vec![("/usr/local/bin/lameduck".into(), BIN.into())],
            },
        );
    }
    let wait = "import os, sys, urllib.request\n\
                url = 'http://' + os.environ['UPSTREAM'] + '/work?id=' + os.environ['ID']\n\
                try:\n    sys.exit(0 if urllib.request.urlopen(url, timeout=5).status == 200 else 1)\n\
                except OSError as error:\n    sys.exit(f'{url}: {error}')\n";
    images.insert(
        "testapp:wait".into(),
        Image {
            entrypoint: vec!["python3".into(), "-c".into(), wait.into()],
            files: Vec::new(),
        },
    );
    // An opaque TCP app: echoes each line; on SIGTERM it stops accepting, lets the open
    // streams finish and exits.
    let echo = "import signal, socket, socketserver, sys, threading\n\
                class Echo(socketserver.StreamRequestHandler):\n    def handle(self):\n        for line in self.rfile:\n            self.wfile.write(line)\n\
                class Server(socketserver.ThreadingTCPServer):\n    allow_reuse_address = True\n    daemon_threads = False\n    block_on_close = True\n\
                server = Server(('0.0.0.0', 8082), Echo)\n\
                signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())\n\
                server.serve_forever()\nserver.server_close()\n";
    images.insert(
        "testapp:echo".into(),
        Image {
            entrypoint: vec!["python3".into(), "-c".into(), echo.into()],
            files: Vec::new(),
        },
    );
    for mode in ["graceful", "immediate"] {
        images.insert(
            format!("testapp:{mode}"),
            Image {
                entrypoint: vec!["python3".into(), app.clone(), mode.into()],
                files: Vec::new(),
            },
        );
    }
    images
}

/// The status of a GET of `path` at `addr`; None when it cannot be had.
pub fn status_of(addr: SocketAddr, path: &str) -> Option<u16> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: shop\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    read_response(&mut stream)
        .ok()
        .map(|response| response.status)
}

/// How one request went, for its client.
pub enum Answer {
    /// 200; `closing`: the connection is not to be used again.
    Ok { closing: bool },
    /// Anything but a 200, or an error: a failed request.
    Failed(String),
    /// A reused keep-alive connection closed before any byte of the response: every HTTP
    /// client sends such a request again on a new connection (right only if the app never
    /// saw it, which the tests check against the upstream's record).
    Retry,
}

/// Sends `GET /work?id=ID` on `stream` (a `POST` with a small body when `post`) and reads the
/// answer; `reused` says whether the connection served a request before.
pub fn exchange(
    stream: &mut TcpStream,
    id: u64,
    keep_alive: bool,
    reused: bool,
    post: bool,
) -> Answer {
    let close = if keep_alive {
        ""
    } else {
        "Connection: close\r\n"
    };
    let (method, body) = match post {
        true => ("POST", "Content-Length: 5\r\n\r\norder"),
        false => ("GET", "\r\n"),
    };
    let request = format!("{method} /work?id={id} HTTP/1.1\r\nHost: shop\r\n{close}{body}");
    let response = stream
        .write_all(request.as_bytes())
        .and_then(|()| read_response(stream));
    match response {
        Ok(response) if response.status == 200 => Answer::Ok {
            closing: !keep_alive || response.header("connection") == Some("close"),
        },
        Ok(response) => Answer::Failed(format!(
            "id {id}: {} {}",
            response.status,
            String::from_utf8_lossy(&response.body).trim()
        )),
        Err(error)
            if reused
                && matches!(
                    error.kind(),
                    ErrorKind::ConnectionAborted
                        | ErrorKind::ConnectionReset
                        | ErrorKind::BrokenPipe
                ) =>
        {
            Answer::Retry
        }
        Err(error) => Answer::Failed(format!("id {id}: {error}")),
    }
}

/// What a load's clients saw.
#[derive(Debug, Default)]
pub struct Tally {
    pub ok: usize,
    /// Of those, answered after the pod's deletion started.
    pub ok_after_deletion: usize,
    /// Connections opened after the pod's deletion started.
    pub new_connections_after_deletion: usize,
    /// Of the answered, answered to HTTP/2 clients.
    pub ok_h2: usize,
    /// Of the answered, echoed over opaque TCP.
    pub ok_tcp: usize,
    pub retried: usize,
    pub failed: Vec<String>,
    /// Ids of the requests whose client got a response.
    pub answered: HashSet<u64>,
    /// Ids of the retried requests (their connection ended before any byte of a response).
    pub retried_ids: HashSet<u64>,
}

impl Tally {
    /// Counts how request `id` went; true when its connection serves on.
    pub fn record(&mut self, id: u64, answer: Answer, after_deletion: bool) -> bool {
        match answer {
            Answer::Ok { closing } => {
                self.ok += 1;
                self.answered.insert(id);
                if after_deletion {
                    self.ok_after_deletion += 1;
                }
                !closing
            }
            Answer::Retry => {
                self.retried += 1;
                self.retried_ids.insert(id);
                false
            }
            Answer::Failed(why) => {
                self.failed.push(why);
                false
            }
        }
    }
}

/// The ids of the requests the upstream saw, from its record (`/upstream?id=N`).
pub fn upstream_ids(upstream: &Backend) -> HashSet<u64> {
    upstream
        .seen()
        .iter()
        .filter_map(|seen| seen.uri.split("id=").nth(1)?.parse().ok())
        .collect()
}
