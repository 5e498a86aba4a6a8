//! `lameduck prestop` and `lameduck poststart`: the app containers' lifecycle hooks that
//! `lameduck inject` writes (docs/pod-lifecycle.md). They run lameduck's own binary from the pod's
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
//! - In legacy mode (the proxy an ordinary container, signalled with the app at t = 0),
//!   `poststart --hold` leaves a process in the app container that holds a connection to the
//!   proxy for as long as the container lives, and the proxy's own preStop hook, `prestop
//!   --wait-for-apps`, waits after the quiesce until no app container holds one: the proxy's
//!   SIGTERM then comes after the app has exited, and its outbound side stays open until then.
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

/// How long `hold` keeps trying to reach a proxy that has not started yet.
const HOLD_CONNECT_PATIENCE: Duration = Duration::from_secs(120);

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
    /// After the inbound drain, wait until every app container has exited (the proxy
    /// container's own preStop hook in legacy mode)
    #[arg(long)]
    wait_for_apps: bool,
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
    /// Leave a process behind that holds a connection to the proxy for as long as this
    /// container lives (legacy mode: the proxy's preStop waits for every holder to go)
    #[arg(long)]
    hold: bool,
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
    let mut status = if asked { 0 } else { EXIT_FAILED };
    if args.wait_for_apps {
        let started = Instant::now();
        if !ask("prestop", &args.socket, "apps-gone") {
            status = EXIT_FAILED;
        }
        println!(
            "lameduck prestop: waited {} ms for the app containers to exit",
            started.elapsed().as_millis()
        );
    }
    if let Some(pause) = args.sleep {
        std::thread::sleep(pause);
    }
    then_run("prestop", args.command, status)
}

/// `lameduck poststart`: 0 unless the container's own postStart command fails.
pub fn poststart(args: PostStartArgs) -> i32 {
    ask("poststart", &args.socket, "resume");
    if args.hold {
        spawn_holder(&args.socket);
    }
    if let Some(pause) = args.sleep {
        std::thread::sleep(pause);
    }
    then_run("poststart", args.command, 0)
}

/// Starts `lameduck hold` detached from the hook (its own session, no stdio: the runtime
/// waits for the hook's output to end), so that it outlives the hook and dies with the
/// container.
fn spawn_holder(socket: &PathBuf) {
    let spawned = std::env::current_exe().and_then(|me| {
        let mut holder = Command::new(me);
        holder
            .arg("hold")
            .arg("--socket")
            .arg(socket)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        // SAFETY: setsid(2) is async-signal-safe.
        unsafe {
            holder.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        holder.spawn()
    });
    match spawned {
        Ok(child) => println!(
            "lameduck poststart: pid {} holds the proxy's socket while this container lives",
            child.id()
        ),
        Err(error) => println!("lameduck poststart: cannot start the holder: {error}"),
    }
}

/// `lameduck hold`: holds a connection to the proxy until the proxy closes it or this
/// process is killed (with its container).
pub fn hold(args: HoldArgs) -> i32 {
    // In legacy mode the app container may start before the proxy has bound its socket (an
    // ordinary container's start waits for no other), so the holder keeps trying a while.
    let deadline = Instant::now() + HOLD_CONNECT_PATIENCE;
    let mut stream = loop {
        match UnixStream::connect(&args.socket) {
            Ok(stream) => break stream,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            Err(_) => return EXIT_FAILED,
        }
    };
    if stream.write_all(b"hold\n").is_err() {
        return EXIT_FAILED;
    }
    let mut sink = [0u8; 64];
    while matches!(std::io::Read::read(&mut stream, &mut sink), Ok(n) if n > 0) {}
    0
}

#[derive(Args, Debug)]
pub struct HoldArgs {
    /// The proxy's control socket
    #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
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
