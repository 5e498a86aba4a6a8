//! `lameduck await [OPTIONS] -- CMD [ARGS...]`: run an app under the proxy's lifecycle, so
//! that Jobs complete (docs/jobs.md).
//!
//! It waits until the proxy's `GET /ready` answers 2xx, then runs the command. Without
//! `--shutdown` the command replaces the wrapper (exec: same PID, signals untouched). With
//! `--shutdown` the wrapper spawns it, forwards the signals a supervisor may send, and when it
//! ends (or could not be started) posts `/shutdown` to the proxy, then exits with the command's
//! status (128+N when signal N killed it). As PID 1 it reaps orphaned children.
//!
//! Flags and variables follow `linkerd-await`, so Jobs moving from Linkerd keep their wrapper
//! line. This is plain blocking code: one thread forwards signals, the main one waits.

use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use clap::Args;
use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2, SIGWINCH};
use signal_hook::iterator::Signals;

use crate::config::{ConfigError, Raw, Setting, env_value, parse_bool, parse_duration, resolve};

/// The readiness wait timed out (EX_UNAVAILABLE, as linkerd-await).
pub const EXIT_TIMEOUT: i32 = 69;
/// The command does not exist.
pub const EXIT_NOT_FOUND: i32 = 127;
/// The command exists but cannot be executed.
pub const EXIT_CANNOT_EXECUTE: i32 = 126;
const EXIT_INVALID_CONFIG: i32 = 2;

/// Signals a supervisor may send, forwarded to the command.
const FORWARDED: [i32; 7] = [SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH];
/// How long one readiness check or shutdown request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Shutdown requests tried before giving up.
const SHUTDOWN_ATTEMPTS: u32 = 3;

#[derive(Args, Debug, Default, Clone)]
pub struct AwaitArgs {
    /// The proxy's admin port [env: LAMEDUCK_AWAIT_PORT] [default: 4191]
    #[arg(short = 'p', long, value_name = "PORT")]
    pub port: Option<String>,

    /// The proxy's admin address [env: LAMEDUCK_AWAIT_ADMIN_ADDR] [default: 127.0.0.1]
    #[arg(long, value_name = "IP")]
    pub admin_addr: Option<String>,

    /// Pause between readiness checks [env: LAMEDUCK_AWAIT_BACKOFF] [default: 1s]
    #[arg(short = 'b', long, value_name = "DURATION")]
    pub backoff: Option<String>,

    /// Ask the proxy to shut down when the command ends
    /// [env: LAMEDUCK_AWAIT_SHUTDOWN=true|false] [default: false]
    #[arg(short = 'S', long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub shutdown: Option<String>,

    /// Stop waiting for readiness after this long [env: LAMEDUCK_AWAIT_TIMEOUT]
    /// [default: wait forever]
    #[arg(short = 't', long, value_name = "DURATION")]
    pub timeout: Option<String>,

    /// When the timeout runs out: exit 69 (true) or run the command anyway (false)
    /// [env: LAMEDUCK_AWAIT_TIMEOUT_FATAL] [default: true]
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub timeout_fatal: Option<String>,

    /// The command to run, and its arguments. LAMEDUCK_AWAIT_DISABLED=true skips the wait
    /// (not the shutdown request).
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<OsString>,
}

/// The validated settings of one `lameduck await`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AwaitConfig {
    pub admin: SocketAddr,
    pub backoff: Duration,
    pub shutdown: bool,
    pub timeout: Option<Duration>,
    pub timeout_fatal: bool,
    pub disabled: bool,
    pub command: Vec<OsString>,
}

const PORT: Setting = Setting {
    flag: "--port",
    var: "LAMEDUCK_AWAIT_PORT",
    example: "4191",
};
const ADMIN_ADDR: Setting = Setting {
    flag: "--admin-addr",
    var: "LAMEDUCK_AWAIT_ADMIN_ADDR",
    example: "127.0.0.1 or ::1",
};
const BACKOFF: Setting = Setting {
    flag: "--backoff",
    var: "LAMEDUCK_AWAIT_BACKOFF",
    example: "1s or 200ms",
};
const SHUTDOWN: Setting = Setting {
    flag: "--shutdown",
    var: "LAMEDUCK_AWAIT_SHUTDOWN",
    example: "true or false",
};
const TIMEOUT: Setting = Setting {
    flag: "--timeout",
    var: "LAMEDUCK_AWAIT_TIMEOUT",
    example: "2m or 30s",
};
const TIMEOUT_FATAL: Setting = Setting {
    flag: "--timeout-fatal",
    var: "LAMEDUCK_AWAIT_TIMEOUT_FATAL",
    example: "true or false",
};
const DISABLED: &str = "LAMEDUCK_AWAIT_DISABLED";

