//! The two HTTP/1 engines side by side (docs/http.md, "Two engines, one policy"): the same
//! requests, sent through a proxy whose fast lane is on and through one with
//! `--http1-fast-lane=false`, against the same scripted target, reach the client alike and the
//! target alike. Every request here is one the lane would take unless it says otherwise, so the
//! first proxy serves it through the lane and the second through hyper.
//!
//! A difference fails the test unless it is listed in [`INTENDED`] with its reason. Where the
//! engines agree, the cases that matter also assert the right answer (RFC 9110/9112, or
//! HAProxy's where the RFCs leave a choice).

mod support;

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use support::scripted::{After, Scripted};
use support::{PATIENCE, Proxy};

/// Differences the test accepts, with why: (case, reason).
const INTENDED: &[(&str, &str)] = &[(
    "/long-chunk-extension",
    "both cut the response at the same bound (16 KiB of chunk extensions); the lane has sent \
     the head by then, hyper's server writes it only with the first body bytes",
)];

/// The response timeout both proxies run with: a slow target's answer comes after it.
const RESPONSE_TIMEOUT: &str = "500ms";

const DATE: &str = "date: Thu, 01 Jan 2026 00:00:00 GMT\r\n";

/// The target's answer to a path (the part before any `?`), as raw bytes, and what it does
/// after.
fn script(path: &str) -> (String, After) {
    let ok = |rest: &str| format!("HTTP/1.1 200 OK\r\n{DATE}{rest}");
    let keep = After::KeepServing;
    match path {
        "/length" => (ok("content-length: 5\r\n\r\nhello"), keep),
        "/chunked" => (
            ok("transfer-encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"),
            keep,
        ),
        "/trailers" => (
            ok(
                "transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nx-trailer: t\r\nx-other: u\r\n\r\n",
            ),
            keep,
        ),
        "/te-and-length" => (
            ok("transfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n5\r\nhello\r\n0\r\n\r\n"),
            keep,
        ),
        "/gzip-chunked" => (
            ok("transfer-encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"),
            keep,
        ),
        "/chunked-identity" => (
            ok("transfer-encoding: chunked\r\ntransfer-encoding: identity\r\n\r\nhello"),
            After::Close,
        ),
        "/gzip" => (ok("transfer-encoding: gzip\r\n\r\nhello"), After::Close),
        "/early-hints" => (
            format!(
                "HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\nconnection: x-hint\r\nx-hint: 1\r\n\r\n{}",
                ok("content-length: 5\r\n\r\nearly")
            ),
            keep,
        ),
        "/processing" => (
            format!(
                "HTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n{}",
                ok("content-length: 2\r\n\r\nok")
            ),
            keep,
        ),
        "/unasked-continue" => (
            format!(
                "HTTP/1.1 100 Continue\r\n\r\n{}",
                ok("content-length: 2\r\n\r\nok")
            ),
            keep,
        ),
        "/204-length" => (
            format!("HTTP/1.1 204 No Content\r\n{DATE}content-length: 5\r\n\r\n"),
            keep,
        ),
        "/304" => (
            format!("HTTP/1.1 304 Not Modified\r\n{DATE}etag: \"x\"\r\ncontent-length: 9\r\n\r\n"),
            keep,
        ),
        "/304-bad-length" => (
            format!("HTTP/1.1 304 Not Modified\r\n{DATE}content-length: nope\r\n\r\n"),
            keep,
        ),
        "/two-lengths" => (
            ok("content-length: 2\r\ncontent-length: 3\r\n\r\nok"),
            After::Close,
        ),
        "/length-list" => (ok("content-length: 5, 5\r\n\r\nhello"), keep),
        "/length-zeros" => (ok("content-length: 005\r\n\r\nhello"), keep),
        "/099" => (
            format!("HTTP/1.1 099 Early\r\n{DATE}content-length: 0\r\n\r\n"),
            keep,
        ),
        "/000" => (
            format!("HTTP/1.1 000 None\r\n{DATE}content-length: 0\r\n\r\n"),
            keep,
        ),
        "/600" => (
            format!("HTTP/1.1 600 Beyond\r\n{DATE}content-length: 0\r\n\r\n"),
            keep,
        ),
        "/switch" => (
            "HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\nconnection: upgrade\r\n\r\n".into(),
            After::Close,
        ),
        "/no-date" => (
            "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok".into(),
            keep,
        ),
        "/connection-date" => (ok("connection: date\r\ncontent-length: 2\r\n\r\nok"), keep),
        "/connection-length" => (
            ok("connection: content-length\r\ncontent-length: 5\r\n\r\nhello"),
            keep,
        ),
        "/many-tokens" => {
            let names: Vec<String> = (1..=10).map(|i| format!("x-h{i}")).collect();
            let headers: String = names.iter().map(|name| format!("{name}: v\r\n")).collect();
            (
                ok(&format!(
                    "connection: {}\r\n{headers}x-kept: k\r\ncontent-length: 2\r\n\r\nok",
                    names.join(", ")
                )),
                keep,
            )
        }
        "/hop-by-hop" => (
            ok(
                "connection: x-hop, keep-alive\r\nx-hop: 1\r\nkeep-alive: timeout=5\r\nproxy-connection: x\r\nupgrade: y\r\nte: trailers\r\nhttp2-settings: z\r\nx-kept: 2\r\ncontent-length: 2\r\n\r\nok",
            ),
            keep,
        ),
        "/te-trailers" => (ok("te: trailers\r\ncontent-length: 2\r\n\r\nok"), keep),
        "/reason" => (
            format!("HTTP/1.1 299 Quite Fine\r\n{DATE}content-length: 0\r\n\r\n"),
            keep,
        ),
        "/no-reason" => (
            format!("HTTP/1.1 404 \r\n{DATE}content-length: 0\r\n\r\n"),
            keep,
        ),
        "/close-delimited" => (ok("\r\nuntil the target closes"), After::Close),
        "/target-close" => (
            ok("connection: close\r\ncontent-length: 2\r\n\r\nok"),
            After::Close,
        ),
        "/http10" => (
            format!("HTTP/1.0 200 OK\r\n{DATE}content-length: 2\r\n\r\nok"),
            After::Close,
        ),
        "/http10-keep-alive" => (
            format!(
                "HTTP/1.0 200 OK\r\n{DATE}connection: keep-alive\r\ncontent-length: 2\r\n\r\nok"
            ),
            keep,
        ),
        "/bad-chunk" => (
            ok("transfer-encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n"),
            After::Close,
        ),
        "/long-chunk-size" => (
            ok("transfer-encoding: chunked\r\n\r\n00000000000000000005\r\nhello\r\n0\r\n\r\n"),
            After::Close,
        ),
        "/long-chunk-extension" => (
            ok(&format!(
                "transfer-encoding: chunked\r\n\r\n5;{}\r\nhello\r\n0\r\n\r\n",
                "e".repeat(20_000)
            )),
            After::Close,
        ),
        "/chunk-extensions" => (
            ok(&format!(
                "transfer-encoding: chunked\r\n\r\n5;{}\r\nhello\r\n0\r\n\r\n",
                "e".repeat(12_000)
            )),
            keep,
        ),
        // A response head just under the bound on one (hyper's default, the lane's), and one
        // just over it: 100 headers of 4 KiB.
        "/big-head" => (
            ok(&format!(
                "{}content-length: 2\r\n\r\nok",
                (0..95)
                    .map(|i| format!("x-big-{i:02}: {}\r\n", "b".repeat(4_000)))
                    .collect::<String>()
            )),
            keep,
        ),
        "/huge-head" => (
            ok(&format!(
                "{}content-length: 2\r\n\r\nok",
                (0..100)
                    .map(|i| format!("x-big-{i:03}: {}\r\n", "b".repeat(4_200)))
                    .collect::<String>()
            )),
            After::Close,
        ),
        // More header fields than either engine reads (100), in a small head.
        "/many-fields" => (
            ok(&format!(
                "{}content-length: 2\r\n\r\nok",
                (0..100)
                    .map(|i| format!("x-f{i}: v\r\n"))
                    .collect::<String>()
            )),
            After::Close,
        ),
        "/one-huge-header" => (
            ok(&format!(
                "x-huge: {}\r\ncontent-length: 2\r\n\r\nok",
                "h".repeat(408 * 1024)
            )),
            After::Close,
        ),
        "/big-trailers" => (
            ok(&format!(
                "transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nx-big: {}\r\n\r\n",
                "t".repeat(20_000)
            )),
            After::Close,
        ),
        // Trailers that are no field lines: the framing is wrong, however complete the data.
        "/trailer-garbage" => (
            ok("transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nnot a field\r\n\r\n"),
            keep,
        ),
        "/trailer-bad-name" => (
            ok("transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nx trailer: t\r\n\r\n"),
            keep,
        ),
        "/trailer-control" => (
            ok("transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nx-t: a\x7fb\r\n\r\n"),
            keep,
        ),
        "/trailer-bare-lf" => (
            ok("transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nx-t: t\nx-u: u\r\n\r\n"),
            keep,
        ),
        // Lengths at the top of the range: 2^63 - 1 is a length (the largest file size), 2^63
        // and 2^64 - 1 are not.
        "/length-max-file" => (
            ok("content-length: 9223372036854775807\r\n\r\nhello"),
            After::Close,
        ),
        "/length-2-63" => (
            ok("content-length: 9223372036854775808\r\n\r\nhello"),
            After::Close,
        ),
        "/length-2-64" => (
            ok("content-length: 18446744073709551615\r\n\r\nhello"),
            After::Close,
        ),
        "/length-overflow" => (
            ok("content-length: 18446744073709551616\r\n\r\nhello"),
            After::Close,
        ),
        // Chunk lines that end in a bare LF: from the first, and after a good chunk.
        "/bare-lf-chunks" => (
            ok("transfer-encoding: chunked\r\n\r\n5\nhello\n0\n\n"),
            keep,
        ),
        "/bare-lf-later" => (
            ok("transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n5\nworld\n0\r\n\r\n"),
            keep,
        ),
        "/bare-lf-after-data" => (
            ok("transfer-encoding: chunked\r\n\r\n5\r\nhello\n0\r\n\r\n"),
            keep,
        ),
        "/cut-length" => (ok("content-length: 10\r\n\r\nhello"), After::Close),
        "/cut-head" => ("HTTP/1.1 200 OK\r\ncontent-le".into(), After::Close),
        "/bad-head" => ("HTTP/1.1 200 OK\r\nbad header\r\n\r\n".into(), After::Close),
        "/dead" => (String::new(), After::Close),
        "/reset" => (String::new(), After::Reset),
        "/slow" => (
            ok("content-length: 4\r\n\r\nslow"),
            After::Delay(Duration::from_millis(1500)),
        ),
        _ => (ok("content-length: 2\r\n\r\nok"), keep),
    }
}

