//! `lameduck status`: what the proxy is doing, for people. Run inside the pod, where the
//! image has no shell and no curl: `kubectl exec POD -c lameduck-proxy -- lameduck status`.
//! It answers "why will this pod not go away": the phase, the time left of the grace period,
//! the open connections by direction and protocol, the requests in flight, and the oldest
//! connections, which are the ones that hold a drain up.
//!
//! It reads the admin server's loopback-only `GET /status` and `GET /connections`.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::time::Duration;

use clap::Args;
use serde_json::Value;

/// How many of the oldest connections are listed.
const OLDEST: usize = 5;
const TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// The proxy's admin address [env: LAMEDUCK_ADMIN] [default: 127.0.0.1:4191]
    #[arg(long, value_name = "ADDR")]
    admin: Option<String>,
}

/// Prints the status; 0 when the proxy answered, 1 when it could not be asked, 2 for a bad
/// address.
pub fn run(args: StatusArgs, env: impl Fn(&str) -> Option<std::ffi::OsString>) -> i32 {
    let given = args
        .admin
        .or_else(|| env("LAMEDUCK_ADMIN").and_then(|value| value.into_string().ok()));
    let admin = match given.as_deref().map(str::parse::<SocketAddr>) {
        None => SocketAddr::from((Ipv4Addr::LOCALHOST, 4191)),
        Some(Ok(addr)) => reachable(addr),
        Some(Err(_)) => {
            eprintln!(
                "lameduck status: invalid admin address {:?}; for example 127.0.0.1:4191",
                given.unwrap_or_default()
            );
            return 2;
        }
    };
    let fetched = get(admin, "/status").and_then(|status| {
        let connections = get(admin, "/connections")?;
        Ok((status, connections))
    });
    match fetched {
        Ok((status, connections)) => {
            print!("{}", render(admin, &status, &connections));
            0
        }
        Err(error) => {
            eprintln!("lameduck status: cannot ask the proxy's admin server on {admin}: {error}");
            1
        }
    }
}

/// An unspecified listen address (0.0.0.0, [::]) is reached on loopback.
fn reachable(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::from((Ipv4Addr::LOCALHOST, addr.port()))
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::from((Ipv6Addr::LOCALHOST, addr.port()))
        }
        _ => addr,
    }
}

/// `GET path` on the admin server, its JSON body.
fn get(admin: SocketAddr, path: &str) -> Result<Value, String> {
    let mut stream = TcpStream::connect_timeout(&admin, TIMEOUT).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(TIMEOUT))
        .map_err(|e| e.to_string())?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").ok_or("not an HTTP response")?;
    let status = head.split(' ').nth(1).unwrap_or_default();
    if status != "200" {
        return Err(format!("{path} answered {status}: {}", body.trim()));
    }
    serde_json::from_str(body).map_err(|error| format!("{path}: not JSON: {error}"))
}

fn seconds(ms: &Value) -> String {
    format!("{:.1}s", ms.as_u64().unwrap_or_default() as f64 / 1000.0)
}

/// `5.0s`, or `adaptive, 2.0s to 30.0s: each source quiet for 20 of its gaps (at least 0.2s)`.
fn lame_duck_policy(lame_duck: &Value) -> String {
    match lame_duck["mode"].as_str() {
        Some("adaptive") => format!(
            "adaptive, {} to {}: each source quiet for {} of its gaps (at least {})",
            seconds(&lame_duck["min_ms"]),
            seconds(&lame_duck["max_ms"]),
            lame_duck["silences"],
            seconds(&lame_duck["quiet_window_ms"]),
        ),
        _ => seconds(&lame_duck["period_ms"]),
    }
}

