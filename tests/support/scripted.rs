//! A raw HTTP/1 target for framing tests: it answers each request with the bytes its script
//! returns for the path (the part before any `?`) and the connection's number, then does what
//! the script says (serve on, close, reset, hang), and records every head and connection. A
//! request's body (by `Content-Length`) is read before the answer.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

/// What the target does once it has written its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum After {
    KeepServing,
    Close,
    /// Closes with an RST, without writing the answer.
    Reset,
    /// Writes the answer after this long, then closes.
    Delay(Duration),
    /// Never answers; waits for the proxy to let go.
    Hang,
}

/// The script: the raw answer to a path on the connection of that number (from 0), and what
/// comes after it.
pub type Script = Arc<dyn Fn(&str, usize) -> (String, After) + Send + Sync>;

pub struct Scripted {
    pub addr: SocketAddr,
    /// Connections accepted so far.
    pub accepted: Arc<AtomicUsize>,
    /// Connections that ended (the peer closed them, or the script did).
    pub ended: Arc<AtomicUsize>,
    /// Every request head received, in order.
    pub heads: Arc<Mutex<Vec<String>>>,
}

impl Scripted {
    /// A target whose answers depend on the path alone.
    pub fn start(script: fn(&str) -> (String, After)) -> Scripted {
        Scripted::start_by_connection(Arc::new(move |path, _| script(path)))
    }

    pub fn start_by_connection(script: Script) -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let ended = Arc::new(AtomicUsize::new(0));
        let heads = Arc::new(Mutex::new(Vec::new()));
        let (counted, finished, seen) = (accepted.clone(), ended.clone(), heads.clone());
        thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let number = counted.fetch_add(1, Ordering::SeqCst);
                let (finished, seen, script) = (finished.clone(), seen.clone(), script.clone());
                thread::spawn(move || {
                    serve(stream, number, &*script, &seen);
                    finished.fetch_add(1, Ordering::SeqCst);
                });
            }
        });
        Scripted {
            addr,
            accepted,
            ended,
            heads,
        }
    }
}

fn serve(
    mut stream: TcpStream,
    number: usize,
    script: &(dyn Fn(&str, usize) -> (String, After) + Send + Sync),
    seen: &Mutex<Vec<String>>,
) {
    let mut byte = [0u8; 1];
    loop {
        let Some((head, _)) = read_request(&mut stream) else {
            return;
        };
        let target = head.split(' ').nth(1).unwrap_or("").to_string();
        let path = target.split('?').next().unwrap_or("").to_string();
        seen.lock().unwrap().push(head);
        let (answer, after) = script(&path, number);
        match after {
            After::Hang => {
                let _ = stream.read(&mut byte);
                return;
            }
            After::Reset => {
                let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
                return;
            }
            After::Delay(delay) => thread::sleep(delay),
            After::KeepServing | After::Close => {}
        }
        if stream.write_all(answer.as_bytes()).is_err() || after != After::KeepServing {
            return;
        }
    }
}

/// Reads one request off `stream`: its head, and its body by its `Content-Length`; `None` when
/// the peer closes (or fails) first.
pub fn read_request(stream: &mut impl Read) -> Option<(String, Vec<u8>)> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return None,
        }
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let length: usize = head
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    stream.read_exact(&mut body).ok()?;
    Some((head, body))
}