/// What a client saw of one response, and how its connection was afterwards.
#[derive(Debug, PartialEq, Eq, Clone)]
struct Answer {
    /// `1xx` heads before the response: status lines and headers.
    informational: Vec<String>,
    status_line: String,
    /// Lowercase names, sorted; a `Date` counts as present, whatever its value.
    headers: Vec<(String, String)>,
    body: String,
    /// How the client's connection went on: "open", "closed", "reset", or how the response
    /// failed ("closed before the head", "cut in the body" ...).
    after: String,
}

/// What one case saw through one engine.
#[derive(Debug, PartialEq, Eq, Clone)]
struct Observed {
    answers: Vec<Answer>,
    /// The request heads the target got (lowercase names, sorted), in order.
    target_saw: Vec<String>,
    target_connections: usize,
}

struct Case {
    name: &'static str,
    /// Requests sent one after another on one client connection; each waits for its answer.
    requests: Vec<String>,
    /// The client shuts its write side after the last request.
    half_close: bool,
}

fn get(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: app.test\r\n\r\n")
}

fn cases() -> Vec<Case> {
    let one = |name: &'static str, request: String| Case {
        name,
        requests: vec![request],
        half_close: false,
    };
    let twice = |name: &'static str, request: String| Case {
        name,
        requests: vec![request.clone(), request],
        half_close: false,
    };
    let mut cases = vec![
        twice("plain GET", get("/ok")),
        twice(
            "HEAD",
            "HEAD /length HTTP/1.1\r\nHost: app.test\r\n\r\n".into(),
        ),
        one(
            "DELETE",
            "DELETE /ok HTTP/1.1\r\nHost: app.test\r\n\r\n".into(),
        ),
        one(
            "OPTIONS",
            "OPTIONS /ok HTTP/1.1\r\nHost: app.test\r\n\r\n".into(),
        ),
        one(
            "client asks to close",
            "GET /ok HTTP/1.1\r\nHost: app.test\r\nConnection: close\r\n\r\n".into(),
        ),
        one(
            "Connection names Host",
            "GET /ok HTTP/1.1\r\nHost: app.test\r\nConnection: host\r\n\r\n".into(),
        ),
        one(
            "hop-by-hop request headers",
            "GET /ok HTTP/1.1\r\nHost: app.test\r\nConnection: keep-alive, x-hop\r\nX-Hop: 1\r\nKeep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nX-Kept: 2\r\n\r\n".into(),
        ),
        one("Connection names ten headers", {
            let names: Vec<String> = (1..=10).map(|i| format!("x-h{i}")).collect();
            let headers: String = names.iter().map(|name| format!("{name}: v\r\n")).collect();
            format!(
                "GET /ok HTTP/1.1\r\nHost: app.test\r\nConnection: {}\r\n{headers}X-Kept: k\r\n\r\n",
                names.join(", ")
            )
        }),
        one(
            "Connection names Date",
            "GET /ok HTTP/1.1\r\nHost: app.test\r\nConnection: date\r\nDate: Thu, 01 Jan 2026 00:00:00 GMT\r\n\r\n".into(),
        ),
        one("angle brackets in the query", get("/ok?q=<a>")),
        one("braces and backquote in the query", get("/ok?q={a}`b`")),
        one("escapes in the path", get("/a%20b/ok")),
        one("a host with a port", {
            "GET /ok HTTP/1.1\r\nHost: app.test:8080\r\n\r\n".into()
        }),
        one("an IPv6 host", "GET /ok HTTP/1.1\r\nHost: [::1]:80\r\n\r\n".into()),
        one(
            "a value with obs-text",
            "GET /ok HTTP/1.1\r\nHost: app.test\r\nX-Text: caf\u{e9}\r\n\r\n".into(),
        ),
        one(
            "a request length beyond 2^63 - 1",
            "POST /ok HTTP/1.1\r\nHost: app.test\r\nContent-Length: 9223372036854775808\r\n\r\nhello".into(),
        ),
        one(
            "two requests in one write",
            format!("{}{}", get("/length"), get("/chunked")),
        ),
        Case {
            name: "a client that half-closes after its request",
            requests: vec![get("/ok")],
            half_close: true,
        },
        Case {
            name: "a client that half-closes after a DELETE",
            requests: vec!["DELETE /ok HTTP/1.1\r\nHost: app.test\r\n\r\n".into()],
            half_close: true,
        },
    ];
    for path in [
        "/length",
        "/chunked",
        "/trailers",
        "/te-and-length",
        "/gzip-chunked",
        "/chunked-identity",
        "/gzip",
        "/early-hints",
        "/processing",
        "/unasked-continue",
        "/204-length",
        "/304",
        "/304-bad-length",
        "/two-lengths",
        "/length-list",
        "/length-zeros",
        "/099",
        "/000",
        "/600",
        "/switch",
        "/no-date",
        "/connection-date",
        "/connection-length",
        "/many-tokens",
        "/hop-by-hop",
        "/te-trailers",
        "/reason",
        "/no-reason",
        "/close-delimited",
        "/target-close",
        "/http10",
        "/http10-keep-alive",
        "/bad-chunk",
        "/long-chunk-size",
        "/long-chunk-extension",
        "/chunk-extensions",
        "/big-trailers",
        "/big-head",
        "/huge-head",
        "/one-huge-header",
        "/many-fields",
        "/trailer-garbage",
        "/trailer-bad-name",
        "/trailer-control",
        "/trailer-bare-lf",
        "/length-max-file",
        "/length-2-63",
        "/length-2-64",
        "/length-overflow",
        "/bare-lf-chunks",
        "/bare-lf-later",
        "/bare-lf-after-data",
        "/cut-length",
        "/cut-head",
        "/bad-head",
        "/dead",
        "/reset",
        "/slow",
    ] {
        cases.push(Case {
            name: path,
            requests: vec![get(path), get("/ok")],
            half_close: false,
        });
    }
    // A response to HEAD has no content (RFC 9110 section 9.3.2), the proxy's own answers
    // included (502, 504): a GET follows on the same connection, and reads its own response,
    // not the rest of the HEAD's.
    for path in [
        "/length",
        "/304-bad-length",
        "/two-lengths",
        "/cut-length",
        "/bad-head",
        "/cut-head",
        "/dead",
        "/slow",
        "/connection-length",
    ] {
        cases.push(Case {
            name: Box::leak(format!("HEAD {path}").into_boxed_str()),
            requests: vec![
                format!("HEAD {path} HTTP/1.1\r\nHost: app.test\r\n\r\n"),
                get("/ok"),
            ],
            half_close: false,
        });
    }
    cases
}