impl AwaitConfig {
    pub fn from_sources(
        args: AwaitArgs,
        env: impl Fn(&str) -> Option<OsString>,
    ) -> Result<AwaitConfig, ConfigError> {
        let port = match resolve(&PORT, args.port, &env)? {
            Some(raw) => match raw.value.trim().parse::<u16>() {
                Ok(port) if port != 0 => port,
                _ => return Err(raw.error("expected a port from 1 to 65535", PORT.example)),
            },
            None => 4191,
        };
        let ip: IpAddr = match resolve(&ADMIN_ADDR, args.admin_addr, &env)? {
            Some(raw) => {
                let text = raw
                    .value
                    .trim()
                    .trim_start_matches('[')
                    .trim_end_matches(']');
                text.parse()
                    .map_err(|_| raw.error("expected an IP address", ADMIN_ADDR.example))?
            }
            None => IpAddr::from([127, 0, 0, 1]),
        };
        let duration = |raw: Option<Raw>, setting: &Setting| {
            raw.map(|raw| parse_duration(&raw, setting.example))
                .transpose()
        };
        let backoff = duration(resolve(&BACKOFF, args.backoff, &env)?, &BACKOFF)?
            .unwrap_or(Duration::from_secs(1));
        let timeout = duration(resolve(&TIMEOUT, args.timeout, &env)?, &TIMEOUT)?;
        let flag = |raw: Option<Raw>, setting: &Setting, default: bool| {
            raw.map_or(Ok(default), |raw| parse_bool(&raw, setting.example))
        };
        let shutdown = flag(resolve(&SHUTDOWN, args.shutdown, &env)?, &SHUTDOWN, false)?;
        let timeout_fatal = flag(
            resolve(&TIMEOUT_FATAL, args.timeout_fatal, &env)?,
            &TIMEOUT_FATAL,
            true,
        )?;
        let disabled = flag(
            env_value(&env, DISABLED, "true or false")?,
            &SHUTDOWN,
            false,
        )?;
        Ok(AwaitConfig {
            admin: SocketAddr::new(ip, port),
            backoff: backoff.max(Duration::from_millis(1)),
            shutdown,
            timeout,
            timeout_fatal,
            disabled,
            command: args.command,
        })
    }
}

/// Runs `lameduck await`; returns the process exit status.
pub fn run(args: AwaitArgs, env: impl Fn(&str) -> Option<OsString>) -> i32 {
    let config = match AwaitConfig::from_sources(args, env) {
        Ok(config) => config,
        Err(error) => {
            say(&error.to_string());
            return EXIT_INVALID_CONFIG;
        }
    };
    // With --shutdown the wrapper stays, so it takes the supervisor's signals from the start.
    let mut signals = match config.shutdown {
        true => match Signals::new(FORWARDED) {
            Ok(signals) => Some(signals),
            Err(error) => {
                say(&format!("cannot install signal handlers: {error}"));
                return 1;
            }
        },
        false => None,
    };

    if config.disabled {
        say(&format!("{DISABLED} is set: not waiting for the proxy"));
    } else if let Err(stop) = wait_ready(&config, signals.as_mut()) {
        match stop {
            Stop::TimedOut if config.timeout_fatal => {
                say(&format!(
                    "the proxy at {} was not ready within {}; not running the command",
                    config.admin,
                    humantime::format_duration(config.timeout.unwrap_or_default())
                ));
                if config.shutdown {
                    post_shutdown(config.admin);
                }
                return EXIT_TIMEOUT;
            }
            Stop::TimedOut => {
                say("the proxy is not ready, but --timeout-fatal=false: running the command anyway")
            }
            Stop::Signal(signal) => {
                say(&format!(
                    "signal {signal} while waiting for the proxy; not running the command"
                ));
                post_shutdown(config.admin);
                return 128 + signal;
            }
        }
    }

    let (program, args) = config
        .command
        .split_first()
        .expect("clap requires a command");
    let mut command = Command::new(program);
    command.args(args);
    let Some(signals) = signals else {
        // No shutdown to ask for: become the command.
        let error = command.exec();
        return cannot_start(program, &error);
    };
    let code = match command.spawn() {
        Ok(child) => supervise(child, signals),
        Err(error) => cannot_start(program, &error),
    };
    post_shutdown(config.admin);
    code
}

enum Stop {
    TimedOut,
    Signal(i32),
}

