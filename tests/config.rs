//! Configuration from flags and variables (docs/configuration.md), on the real binary:
//! bad values exit 2 at once with a message naming the setting; good ones take effect.

mod support;

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::time::Duration;

use support::*;

/// Runs the binary expecting invalid configuration: exit 2, quickly, naming `setting`.
fn assert_rejected(args: &[&str], env: &[(&str, &OsStr)], setting: &str, value: &str) {
    let (status, output, took) = run_to_exit(args, env);
    assert_eq!(
        status.code(),
        Some(2),
        "{args:?} {env:?} should exit 2:\n{output}"
    );
    assert!(
        output.contains(setting),
        "the message names {setting}: {output}"
    );
    assert!(
        output.contains(value),
        "the message quotes {value:?}: {output}"
    );
    assert!(
        !output.contains("panicked") && !output.contains("backtrace"),
        "{output}"
    );
    assert!(took < Duration::from_secs(2), "rejecting took {took:?}");
}

#[test]
fn bad_durations_exit_2_naming_the_flag_or_variable() {
    for bad in [
        "",
        "-1s",
        "10",
        "1e3s",
        "18446744073709551615d",
        "1000000h",
        "soon",
    ] {
        let flag = format!("--shutdown-grace-period={bad}");
        assert_rejected(&[&flag], &[], "--shutdown-grace-period", bad);
        assert_rejected(
            &[],
            &[("LAMEDUCK_SHUTDOWN_GRACE_PERIOD", OsStr::new(bad))],
            "LAMEDUCK_SHUTDOWN_GRACE_PERIOD",
            bad,
        );
    }
    assert_rejected(
        &["--lame-duck-period=1m", "--shutdown-grace-period=30s"],
        &[],
        "--lame-duck-period",
        "1m",
    );
    assert_rejected(&["--connect-timeout=0s"], &[], "--connect-timeout", "0s");
    assert_rejected(
        &[],
        &[("LAMEDUCK_CONNECT_TIMEOUT", OsStr::new("fast"))],
        "LAMEDUCK_CONNECT_TIMEOUT",
        "fast",
    );
}

#[test]
fn bad_routes_and_addresses_exit_2() {
    assert_rejected(
        &["--inbound", "0.0.0.0:4143"],
        &[],
        "--inbound",
        "0.0.0.0:4143",
    );
    assert_rejected(
        &["--inbound", "127.0.0.1:0=127.0.0.1:8080/grpc"],
        &[],
        "--inbound",
        "/grpc",
    );
    assert_rejected(
        &["--outbound", "127.0.0.1:4140=:80"],
        &[],
        "--outbound",
        ":80",
    );
    assert_rejected(
        &[],
        &[(
            "LAMEDUCK_INBOUND",
            OsStr::new("127.0.0.1:1=127.0.0.1:2,garbage"),
        )],
        "LAMEDUCK_INBOUND",
        "garbage",
    );
    assert_rejected(
        &["--admin=localhost:4191"],
        &[],
        "--admin",
        "localhost:4191",
    );
    assert_rejected(
        &["--outbound-shutdown=later"],
        &[],
        "--outbound-shutdown",
        "later",
    );
    assert_rejected(
        &[],
        &[("LAMEDUCK_SHUTDOWN_ENDPOINT", OsStr::new("sure"))],
        "LAMEDUCK_SHUTDOWN_ENDPOINT",
        "sure",
    );
    assert_rejected(&["--log-format=xml"], &[], "--log-format", "xml");
    assert_rejected(&["--log=lameduck=chatty"], &[], "--log", "chatty");
    assert_rejected(&[], &[("RUST_LOG", OsStr::new("[[["))], "RUST_LOG", "[[[");
}