/// Runs `case` through a proxy (started with `extra` arguments) towards a target of its own.
fn observe(case: &Case, extra: &str) -> Observed {
    let target = Scripted::start(script);
    let proxy = Proxy::start(&[
        "--inbound",
        &format!("127.0.0.1:0={}/http", target.addr),
        "--http-response-timeout",
        RESPONSE_TIMEOUT,
        extra,
    ]);
    let mut client = TcpStream::connect(proxy.inbound[0]).unwrap();
    let mut answers = Vec::new();
    let mut pending = Vec::new();
    for (index, request) in case.requests.iter().enumerate() {
        client.write_all(request.as_bytes()).unwrap();
        if case.half_close && index + 1 == case.requests.len() {
            client.shutdown(Shutdown::Write).unwrap();
        }
        // Pipelined requests: one answer each.
        let count = request.matches(" HTTP/1.1\r\n").count().max(1);
        let head = request.starts_with("HEAD ");
        for _ in 0..count {
            let answer = read_answer(&mut client, &mut pending, head);
            let open = answer.after == "open";
            answers.push(answer);
            if !open {
                break;
            }
        }
        if answers.last().is_some_and(|answer| answer.after != "open") {
            break;
        }
    }
    drop(client);
    // The proxies' own answers name their targets, whose ports differ.
    for answer in &mut answers {
        answer.body = answer.body.replace(&target.addr.to_string(), "TARGET");
        for (_, value) in &mut answer.headers {
            if answer.status_line.contains(" 50") && value.parse::<u64>().is_ok() {
                *value = "(length)".into();
            }
        }
    }
    // What the target got, once the proxy has let go of the request.
    thread::sleep(Duration::from_millis(100));
    let target_saw = target
        .heads
        .lock()
        .unwrap()
        .iter()
        .map(|head| normalize_head(head))
        .collect();
    Observed {
        answers,
        target_saw,
        target_connections: target.accepted.load(Ordering::SeqCst),
    }
}

