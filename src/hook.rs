//! `lameduck prestop` and `lameduck poststart`: the app containers' lifecycle hooks that
//! `lameduck inject` writes (CONTRACT section 7). They run lameduck's own binary from the pod's
//! shared volume inside the app container, and talk to the proxy over the control socket in
//! that volume (see [`crate::quiesce`]).
//!
//! - `prestop` asks the proxy to quiesce its inbound side and waits until the inbound side has
//!   drained (or the proxy's grace period ran out), so that the kubelet signals the app only
//!   when none of its inbound requests is in flight. Then it runs the container's own preStop
//!   action, if it had one (`--sleep`, or the command after `--`).
//! - `poststart` asks the proxy to serve inbound again: a `preStop` hook also runs before the
//!   kubelet restarts a container whose liveness probe failed, and no SIGTERM follows then.
//!   It never fails on the proxy's account: a failed postStart hook makes the kubelet kill
//!   the container.
//!
//! What they did goes to their standard output (the kubelet shows a failed hook's output in
//! the pod's events) and to the proxy's log.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use clap::Args;

/// Where the injected pod's shared volume holds the control socket.
pub const DEFAULT_SOCKET: &str = "/lameduck/drain.sock";

/// Exit status when the proxy could not be asked (the kubelet records a failed preStop hook).
const EXIT_FAILED: i32 = 1;

#[derive(Args, Debug)]
pub struct PreStopArgs {
    /// The proxy's control socket
    #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
    /// Sleep this long after the inbound drain (the container's own `sleep` preStop action)
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    sleep: Option<Duration>,
    /// The container's own preStop command, run after the inbound drain
    #[arg(last = true, value_name = "COMMAND")]
    command: Vec<String>,
}

#[derive(Args, Debug)]
pub struct PostStartArgs {
    /// The proxy's control socket
    #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
    /// Sleep this long after asking the proxy (the container's own `sleep` postStart action)
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    sleep: Option<Duration>,
    /// The container's own postStart command, run after asking the proxy
    #[arg(last = true, value_name = "COMMAND")]
    command: Vec<String>,
}

fn parse_duration(value: &str) -> Result<Duration, String> {
    humantime::parse_duration(value).map_err(|error| format!("{error}; for example 5s"))
}

/// `lameduck prestop`: returns the exit status (or does not return: the container's own
/// command replaces this process).
pub fn prestop(args: PreStopArgs) -> i32 {
    let started = Instant::now();
    let asked = ask("prestop", &args.socket, "quiesce");
    println!(
        "lameduck prestop: waited {} ms for the inbound drain",
        started.elapsed().as_millis()
    );
    let status = if asked { 0 } else { EXIT_FAILED };
    if let Some(pause) = args.sleep {
        std::thread::sleep(pause);
    }
    then_run("prestop", args.command, status)
}

/// `lameduck poststart`: 0 unless the container's own postStart command fails.
pub fn poststart(args: PostStartArgs) -> i32 {
    ask("poststart", &args.socket, "resume");
    if let Some(pause) = args.sleep {
        std::thread::sleep(pause);
    }
    then_run("poststart", args.command, 0)
}

/// Sends `request` and prints every line of the answer; true when the last one is `ok …`.
fn ask(hook: &str, socket: &PathBuf, request: &str) -> bool {
    let mut stream = match UnixStream::connect(socket) {
        Ok(stream) => stream,
        Err(error) => {
            println!(
                "lameduck {hook}: cannot reach the proxy at {}: {error}",
                socket.display()
            );
            return false;
        }
    };
    if let Err(error) = stream.write_all(format!("{request}\n").as_bytes()) {
        println!("lameduck {hook}: cannot ask the proxy: {error}");
        return false;
    }
    let mut ok = false;
    let mut last = None;
    for line in BufReader::new(stream).lines() {
        match line {
            Ok(line) => {
                println!("lameduck {hook}: {line}");
                ok = line.starts_with("ok ");
                last = Some(line);
            }
            Err(error) => {
                println!("lameduck {hook}: lost the proxy's answer: {error}");
                return false;
            }
        }
    }
    if last.is_none() {
        println!("lameduck {hook}: the proxy closed the socket without an answer");
    }
    ok
}

/// Runs the container's own hook command in place of this process, if there is one; else
/// returns `status`.
fn then_run(hook: &str, command: Vec<String>, status: i32) -> i32 {
    let Some((program, args)) = command.split_first() else {
        return status;
    };
    let _ = std::io::stdout().flush();
    let error = Command::new(program).args(args).exec();
    println!("lameduck {hook}: cannot run {program}: {error}");
    if error.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    }
}