/// Polls `GET /ready` until it answers 2xx.
fn wait_ready(config: &AwaitConfig, mut signals: Option<&mut Signals>) -> Result<(), Stop> {
    let started = Instant::now();
    let deadline = config.timeout.map(|timeout| started + timeout);
    for attempt in 1u64.. {
        let outcome = request(config.admin, "GET", "/ready");
        if let Ok(200..=299) = outcome {
            if attempt > 1 {
                say(&format!(
                    "the proxy is ready after {}ms",
                    started.elapsed().as_millis()
                ));
            }
            return Ok(());
        }
        if attempt == 1 || attempt % 10 == 0 {
            let why = match outcome {
                Ok(status) => format!("/ready answered {status}"),
                Err(error) => error.to_string(),
            };
            say(&format!(
                "waiting for the proxy at {} to be ready ({why})",
                config.admin
            ));
        }
        let mut pause = config.backoff;
        if let Some(deadline) = deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Stop::TimedOut);
            }
            pause = pause.min(left);
        }
        // Sleep in short steps so that a supervisor's signal is acted on at once.
        let wake = Instant::now() + pause;
        while Instant::now() < wake {
            if let Some(signal) = signals.as_deref_mut().and_then(terminating) {
                return Err(Stop::Signal(signal));
            }
            thread::sleep(
                Duration::from_millis(10).min(wake.saturating_duration_since(Instant::now())),
            );
        }
    }
    unreachable!("the loop returns")
}

/// A terminating signal received so far, if any (others are dropped: no command runs yet).
fn terminating(signals: &mut Signals) -> Option<i32> {
    signals
        .pending()
        .find(|signal| matches!(*signal, SIGTERM | SIGINT | SIGHUP | SIGQUIT))
}

/// Waits for the child while forwarding signals to it; returns its status as an exit code.
fn supervise(mut child: std::process::Child, mut signals: Signals) -> i32 {
    let pid = child.id() as libc::pid_t;
    let handle = signals.handle();
    let forwarder = thread::spawn(move || {
        for signal in signals.forever() {
            // SAFETY: kill(2) has no memory-safety preconditions; `pid` is our child, not yet
            // reaped while this thread runs.
            unsafe { libc::kill(pid, signal) };
        }
    });
    let code = if std::process::id() == 1 {
        reap_until(pid)
    } else {
        match child.wait() {
            Ok(status) => status
                .code()
                .or(status.signal().map(|signal| 128 + signal))
                .unwrap_or(1),
            Err(error) => {
                say(&format!("waiting for the command failed: {error}"));
                1
            }
        }
    };
    handle.close();
    let _ = forwarder.join();
    code
}

/// As PID 1: reaps every child (orphans re-parented to us included) until `pid` exits.
fn reap_until(pid: libc::pid_t) -> i32 {
    loop {
        let mut status = 0;
        // SAFETY: waitpid writes one int through a valid pointer.
        let reaped = unsafe { libc::waitpid(-1, &mut status, 0) };
        if reaped == pid {
            return if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status)
            } else if libc::WIFSIGNALED(status) {
                128 + libc::WTERMSIG(status)
            } else {
                1
            };
        }
        if reaped == -1 && io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            say("lost track of the command");
            return 1;
        }
    }
}

fn cannot_start(program: &OsString, error: &io::Error) -> i32 {
    let name = program.to_string_lossy();
    match error.kind() {
        io::ErrorKind::NotFound => {
            say(&format!("command not found: {name}"));
            EXIT_NOT_FOUND
        }
        _ => {
            say(&format!("cannot execute {name}: {error}"));
            EXIT_CANNOT_EXECUTE
        }
    }
}

/// Posts `/shutdown`, retrying only when no answer came.
fn post_shutdown(admin: SocketAddr) {
    for attempt in 1..=SHUTDOWN_ATTEMPTS {
        match request(admin, "POST", "/shutdown") {
            Ok(200) => return say("asked the proxy to shut down"),
            Ok(404) => {
                return say(
                    "the proxy's shutdown endpoint is not enabled (start it with --shutdown-endpoint); it keeps running",
                );
            }
            Ok(status) => return say(&format!("the proxy refused to shut down: {status}")),
            Err(error) if attempt == SHUTDOWN_ATTEMPTS => {
                return say(&format!(
                    "could not ask the proxy at {admin} to shut down: {error}"
                ));
            }
            Err(_) => thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// One HTTP/1.1 request to the admin server; returns the status code.
fn request(admin: SocketAddr, method: &str, path: &str) -> io::Result<u16> {
    let mut stream = TcpStream::connect_timeout(&admin, REQUEST_TIMEOUT)?;
    stream.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    stream.set_write_timeout(Some(REQUEST_TIMEOUT))?;
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes())?;
    let mut head = [0u8; 64];
    let mut read = 0;
    while read < 12 {
        match stream.read(&mut head[read..])? {
            0 => break,
            n => read += n,
        }
    }
    let line = String::from_utf8_lossy(&head[..read]);
    line.split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("not an HTTP response: {line:?}"),
            )
        })
}

fn say(message: &str) {
    eprintln!("lameduck await: {message}");
}