/// A head with lowercase header names, sorted, a `Date` as present (its value left out).
fn normalize_head(head: &str) -> String {
    let mut lines = head.trim_end().split("\r\n");
    let first = lines.next().unwrap_or("").to_string();
    let mut headers: Vec<String> = lines
        .map(|line| match line.split_once(':') {
            Some((name, _)) if name.eq_ignore_ascii_case("date") => "date: (present)".into(),
            Some((name, value)) => format!("{}: {}", name.to_ascii_lowercase(), value.trim()),
            None => line.to_string(),
        })
        .collect();
    headers.sort();
    std::iter::once(first)
        .chain(headers)
        .collect::<Vec<_>>()
        .join(" | ")
}

/// Reads one answer (past `1xx` heads) from `client`, `pending` holding bytes read beyond the
/// last one, then watches the connection briefly to say how it went on.
fn read_answer(client: &mut TcpStream, pending: &mut Vec<u8>, head_request: bool) -> Answer {
    let deadline = Instant::now() + PATIENCE;
    let mut answer = Answer {
        informational: Vec::new(),
        status_line: String::new(),
        headers: Vec::new(),
        body: String::new(),
        after: String::new(),
    };
    let mut read_more = |pending: &mut Vec<u8>, answer: &mut Answer, stage: &str| -> bool {
        let left = deadline.saturating_duration_since(Instant::now());
        client
            .set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .unwrap();
        let mut buf = [0u8; 65536];
        match client.read(&mut buf) {
            Ok(0) => answer.after = format!("closed {stage}"),
            Ok(n) => {
                pending.extend_from_slice(&buf[..n]);
                return true;
            }
            Err(error) if error.kind() == ErrorKind::ConnectionReset => {
                answer.after = format!("reset {stage}")
            }
            Err(error) => answer.after = format!("{:?} {stage}", error.kind()),
        }
        false
    };
    // The heads.
    let head = loop {
        match pending.windows(4).position(|w| w == b"\r\n\r\n") {
            Some(end) => {
                let head = String::from_utf8_lossy(&pending[..end + 4]).into_owned();
                pending.drain(..end + 4);
                let code: u16 = head
                    .split(' ')
                    .nth(1)
                    .and_then(|code| code.parse().ok())
                    .unwrap_or(0);
                if (100..200).contains(&code) && code != 101 {
                    answer.informational.push(normalize_head(&head));
                    continue;
                }
                break head;
            }
            None if !read_more(pending, &mut answer, "before the head") => return answer,
            None => {}
        }
    };
    let mut lines = head.trim_end().split("\r\n");
    answer.status_line = lines.next().unwrap_or("").to_string();
    for line in lines {
        let (name, value) = line.split_once(':').unwrap_or((line, ""));
        let name = name.to_ascii_lowercase();
        let value = if name == "date" {
            "(present)".to_string()
        } else {
            value.trim().to_string()
        };
        answer.headers.push((name, value));
    }
    answer.headers.sort();
    let header = |name: &str| {
        answer
            .headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    let code: u16 = answer
        .status_line
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let mut body = Vec::new();
    if head_request || code == 204 || code == 304 {
    } else if header("transfer-encoding").is_some_and(|te| te.contains("chunked")) {
        loop {
            let Some(line_end) = pending.windows(2).position(|w| w == b"\r\n") else {
                if !read_more(pending, &mut answer, "in the body") {
                    answer.body = String::from_utf8_lossy(&body).into_owned();
                    return answer;
                }
                continue;
            };
            let line = String::from_utf8_lossy(&pending[..line_end]).into_owned();
            let size = usize::from_str_radix(line.split(';').next().unwrap().trim(), 16).unwrap();
            if size == 0 {
                // Trailers up to the empty line.
                match pending.windows(4).position(|w| w == b"\r\n\r\n") {
                    Some(end) if end >= line_end => {
                        let trailers = String::from_utf8_lossy(&pending[line_end + 2..end + 2]);
                        for trailer in trailers.split("\r\n").filter(|t| !t.is_empty()) {
                            answer
                                .headers
                                .push(("(trailer)".into(), trailer.to_string()));
                        }
                        pending.drain(..end + 4);
                        break;
                    }
                    _ if pending.len() >= line_end + 4
                        && &pending[line_end..line_end + 4] == b"\r\n\r\n" =>
                    {
                        pending.drain(..line_end + 4);
                        break;
                    }
                    _ => {
                        if !read_more(pending, &mut answer, "in the trailers") {
                            answer.body = String::from_utf8_lossy(&body).into_owned();
                            return answer;
                        }
                        continue;
                    }
                }
            }
            if pending.len() < line_end + 2 + size + 2 {
                if !read_more(pending, &mut answer, "in the body") {
                    answer.body = String::from_utf8_lossy(&body).into_owned();
                    return answer;
                }
                continue;
            }
            body.extend_from_slice(&pending[line_end + 2..line_end + 2 + size]);
            pending.drain(..line_end + 2 + size + 2);
        }
    } else if let Some(length) = header("content-length") {
        let length: usize = length.parse().unwrap_or(0);
        while pending.len() < length {
            if !read_more(pending, &mut answer, "in the body") {
                answer.body = String::from_utf8_lossy(pending).into_owned();
                return answer;
            }
        }
        body.extend(pending.drain(..length));
    } else {
        while read_more(pending, &mut answer, "") {}
        answer.body = String::from_utf8_lossy(pending).into_owned();
        answer.after = format!("{} (close-delimited)", answer.after.trim());
        pending.clear();
        return answer;
    }
    answer.body = String::from_utf8_lossy(&body).into_owned();
    if !pending.is_empty() {
        answer.after = "open".into();
        return answer;
    }
    // How the connection goes on: a short look.
    client
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut buf = [0u8; 1024];
    answer.after = match client.read(&mut buf) {
        Ok(0) => "closed".into(),
        Ok(n) => {
            pending.extend_from_slice(&buf[..n]);
            "open".into()
        }
        Err(error) if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
            "open".into()
        }
        Err(error) if error.kind() == ErrorKind::ConnectionReset => "reset".into(),
        Err(error) => format!("{:?}", error.kind()),
    };
    answer
}

