//! `lameduck await` on real processes: readiness, timeouts, exit statuses, signal forwarding,
//! the shutdown request, and a Job end to end with a real proxy.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use support::backend::Backend;
use support::process::children;
use support::*;

/// An admin server stand-in: `/ready` answers 503 until `ready_after` requests were made (or
/// never, with `usize::MAX`), `/shutdown` answers `shutdown_status`. Records every request line.
struct FakeAdmin {
    addr: SocketAddr,
    requests: Arc<Mutex<Vec<String>>>,
}

impl FakeAdmin {
    fn start(ready_after: usize, shutdown_status: u16) -> FakeAdmin {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let recorded = requests.clone();
        let ready_checks = Arc::new(AtomicUsize::new(0));
        thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).unwrap_or(0) == 1 {
                    head.push(byte[0]);
                }
                let line = String::from_utf8_lossy(&head)
                    .lines()
                    .next()
                    .unwrap_or("")
                    .to_string();
                recorded.lock().unwrap().push(line.clone());
                let status = if line.starts_with("GET /ready") {
                    if ready_checks.fetch_add(1, Ordering::SeqCst) + 1 >= ready_after {
                        200
                    } else {
                        503
                    }
                } else if line.starts_with("POST /shutdown") {
                    shutdown_status
                } else {
                    404
                };
                let _ = stream.write_all(
                    format!(
                        "HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    )
                    .as_bytes(),
                );
            }
        });
        FakeAdmin { addr, requests }
    }

    fn count(&self, prefix: &str) -> usize {
        self.requests
            .lock()
            .unwrap()
            .iter()
            .filter(|line| line.starts_with(prefix))
            .count()
    }
}

fn wrapper(admin: SocketAddr, flags: &[&str], command: &[&str]) -> Command {
    let mut cmd = command_for_await();
    let port = admin.port().to_string();
    cmd.args(["await", "-p", &port, "-b", "50ms"])
        .args(flags)
        .arg("--")
        .args(command);
    cmd
}

fn command_for_await() -> Command {
    let mut cmd = Command::new(BIN);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("LAMEDUCK_") {
            cmd.env_remove(name);
        }
    }
    cmd.stdin(Stdio::null());
    cmd
}

/// Runs to completion; returns status, stderr and elapsed time.
fn finish(mut cmd: Command) -> (ExitStatus, String, Duration) {
    let started = Instant::now();
    let mut child = cmd.stderr(Stdio::piped()).spawn().unwrap();
    let status = wait_child(&mut child, PATIENCE);
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    (status, stderr, started.elapsed())
}

#[test]
fn waits_for_readiness_reached_late_then_runs_the_command() {
    let admin = FakeAdmin::start(10, 200);
    let (status, stderr, took) = finish(wrapper(admin.addr, &[], &["sh", "-c", "exit 0"]));
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(admin.count("GET /ready") >= 10);
    assert!(
        took >= Duration::from_millis(400),
        "the command ran before the proxy was ready ({took:?})"
    );
    assert!(
        stderr.contains("waiting for the proxy") && stderr.contains("ready after"),
        "{stderr}"
    );
    assert_eq!(admin.count("POST /shutdown"), 0, "no shutdown without -S");
}

#[test]
fn timeout_exits_69_or_runs_anyway() {
    let admin = FakeAdmin::start(usize::MAX, 200);
    let marker = std::env::temp_dir().join(format!("lameduck-await-{}", std::process::id()));
    let _ = std::fs::remove_file(&marker);
    let touch = format!("touch {}", marker.display());
    let (status, stderr, took) =
        finish(wrapper(admin.addr, &["-t", "300ms"], &["sh", "-c", &touch]));
    assert_eq!(status.code(), Some(69), "{stderr}");
    assert!(stderr.contains("not ready within 300ms"), "{stderr}");
    assert!(!marker.exists(), "the command ran after a fatal timeout");
    assert!(took < Duration::from_secs(3));

    let (status, stderr, _) = finish(wrapper(
        admin.addr,
        &["-t", "300ms", "--timeout-fatal=false"],
        &["sh", "-c", &format!("{touch}; exit 4")],
    ));
    assert_eq!(status.code(), Some(4), "{stderr}");
    assert!(
        marker.exists(),
        "the command did not run with --timeout-fatal=false"
    );
    let _ = std::fs::remove_file(&marker);
}