#[test]
fn non_utf8_variable_exits_2_naming_it() {
    let value = OsStr::from_bytes(b"90\xffs");
    let (status, output, _) = run_to_exit(&[], &[("LAMEDUCK_SHUTDOWN_GRACE_PERIOD", value)]);
    assert_eq!(status.code(), Some(2), "{output}");
    assert!(
        output.contains("LAMEDUCK_SHUTDOWN_GRACE_PERIOD") && output.contains("UTF-8"),
        "{output}"
    );
}

#[test]
fn unknown_flags_exit_2_and_help_lists_every_setting() {
    let (status, output, _) = run_to_exit(&["--grace=5s"], &[]);
    assert_eq!(status.code(), Some(2), "{output}");
    let (status, help, _) = run_to_exit(&["--help"], &[]);
    assert_eq!(status.code(), Some(0));
    for flag in [
        "--inbound",
        "--outbound",
        "--admin",
        "--shutdown-grace-period",
        "--lame-duck-period",
        "--outbound-shutdown",
        "--shutdown-endpoint",
        "--connect-timeout",
        "--log ",
        "--log-format",
        "LAMEDUCK_INBOUND",
        "LAMEDUCK_SHUTDOWN_GRACE_PERIOD",
        "LAMEDUCK_SHUTDOWN_ENDPOINT",
    ] {
        assert!(
            help.contains(flag),
            "--help does not mention {flag}:\n{help}"
        );
    }
    let (status, _, _) = run_to_exit(&["proxy", "--help"], &[]);
    assert_eq!(status.code(), Some(0));
}

#[test]
fn a_port_in_use_exits_1_naming_the_address() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let (status, output, _) = run_to_exit(
        &[
            "--inbound",
            &format!("{addr}=127.0.0.1:8080"),
            "--admin=127.0.0.1:0",
        ],
        &[],
    );
    assert_eq!(status.code(), Some(1), "{output}");
    assert!(
        output.contains(&addr) && output.contains("inbound listener"),
        "{output}"
    );
    let (status, output, _) = run_to_exit(
        &["--inbound", "127.0.0.1:0=127.0.0.1:8080", "--admin", &addr],
        &[],
    );
    assert_eq!(status.code(), Some(1), "{output}");
    assert!(output.contains("admin server"), "{output}");
}

#[test]
fn variables_configure_the_proxy() {
    let echo = EchoServer::start();
    let mut cmd = command();
    cmd.env(
        "LAMEDUCK_INBOUND",
        format!("127.0.0.1:0={},127.0.0.1:0={}/tcp", echo.addr, echo.addr),
    )
    .env("LAMEDUCK_OUTBOUND", format!("127.0.0.1:0={}", echo.addr))
    .env("LAMEDUCK_SHUTDOWN_ENDPOINT", "true")
    .env("LAMEDUCK_SHUTDOWN_GRACE_PERIOD", "1m 30s");
    let mut proxy = Proxy::start_command(&mut cmd, &[]);
    assert_eq!(proxy.inbound.len(), 2);
    assert_eq!(proxy.outbound.len(), 1);
    for addr in proxy.inbound.iter().chain(&proxy.outbound) {
        echo_connect(*addr);
    }
    assert_eq!(
        proxy.post("/shutdown").status,
        200,
        "LAMEDUCK_SHUTDOWN_ENDPOINT=true enables the endpoint"
    );
    assert_eq!(proxy.wait_exit(PATIENCE).code(), Some(0));
    assert_eq!(
        proxy.logs.events("shutdown started")[0]["fields"]["grace_period"],
        "1m 30s"
    );
}

#[test]
fn a_flag_wins_over_its_variable() {
    let echo = EchoServer::start();
    let mut cmd = command();
    cmd.env("LAMEDUCK_SHUTDOWN_ENDPOINT", "true");
    let proxy = Proxy::start_command(
        &mut cmd,
        &[
            "--inbound",
            &echo.route("127.0.0.1:0"),
            "--shutdown-endpoint=false",
        ],
    );
    assert_eq!(proxy.post("/shutdown").status, 404);
}