/// Every case through both engines, a few at a time.
fn observe_all() -> Vec<(&'static str, Observed, Observed)> {
    let cases = Arc::new(cases());
    let next = Arc::new(AtomicUsize::new(0));
    let results = Arc::new(Mutex::new(BTreeMap::new()));
    let workers: Vec<_> = (0..6)
        .map(|_| {
            let (cases, next, results) = (cases.clone(), next.clone(), results.clone());
            thread::spawn(move || {
                loop {
                    let index = next.fetch_add(1, Ordering::SeqCst);
                    let Some(case) = cases.get(index) else { return };
                    let lane = observe(case, "--http1-fast-lane=true");
                    let hyper = observe(case, "--http1-fast-lane=false");
                    results.lock().unwrap().insert(index, (lane, hyper));
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
    let mut results = results.lock().unwrap();
    cases
        .iter()
        .enumerate()
        .map(|(index, case)| {
            let (lane, hyper) = results.remove(&index).unwrap();
            (case.name, lane, hyper)
        })
        .collect()
}

/// Every case's observations, made once for the tests below.
fn results() -> &'static [(&'static str, Observed, Observed)] {
    static RESULTS: OnceLock<Vec<(&'static str, Observed, Observed)>> = OnceLock::new();
    RESULTS.get_or_init(observe_all)
}

#[test]
fn both_engines_answer_every_request_alike() {
    let results = results();
    let mut differences = Vec::new();
    for (name, lane, hyper) in results {
        let intended = INTENDED.iter().any(|(case, _)| case == name);
        if lane != hyper && !intended {
            differences.push(format!("{name}:\n  lane:  {lane:?}\n  hyper: {hyper:?}"));
        }
    }
    if std::env::var_os("LAMEDUCK_SHOW_ENGINES").is_some() {
        for (name, lane, _) in results {
            eprintln!("{name}: {lane:?}");
        }
    }
    assert!(
        differences.is_empty(),
        "{} of {} cases differ between the engines:\n{}",
        differences.len(),
        results.len(),
        differences.join("\n")
    );
}

/// What both engines answer is the policy's answer (each case is checked through both).
#[test]
fn the_answers_are_the_policys() {
    let by_name: BTreeMap<&str, [&Observed; 2]> = results()
        .iter()
        .map(|(name, lane, hyper)| (*name, [lane, hyper]))
        .collect();
    let check = |name: &str, what: &str, ok: &dyn Fn(&Observed) -> bool| {
        let observed = by_name
            .get(name)
            .unwrap_or_else(|| panic!("no case {name:?}"));
        for (engine, observed) in ["lane", "hyper"].iter().zip(observed) {
            assert!(ok(observed), "{name} ({engine}): {what}\n{observed:#?}");
        }
    };
    let first = |observed: &Observed| observed.answers[0].clone();
    let header = |answer: &Answer, name: &str| {
        answer
            .headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    let status = |observed: &Observed| {
        first(observed)
            .status_line
            .split(' ')
            .nth(1)
            .unwrap_or("")
            .to_string()
    };
    for name in ["/gzip-chunked", "/chunked-identity", "/gzip"] {
        check(name, "coded content is a 502", &|o| {
            status(o) == "502" && first(o).body.contains("transfer coding other than chunked")
        });
    }
    check(
        "/te-and-length",
        "the coding wins, whole and without the length",
        &|o| {
            let answer = first(o);
            answer.body == "hello" && header(&answer, "content-length").is_none()
        },
    );
    check(
        "/early-hints",
        "103 forwarded without hop-by-hop headers",
        &|o| {
            first(o).informational == ["HTTP/1.1 103 Early Hints | link: </style.css>; rel=preload"]
                && first(o).body == "early"
        },
    );
    check("/processing", "every interim response forwarded", &|o| {
        first(o).informational.len() == 2 && first(o).body == "ok"
    });
    check("/unasked-continue", "a target's 100 is dropped", &|o| {
        first(o).informational.is_empty() && first(o).body == "ok"
    });
    for name in [
        "/099",
        "/000",
        "/switch",
        "/304-bad-length",
        "HEAD /304-bad-length",
    ] {
        check(name, "a 502", &|o| status(o) == "502");
    }
    check("/switch", "the reason", &|o| {
        first(o).body.contains("switched protocols unasked")
    });
    for name in ["/304-bad-length", "/two-lengths"] {
        check(name, "the reason", &|o| {
            first(o).body.contains("invalid Content-Length")
        });
    }
    check("HEAD /two-lengths", "a 502", &|o| status(o) == "502");
    check("/204-length", "no length on a 204", &|o| {
        header(&first(o), "content-length").is_none()
    });
    check("/length-list", "one length", &|o| {
        header(&first(o), "content-length").as_deref() == Some("5")
    });
    check("/connection-date", "a Date all the same", &|o| {
        header(&first(o), "date").is_some()
    });
    // One bound on a response head in both engines (408 KiB), however its headers are cut.
    check("/big-head", "a head under the bound passes", &|o| {
        status(o) == "200"
    });
    for name in ["/huge-head", "/one-huge-header"] {
        check(name, "a head over the bound is refused", &|o| {
            status(o) == "502" && first(o).body.contains("response head larger than 408 KiB")
        });
    }
    // A header the message's framing needs is never hop-by-hop (HAProxy keeps it too).
    check("/connection-length", "the length all the same", &|o| {
        let answer = first(o);
        header(&answer, "content-length").as_deref() == Some("5") && answer.body == "hello"
    });
    check("/many-tokens", "every named header gone", &|o| {
        let answer = first(o);
        header(&answer, "x-kept").is_some()
            && !answer.headers.iter().any(|(n, _)| n.starts_with("x-h"))
    });
    for name in ["/hop-by-hop", "/te-trailers"] {
        check(name, "no TE in a response", &|o| {
            header(&first(o), "te").is_none()
        });
    }
    check("Connection names Host", "Host reaches the target", &|o| {
        o.target_saw == ["GET /ok HTTP/1.1 | host: app.test"] && status(o) == "200"
    });
    check(
        "Connection names ten headers",
        "every named header gone",
        &|o| o.target_saw[0].contains("x-kept: k") && !o.target_saw[0].contains("x-h"),
    );
    check("angle brackets in the query", "refused", &|o| {
        status(o) == "400"
    });
    for name in [
        "a client that half-closes after its request",
        "a client that half-closes after a DELETE",
    ] {
        check(name, "answered", &|o| {
            status(o) == "200" && o.target_saw.len() == 1
        });
    }
    for name in ["/dead", "/cut-head"] {
        check(
            name,
            "a fresh connection that closes is not replayed",
            &|o| status(o) == "502" && o.target_saw.len() == 2,
        );
    }
    check("/trailers", "the target's connection serves on", &|o| {
        o.target_connections == 1 && first(o).body == "hello"
    });
    check(
        "/http10-keep-alive",
        "an HTTP/1.0 target's connection is not reused",
        &|o| o.target_connections == 2 && o.target_saw[1].starts_with("GET /ok HTTP/1.1"),
    );
    check("/slow", "504 at the response timeout", &|o| {
        status(o) == "504"
    });
    check("/long-chunk-size", "leading zeros are fine", &|o| {
        first(o).body == "hello"
    });
    check("/chunk-extensions", "12 KiB of extensions are fine", &|o| {
        first(o).body == "hello"
    });
    for name in [
        "/bad-chunk",
        "/cut-length",
        "/big-trailers",
        "/long-chunk-extension",
    ] {
        check(name, "cut, never complete-looking", &|o| {
            first(o).after != "open"
        });
    }
    // Trailers are field lines, or the framing was wrong: the response is cut after its data
    // (never complete-looking), its connections closed.
    for name in [
        "/trailer-garbage",
        "/trailer-bad-name",
        "/trailer-control",
        "/trailer-bare-lf",
    ] {
        check(name, "cut after the data", &|o| {
            let answer = first(o);
            answer.body == "hello" && answer.after == "closed in the body"
        });
    }
    // One rule for a length: at most 2^63 - 1.
    check("/length-max-file", "2^63 - 1 is a length", &|o| {
        status(o) == "200"
            && header(&first(o), "content-length").as_deref() == Some("9223372036854775807")
    });
    for name in ["/length-2-63", "/length-2-64", "/length-overflow"] {
        check(name, "beyond 2^63 - 1 is none", &|o| {
            status(o) == "502" && first(o).body.contains("invalid Content-Length")
        });
    }
    check("a request length beyond 2^63 - 1", "a 400", &|o| {
        status(o) == "400" && o.target_saw.is_empty()
    });
    check(
        "/many-fields",
        "more fields than either engine reads",
        &|o| status(o) == "502" && first(o).body.contains("more than 100 header fields"),
    );
    // A chunk line ends in CRLF; one that does not breaks the body: the head reaches the
    // client, then the cut, never nothing at all.
    for name in ["/bare-lf-chunks", "/bare-lf-later", "/bare-lf-after-data"] {
        check(name, "the head, then a cut", &|o| {
            status(o) == "200" && first(o).after == "closed in the body"
        });
    }
}

/// The response timeout counts the connect too, in both engines: a target whose listen queue is
/// full (its SYNs go unanswered) gets a 504 once `--http-response-timeout` has passed, not once
/// the longer `--connect-timeout` has.
#[test]
fn connecting_counts_in_the_response_timeout_through_both_engines() {
    use socket2::{Domain, Socket, Type};
    let listener = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    listener
        .bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
        .unwrap();
    listener.listen(0).unwrap();
    let addr = listener.local_addr().unwrap().as_socket().unwrap();
    // The one place in the queue, taken: further connects wait for an answer that never comes.
    let _filler = TcpStream::connect(addr).unwrap();
    for engine in ["--http1-fast-lane=true", "--http1-fast-lane=false"] {
        let proxy = Proxy::start(&[
            "--inbound",
            &format!("127.0.0.1:0={addr}/http"),
            "--connect-timeout",
            "5s",
            "--http-response-timeout",
            RESPONSE_TIMEOUT,
            engine,
        ]);
        let mut client = TcpStream::connect(proxy.inbound[0]).unwrap();
        let started = Instant::now();
        client.write_all(get("/ok").as_bytes()).unwrap();
        let answer = read_answer(&mut client, &mut Vec::new(), false);
        let took = started.elapsed();
        assert!(
            answer.status_line.starts_with("HTTP/1.1 504"),
            "{engine}: {answer:?}"
        );
        assert!(
            answer.body.contains("did not respond in time"),
            "{engine}: {answer:?}"
        );
        // Half a second, with room for a busy machine; the connect timeout is 5 s.
        assert!(took < Duration::from_millis(3000), "{engine}: {took:?}");
    }
}

/// A target connection whose framing was wrong never serves another request, in either
/// engine: after garbage in a chunked response's trailers, the next client's request goes on
/// a new connection. The same response with good trailers leaves its connection to the next
/// client (the test can tell the two apart).
#[test]
fn a_connection_whose_framing_was_wrong_is_never_reused() {
    for engine in ["--http1-fast-lane=true", "--http1-fast-lane=false"] {
        for (path, connections) in [("/trailers", 1), ("/trailer-garbage", 2)] {
            let target = Scripted::start(script);
            let proxy = Proxy::start(&[
                "--inbound",
                &format!("127.0.0.1:0={}/http", target.addr),
                engine,
            ]);
            let mut first = TcpStream::connect(proxy.inbound[0]).unwrap();
            first.write_all(get(path).as_bytes()).unwrap();
            let answer = read_answer(&mut first, &mut Vec::new(), false);
            assert_eq!(answer.body, "hello", "{engine} {path}: {answer:?}");
            let mut second = TcpStream::connect(proxy.inbound[0]).unwrap();
            second.write_all(get("/ok").as_bytes()).unwrap();
            let answer = read_answer(&mut second, &mut Vec::new(), false);
            assert!(
                answer.status_line.starts_with("HTTP/1.1 200"),
                "{engine} {path}: {answer:?}"
            );
            assert_eq!(
                target.accepted.load(Ordering::SeqCst),
                connections,
                "{engine} {path}: the target's connections"
            );
        }
    }
}