#[test]
fn exit_statuses_and_signal_deaths_propagate() {
    let admin = FakeAdmin::start(1, 200);
    for flags in [&[][..], &["-S"][..]] {
        for code in [0, 3] {
            let (status, stderr, _) = finish(wrapper(
                admin.addr,
                flags,
                &["sh", "-c", &format!("exit {code}")],
            ));
            assert_eq!(status.code(), Some(code), "{flags:?}: {stderr}");
        }
    }
    // Without -S the command replaced the wrapper: the wrapper's own process dies of the signal.
    let (status, _, _) = finish(wrapper(admin.addr, &[], &["sh", "-c", "kill -TERM $$"]));
    assert_eq!(status.signal(), Some(libc::SIGTERM));
    // With -S the wrapper reports it as 128 + N.
    let (status, _, _) = finish(wrapper(admin.addr, &["-S"], &["sh", "-c", "kill -TERM $$"]));
    assert_eq!(status.code(), Some(143));
    let (status, _, _) = finish(wrapper(admin.addr, &["-S"], &["sh", "-c", "kill -KILL $$"]));
    assert_eq!(status.code(), Some(137));
}

#[test]
fn without_shutdown_the_command_replaces_the_wrapper() {
    let admin = FakeAdmin::start(1, 200);
    let mut child = wrapper(admin.addr, &[], &["sh", "-c", "echo $$; exit 0"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let status = wait_child(&mut child, PATIENCE);
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert_eq!(status.code(), Some(0));
    assert_eq!(out.trim(), pid.to_string(), "exec keeps the PID");
}

#[test]
fn every_supervisor_signal_reaches_the_command() {
    let admin = FakeAdmin::start(1, 200);
    let dir = std::env::temp_dir().join(format!("lameduck-signals-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("log");
    let ready = dir.join("ready");
    // `sleep & wait`, not a foreground `sleep`: bash runs a trap at once when `wait` is
    // interrupted, whereas a SIGINT that arrives while it waits for a foreground command is
    // dropped when that command does not die of it (bash's "wait and cooperative exit").
    let script = format!(
        "for s in HUP INT QUIT USR1 USR2 WINCH; do trap \"echo $s >> {log}\" $s; done; \
         trap 'echo TERM >> {log}; exit 0' TERM; touch {ready}; while :; do sleep 0.05 & wait $!; done",
        log = log.display(),
        ready = ready.display()
    );
    let mut child = wrapper(admin.addr, &["-S"], &["bash", "-c", &script])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_until("the command installed its traps", PATIENCE, || {
        ready.exists()
    });
    let signals = [
        (libc::SIGHUP, "HUP"),
        (libc::SIGINT, "INT"),
        (libc::SIGQUIT, "QUIT"),
        (libc::SIGUSR1, "USR1"),
        (libc::SIGUSR2, "USR2"),
        (libc::SIGWINCH, "WINCH"),
        (libc::SIGTERM, "TERM"),
    ];
    for (signal, name) in signals {
        signal_pid(child.id() as i32, signal);
        wait_until(&format!("{name} reaches the command"), PATIENCE, || {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .lines()
                .any(|line| line == name)
        });
    }
    assert_eq!(wait_child(&mut child, PATIENCE).code(), Some(0));
    assert_eq!(admin.count("POST /shutdown"), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn disabled_skips_the_wait_but_not_the_shutdown_and_posts_it_once() {
    let admin = FakeAdmin::start(usize::MAX, 200);
    let mut cmd = wrapper(admin.addr, &["-S"], &["sh", "-c", "exit 5"]);
    cmd.env("LAMEDUCK_AWAIT_DISABLED", "true");
    let (status, stderr, _) = finish(cmd);
    assert_eq!(status.code(), Some(5), "{stderr}");
    assert_eq!(
        admin.count("GET /ready"),
        0,
        "LAMEDUCK_AWAIT_DISABLED still waited"
    );
    assert_eq!(
        admin.count("POST /shutdown"),
        1,
        "/shutdown is posted exactly once"
    );
}

#[test]
fn a_disabled_shutdown_endpoint_is_reported() {
    let admin = FakeAdmin::start(1, 404);
    let (status, stderr, _) = finish(wrapper(admin.addr, &["-S"], &["true"]));
    assert_eq!(status.code(), Some(0));
    assert!(
        stderr.contains("shutdown endpoint is not enabled"),
        "{stderr}"
    );
    assert_eq!(
        admin.count("POST /shutdown"),
        1,
        "a 404 is an answer: not retried"
    );
}

#[test]
fn missing_or_unexecutable_commands_exit_127_and_126_and_still_shut_down() {
    let admin = FakeAdmin::start(1, 200);
    let (status, stderr, _) = finish(wrapper(admin.addr, &["-S"], &["/nonexistent/app"]));
    assert_eq!(status.code(), Some(127));
    assert!(
        stderr.contains("command not found: /nonexistent/app"),
        "{stderr}"
    );
    assert_eq!(
        admin.count("POST /shutdown"),
        1,
        "a command that could not start still ends the Job"
    );

    let not_executable =
        std::env::temp_dir().join(format!("lameduck-noexec-{}", std::process::id()));
    std::fs::write(&not_executable, "just text").unwrap();
    let path = not_executable.display().to_string();
    let (status, stderr, _) = finish(wrapper(admin.addr, &[], &[&path]));
    assert_eq!(status.code(), Some(126));
    assert!(
        stderr.contains(&format!("cannot execute {path}")),
        "{stderr}"
    );
    let _ = std::fs::remove_file(&not_executable);

    let (status, stderr, _) = finish(wrapper(admin.addr, &["--timeout=soon"], &["true"]));
    assert_eq!(status.code(), Some(2));
    assert!(
        stderr.contains("--timeout") && stderr.contains("soon"),
        "{stderr}"
    );
}

#[test]
fn a_job_completes_end_to_end_through_a_real_proxy() {
    let backend = Backend::start();
    let mut proxy = Proxy::start(&[
        "--inbound",
        &backend.route("127.0.0.1:0"),
        "--shutdown-endpoint",
    ]);
    let port = proxy.inbound[0].port();
    let request = format!(
        "exec 3<>/dev/tcp/127.0.0.1/{port}; \
         printf 'GET /job HTTP/1.1\\r\\nHost: app.local\\r\\nConnection: close\\r\\n\\r\\n' >&3; \
         head -n 1 <&3 | grep -q ' 200 ' || exit 9; exit 3"
    );
    let (status, stderr, _) = finish(wrapper(proxy.admin, &["-S"], &["bash", "-c", &request]));
    assert_eq!(status.code(), Some(3), "the Job's own status: {stderr}");
    assert_eq!(
        backend.seen_paths(),
        vec!["/job"],
        "the request went through the proxy"
    );
    assert_eq!(
        proxy.wait_exit(PATIENCE).code(),
        Some(0),
        "the proxy drained and exited"
    );
    assert_eq!(
        proxy.logs.events("shutdown started")[0]["fields"]["trigger"],
        "POST /shutdown"
    );
}

#[test]
fn as_pid_1_it_reaps_orphans() {
    let admin = FakeAdmin::start(1, 200);
    let port = admin.addr.port().to_string();
    // The subshell's `sleep 0.1` is orphaned at once and re-parented to PID 1: the wrapper.
    let mut child = Command::new("unshare")
        .args([
            "--pid",
            "--fork",
            "--mount-proc",
            "--kill-child",
            BIN,
            "await",
            "-p",
            &port,
            "-S",
            "--",
        ])
        .args(["sh", "-c", "(sleep 0.1 &); sleep 1; exit 0"])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut wrapper_pid = 0;
    wait_until("unshare starts the wrapper", PATIENCE, || {
        wrapper_pid = children(child.id() as i32).into_iter().next().unwrap_or(0);
        wrapper_pid != 0
    });
    thread::sleep(Duration::from_millis(600));
    let zombies: Vec<i32> = children(wrapper_pid)
        .into_iter()
        .filter(|&pid| state(pid) == 'Z')
        .collect();
    assert!(
        zombies.is_empty(),
        "orphans left as zombies under PID 1: {zombies:?}"
    );
    assert_eq!(wait_child(&mut child, PATIENCE).code(), Some(0));
    assert_eq!(admin.count("POST /shutdown"), 1);
}

fn state(pid: i32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rfind(')')
        .and_then(|end| stat[end + 2..].chars().next())
        .unwrap_or('?')
}