/// The status as people read it.
fn render(admin: SocketAddr, status: &Value, connections: &Value) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "lameduck, admin server {admin}");
    let ready = if status["ready"] == true {
        "ready"
    } else {
        "not ready"
    };
    let _ = writeln!(
        out,
        "phase:         {} ({ready}); grace period {}, lame duck {}",
        status["phase"].as_str().unwrap_or("?"),
        seconds(&status["grace_period_ms"]),
        lame_duck_policy(&status["lame_duck"]),
    );
    let lame_duck = &status["lame_duck"];
    let last = |arrival: &Value| match arrival["from"].as_str() {
        Some(from) => format!(
            "the last new connection {} ago from {from}",
            seconds(&arrival["ms_ago"])
        ),
        None => "no new connection since it started".into(),
    };
    match lame_duck["state"].as_str() {
        Some("open") => {
            let sending = match lame_duck["sources"].as_u64() {
                Some(sources) => format!(
                    "{} of {sources} sources of new connections still sending; ",
                    lame_duck["sources_still_sending"]
                ),
                None => String::new(),
            };
            let _ = writeln!(
                out,
                "lame duck:     open for {} ({}); {sending}{}",
                seconds(&lame_duck["elapsed_ms"]),
                lame_duck_policy(lame_duck),
                last(&lame_duck["last_arrival"]),
            );
        }
        Some("ended") => {
            let why = match lame_duck["ended"].as_str() {
                Some("quiet") => "every source of new connections quiet for its window",
                Some("max") => "its maximum, new connections still arriving",
                _ => "its fixed period",
            };
            let _ = writeln!(
                out,
                "lame duck:     ended after {}: {why}; {}",
                seconds(&lame_duck["lasted_ms"]),
                last(&lame_duck["last_arrival"]),
            );
        }
        _ => {}
    }
    let late = &status["late_connections"];
    if late["arrived"].as_u64().is_some_and(|arrived| arrived > 0) {
        let _ = writeln!(
            out,
            "late:          {} connections after the lame duck: {} handed off to the Service, {} refused at once; the last {} ago from {}",
            late["arrived"],
            late["handed_off"],
            late["refused"],
            seconds(&late["last"]["ms_ago"]),
            late["last"]["from"].as_str().unwrap_or("?"),
        );
        if late["handoff_loops"]
            .as_u64()
            .is_some_and(|loops| loops > 0)
        {
            let _ = writeln!(
                out,
                "               {} hand-off connections came back to this pod and were dialled again",
                late["handoff_loops"],
            );
        }
    }
    let quiesce = &status["quiesce"];
    if quiesce.is_null() {
        // What the inbound listeners do now: a SIGTERM's drain closes them too.
        let inbound = match status["phase"].as_str() {
            Some("lame_duck") => "still accepting (lame duck), asking each connection to go away",
            Some("draining" | "terminating") => {
                "closed to new clients (shutdown), draining what is open"
            }
            _ => "serving",
        };
        let _ = writeln!(out, "inbound:       {inbound}");
    } else {
        let _ = writeln!(
            out,
            "inbound:       quiesced {} ago (preStop); {} of its grace period left",
            seconds(&quiesce["elapsed_ms"]),
            seconds(&quiesce["grace_left_ms"]),
        );
    }
    let shutdown = &status["shutdown"];
    if shutdown.is_null() {
        let _ = writeln!(out, "shutdown:      not started");
    } else {
        let _ = writeln!(
            out,
            "shutdown:      started by {} {} ago; {} of the grace period left",
            shutdown["trigger"].as_str().unwrap_or("?"),
            seconds(&shutdown["elapsed_ms"]),
            seconds(&shutdown["grace_left_ms"]),
        );
    }
    let mut open: Vec<&Value> = connections["connections"]
        .as_array()
        .map(|all| all.iter().collect())
        .unwrap_or_default();
    let mut by_direction = String::new();
    for direction in ["inbound", "outbound"] {
        let mut protocols: Vec<(&str, usize)> = Vec::new();
        for conn in open.iter().filter(|conn| conn["direction"] == direction) {
            let protocol = conn["protocol"].as_str().unwrap_or("?");
            match protocols.iter_mut().find(|(name, _)| *name == protocol) {
                Some((_, count)) => *count += 1,
                None => protocols.push((protocol, 1)),
            }
        }
        let total: usize = protocols.iter().map(|(_, count)| count).sum();
        let detail: Vec<String> = protocols
            .iter()
            .map(|(name, count)| format!("{name} {count}"))
            .collect();
        let _ = write!(
            by_direction,
            "{}{direction} {total}{}",
            if by_direction.is_empty() { "" } else { ", " },
            if detail.is_empty() {
                String::new()
            } else {
                format!(" ({})", detail.join(", "))
            }
        );
    }
    let _ = writeln!(out, "connections:   {} open: {by_direction}", open.len());
    let in_flight: u64 = open
        .iter()
        .filter_map(|conn| conn["requests_in_flight"].as_u64())
        .sum();
    let _ = writeln!(out, "requests in flight: {in_flight}");
    if !open.is_empty() {
        open.sort_by_key(|conn| std::cmp::Reverse(conn["age_ms"].as_u64().unwrap_or_default()));
        let _ = writeln!(out, "oldest connections (these hold a drain up):");
        for conn in open.iter().take(OLDEST) {
            let _ = writeln!(
                out,
                "  {:<8} {:<9} {} -> {}  age {}  {}  {} B in, {} B out, {} requests in flight",
                conn["direction"].as_str().unwrap_or("?"),
                conn["protocol"].as_str().unwrap_or("?"),
                conn["peer"].as_str().unwrap_or("?"),
                conn["target"].as_str().unwrap_or("?"),
                seconds(&conn["age_ms"]),
                conn["state"].as_str().unwrap_or("?"),
                conn["bytes_from_peer"],
                conn["bytes_to_peer"],
                conn["requests_in_flight"],
            );
        }
        if open.len() > OLDEST {
            let _ = writeln!(out, "  and {} more", open.len() - OLDEST);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each line says what is true: during a SIGTERM's lame duck and drain the inbound
    /// listeners are not "serving" (issue: `phase: draining` above `inbound: serving`).
    #[test]
    fn the_inbound_line_follows_the_shutdown() {
        let admin: SocketAddr = "127.0.0.1:4191".parse().unwrap();
        let inbound = |phase: &str| {
            let status = serde_json::json!({"phase": phase, "ready": false, "quiesce": null,
                "shutdown": null, "lame_duck": {}, "late_connections": {}});
            render(admin, &status, &serde_json::json!([]))
                .lines()
                .find(|line| line.starts_with("inbound:"))
                .unwrap()
                .to_string()
        };
        assert_eq!(inbound("serving"), "inbound:       serving");
        assert!(inbound("lame_duck").contains("still accepting (lame duck)"));
        for phase in ["draining", "terminating"] {
            assert!(
                inbound(phase).contains("closed to new clients (shutdown), draining"),
                "{phase}"
            );
        }
    }
}
