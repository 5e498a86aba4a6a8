//! Configuration: the command line, the `LAMEDUCK_*` environment variables and their defaults,
//! parsed along one path into a validated [`Config`].
//!
//! Every setting has a flag and a variable (docs/configuration.md). A flag wins over its variable,
//! a variable over the default. Values are parsed by the same function whichever source they
//! came from, and a bad value becomes a [`ConfigError`] that names the flag or the variable it
//! came from, quotes the value and shows a good example; `main` turns it into exit status 2.
//!
//! Tests build a [`Config`] with [`Config::from_sources`] and a map standing in for the process
//! environment, so they never touch the real one. Nothing here binds sockets or reads files.

use std::ffi::OsString;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;

mod app_probes;
mod handoff;

pub use app_probes::{APP_HEALTH_PREFIX, AppProbe, AppProbes, Check};
pub use handoff::Handoffs;

/// The inbound route used when neither `--inbound` nor `--outbound` names one.
pub const DEFAULT_INBOUND_ROUTE: &str = "0.0.0.0:4143=127.0.0.1:8080";
/// Where the admin server listens by default (kubelet probes and Prometheus reach it).
pub const DEFAULT_ADMIN_ADDR: &str = "0.0.0.0:4191";
/// How long a shutdown may take before the remaining connections are reset.
pub const DEFAULT_SHUTDOWN_GRACE_PERIOD: Duration = Duration::from_secs(120);
/// How long listeners keep accepting after the shutdown trigger, when no adaptive lame duck is
/// asked for.
pub const DEFAULT_LAME_DUCK_PERIOD: Duration = Duration::ZERO;
/// The shortest silence that ends an adaptive lame duck: each source of new connections must be
/// silent for a window that follows its own rate (src/arrivals.rs), never shorter than this
/// (docs/pod-lifecycle.md says why this figure).
pub const DEFAULT_LAME_DUCK_QUIET_WINDOW: Duration = Duration::from_millis(250);
/// An adaptive lame duck lasts at least this long, however quiet.
pub const DEFAULT_LAME_DUCK_MIN: Duration = Duration::from_secs(2);
/// The close-spread window when none is asked for (at most half the grace period): the part of
/// the grace period, at its end, over which the connections still open are ended one by one
/// (docs/lifecycle.md says why this figure).
pub const DEFAULT_CLOSE_SPREAD_WINDOW: Duration = Duration::from_secs(10);
/// How long a connection to a target may take.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an `auto` route waits for a client's first bytes before forwarding it as TCP.
pub const DEFAULT_DETECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How long an HTTP client may take to send a request's headers (slowloris); for HTTP/2, from
/// accept to the first request (preface, SETTINGS and the first header block).
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an HTTP/2 connection may stay without an open stream before GOAWAY. Between
/// HAProxy's usual `timeout client` (30-50 s), nginx's `keepalive_timeout` (75 s) and Envoy's
/// hour: long enough for a client pool to reuse the connection, short enough that idle
/// connections do not pile up.
pub const DEFAULT_H2_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a TCP stream or tunnel that one side has half-closed may go on with nothing from
/// the other side: the kernel's own FIN_WAIT_2 bound (`tcp_fin_timeout`, 60 s); HAProxy's
/// `timeout client-fin`/`server-fin` are usually 30 s.
pub const DEFAULT_TCP_HALF_CLOSE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a streamed request or response body may move no byte: Envoy's stream idle timeout
/// (5 min), not HAProxy's usual `timeout client`/`server` (30 s), because a mesh carries
/// long-lived gRPC and server-sent-event streams that are quiet for minutes.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(5 * 60);
/// The largest request head (HTTP/1) or header list (HTTP/2) accepted, in bytes.
pub const DEFAULT_MAX_HEADER_SIZE: usize = 64 * 1024;
/// Bounds of `--http-max-header-size` (hyper needs at least 8 KiB of read buffer).
pub const MIN_MAX_HEADER_SIZE: usize = 8 * 1024;
pub const MAX_MAX_HEADER_SIZE: usize = 1024 * 1024;
/// Streams one HTTP/2 client may have open at once.
pub const DEFAULT_H2_MAX_CONCURRENT_STREAMS: u32 = 100;
/// The log filter when neither `--log`, `LAMEDUCK_LOG` nor `RUST_LOG` is set.
pub const DEFAULT_LOG_FILTER: &str = "info";
/// The longest duration any setting accepts; anything longer is a typo, not a wish.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 60 * 60);

/// The proxy's flags as the user typed them. Values stay raw strings here so that a flag and
/// its variable go through the same parser in [`Config::from_sources`].
#[derive(Args, Debug, Default, Clone)]
pub struct ProxyArgs {
    /// Inbound route LISTEN=TARGET[/PROTOCOL], repeatable [env: LAMEDUCK_INBOUND, comma-separated]
    /// [default when no route is given: 0.0.0.0:4143=127.0.0.1:8080]
    #[arg(long, value_name = "ROUTE")]
    pub inbound: Vec<String>,

    /// Outbound route LISTEN=TARGET[/PROTOCOL], repeatable [env: LAMEDUCK_OUTBOUND, comma-separated]
    #[arg(long, value_name = "ROUTE")]
    pub outbound: Vec<String>,

    /// Admin server address [env: LAMEDUCK_ADMIN] [default: 0.0.0.0:4191]
    #[arg(long, value_name = "ADDR")]
    pub admin: Option<String>,

    /// How long a shutdown may last before the remaining connections are reset
    /// [env: LAMEDUCK_SHUTDOWN_GRACE_PERIOD] [default: 120s]
    #[arg(long, value_name = "DURATION")]
    pub shutdown_grace_period: Option<String>,

    /// The last part of the grace period, in which the connections still open are ended one by
    /// one, evenly spread, each as cleanly as its protocol allows; 0s resets them all at the
    /// deadline [env: LAMEDUCK_CLOSE_SPREAD_WINDOW] [default: 10s, at most half the grace period]
    #[arg(long, value_name = "DURATION")]
    pub close_spread_window: Option<String>,

    /// How long listeners keep accepting after the shutdown trigger, asking every HTTP
    /// connection to go away [env: LAMEDUCK_LAME_DUCK_PERIOD] [default: 0s]
    #[arg(long, value_name = "DURATION")]
    pub lame_duck_period: Option<String>,

    /// Makes the lame duck adaptive: listeners keep accepting while new connections keep
    /// arriving, for at most this long [env: LAMEDUCK_LAME_DUCK_MAX] [default: none]
    #[arg(long, value_name = "DURATION")]
    pub lame_duck_max: Option<String>,

    /// The shortest silence that ends an adaptive lame duck: it ends once every source of new
    /// connections has been silent for a window that follows its own rate, never shorter than
    /// this [env: LAMEDUCK_LAME_DUCK_QUIET_WINDOW] [default: 250ms]
    #[arg(long, value_name = "DURATION")]
    pub lame_duck_quiet_window: Option<String>,

    /// An adaptive lame duck lasts at least this long [env: LAMEDUCK_LAME_DUCK_MIN] [default: 2s]
    #[arg(long, value_name = "DURATION")]
    pub lame_duck_min: Option<String>,

    /// Peers whose new connections do not keep an adaptive lame duck open (the kubelet's
    /// probes come from the node's address), comma-separated addresses or CIDRs
    /// [env: LAMEDUCK_LAME_DUCK_IGNORE_SOURCES] [default: none]
    #[arg(long, value_name = "CIDRS")]
    pub lame_duck_ignore_sources: Option<String>,

    /// When outbound listeners close: with the inbound ones (immediate) or once every inbound
    /// connection has closed (after-inbound) [env: LAMEDUCK_OUTBOUND_SHUTDOWN] [default: immediate]
    #[arg(long, value_name = "immediate|after-inbound")]
    pub outbound_shutdown: Option<String>,

    /// Enable `POST /shutdown` on the admin server (loopback peers only)
    /// [env: LAMEDUCK_SHUTDOWN_ENDPOINT=true|false] [default: disabled]
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub shutdown_endpoint: Option<String>,

    /// Unix socket on which the app containers' preStop and postStart hooks (`lameduck
    /// prestop`, `lameduck poststart`) ask the proxy to quiesce its inbound side and to serve
    /// it again [env: LAMEDUCK_DRAIN_SOCKET] [default: none]
    #[arg(long, value_name = "PATH")]
    pub drain_socket: Option<String>,

    /// The app containers' own probes, which the kubelet now sends to the admin server
    /// (`/app-health/...`), as JSON: `lameduck inject` writes it (docs/kubernetes.md, "Probes")
    /// [env: LAMEDUCK_APP_PROBES] [default: none]
    #[arg(long, value_name = "JSON")]
    pub app_probes: Option<String>,

    /// Where late connections go once the lame duck is over, instead of being refused: the
    /// pod's Service for each pod port, comma-separated `PORT=HOST:PORT`; `lameduck inject`
    /// writes it (docs/pod-lifecycle.md, "Hand-off") [env: LAMEDUCK_HANDOFF] [default: none]
    #[arg(long, value_name = "PORT=HOST:PORT,...")]
    pub handoff: Option<String>,

    /// Where the proxy writes how its shutdown ended, as it exits: Kubernetes shows it as the
    /// container's termination message (`kubectl describe pod`); `lameduck inject` sets
    /// /dev/termination-log [env: LAMEDUCK_TERMINATION_LOG] [default: none]
    #[arg(long, value_name = "PATH")]
    pub termination_log: Option<String>,

    /// The pod's address, to which the app probes go as the kubelet's went
    /// [env: LAMEDUCK_POD_IP] [default: 127.0.0.1]
    #[arg(long, value_name = "IP")]
    pub pod_ip: Option<String>,

    /// How long connecting to a target may take [env: LAMEDUCK_CONNECT_TIMEOUT] [default: 5s]
    #[arg(long, value_name = "DURATION")]
    pub connect_timeout: Option<String>,

    /// How long an auto route waits for a client's first bytes before forwarding the
    /// connection as opaque TCP (server-speaks-first protocols) [env: LAMEDUCK_DETECT_TIMEOUT]
    /// [default: 1s]
    #[arg(long, value_name = "DURATION")]
    pub detect_timeout: Option<String>,

    /// How long an HTTP client may take to send a request's headers
    /// [env: LAMEDUCK_HTTP_HEADER_READ_TIMEOUT] [default: 10s]
    #[arg(long, value_name = "DURATION")]
    pub http_header_read_timeout: Option<String>,

    /// Largest HTTP request head (HTTP/1) or header list (HTTP/2), in bytes, KiB or MiB
    /// [env: LAMEDUCK_HTTP_MAX_HEADER_SIZE] [default: 64KiB]
    #[arg(long, value_name = "SIZE")]
    pub http_max_header_size: Option<String>,

    /// Streams one HTTP/2 client may have open at once
    /// [env: LAMEDUCK_HTTP2_MAX_CONCURRENT_STREAMS] [default: 100]
    #[arg(long, value_name = "N")]
    pub http2_max_concurrent_streams: Option<String>,

    /// Forward bodiless HTTP/1.1 requests with the fast lane (false: every HTTP/1 request
    /// through hyper, the escape hatch) [env: LAMEDUCK_HTTP1_FAST_LANE=true|false]
    /// [default: true]
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub http1_fast_lane: Option<String>,

    /// Send outbound requests that got no answer again (docs/http.md, "Retries"), within the
    /// retry budget [env: LAMEDUCK_HTTP_RETRIES=true|false] [default: true]
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub http_retries: Option<String>,

    /// How many retries outbound requests may take: a share of the requests of the last 10
    /// seconds plus a floor per second [env: LAMEDUCK_HTTP_RETRY_BUDGET] [default: 20%+10/s]
    #[arg(long, value_name = "PERCENT%+N/s")]
    pub http_retry_budget: Option<String>,

    /// How long the target may take to start its response before the client gets 504; 0s
    /// for no limit [env: LAMEDUCK_HTTP_RESPONSE_TIMEOUT] [default: 0s]
    #[arg(long, value_name = "DURATION")]
    pub http_response_timeout: Option<String>,

    /// How long a request or response body may move no byte before the stream fails (408 if
    /// the response had not started, else the stream or connection is reset); 0s for no
    /// limit [env: LAMEDUCK_HTTP_BODY_TIMEOUT] [default: 5m]
    #[arg(long, value_name = "DURATION")]
    pub http_body_timeout: Option<String>,

    /// How long an HTTP/2 connection may stay without an open stream before it is asked to go
    /// away (GOAWAY); 0s for no limit [env: LAMEDUCK_HTTP2_IDLE_TIMEOUT] [default: 60s]
    #[arg(long, value_name = "DURATION")]
    pub http2_idle_timeout: Option<String>,

    /// How long a TCP stream or tunnel half-closed by one side may go on with nothing from the
    /// other before both are reset; 0s for no limit [env: LAMEDUCK_TCP_HALF_CLOSE_TIMEOUT]
    /// [default: 60s]
    #[arg(long, value_name = "DURATION")]
    pub tcp_half_close_timeout: Option<String>,

    /// How long an opaque TCP stream or tunnel may move no byte either way before both sides
    /// are reset; 0s for no limit (databases idle for long) [env: LAMEDUCK_TCP_IDLE_TIMEOUT]
    /// [default: 0s]
    #[arg(long, value_name = "DURATION")]
    pub tcp_idle_timeout: Option<String>,

    /// Log filter, RUST_LOG syntax [env: LAMEDUCK_LOG, else RUST_LOG] [default: info]
    #[arg(long, value_name = "FILTER")]
    pub log: Option<String>,

    /// Log format [env: LAMEDUCK_LOG_FORMAT] [default: plain]
    #[arg(long, value_name = "plain|json")]
    pub log_format: Option<String>,
}

/// Which way a route faces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Faces the network: peers outside the pod reaching the app.
    Inbound,
    /// Faces the app: the app reaching services outside the pod.
    Outbound,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Inbound => "inbound",
            Direction::Outbound => "outbound",
        }
    }
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a route expects to carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// Detect HTTP/1, HTTP/2 prior knowledge, else opaque TCP.
    Auto,
    /// HTTP/1 or HTTP/2 prior knowledge; anything else gets an HTTP error.
    Http,
    /// Opaque TCP, byte for byte.
    Tcp,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Auto => "auto",
            Protocol::Http => "http",
            Protocol::Tcp => "tcp",
        }
    }
}

/// Where a route forwards to: an address, or a host name resolved at connect time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Addr(SocketAddr),
    Host {
        host: String,
        port: u16,
    },
    /// Each connection's own destination before the pod's NAT rules redirected it to the
    /// proxy (`SO_ORIGINAL_DST`): transparent interception.
    OrigDst,
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Addr(addr) => write!(f, "{addr}"),
            Target::Host { host, port } => write!(f, "{host}:{port}"),
            Target::OrigDst => f.write_str(ORIG_DST),
        }
    }
}

/// One `LISTEN=TARGET[/PROTOCOL]` route.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub direction: Direction,
    pub listen: SocketAddr,
    pub target: Target,
    pub protocol: Protocol,
}

/// When outbound listeners close during a shutdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutboundShutdown {
    /// Together with the inbound listeners.
    Immediate,
    /// Once every inbound connection has closed, for apps that still call out while they
    /// finish their own requests.
    AfterInbound,
}

/// How long listeners keep accepting, every connection asked to go away, once the shutdown
/// or the inbound quiesce has started (docs/pod-lifecycle.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LameDuck {
    /// A fixed period (zero: none).
    Fixed(Duration),
    /// While new connections keep arriving: it ends once none has for `quiet`, never before
    /// `min` and never after `max`.
    Adaptive {
        quiet: Duration,
        min: Duration,
        max: Duration,
    },
}

impl LameDuck {
    /// The longest it can last.
    pub fn longest(&self) -> Duration {
        match *self {
            LameDuck::Fixed(period) => period,
            LameDuck::Adaptive { max, .. } => max,
        }
    }
}

impl fmt::Display for LameDuck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = humantime::format_duration;
        match *self {
            LameDuck::Fixed(period) => write!(f, "fixed {}", show(period)),
            LameDuck::Adaptive { quiet, min, max } => write!(
                f,
                "adaptive: until every source is quiet for its window (at least {}), {} to {}",
                show(quiet),
                show(min),
                show(max)
            ),
        }
    }
}

/// An address block: `10.0.0.0/8`, `fd00::/8`, or one address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// `None` when `text` is no address or block.
    pub fn parse(text: &str) -> Option<Cidr> {
        let (addr, prefix) = text.trim().split_once('/').unwrap_or((text.trim(), ""));
        let addr: IpAddr = addr.parse().ok()?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            "" => max,
            prefix => prefix.parse::<u8>().ok().filter(|p| *p <= max)?,
        };
        Some(Cidr { addr, prefix })
    }

    /// Whether `ip` (an IPv4-mapped IPv6 address as its IPv4 one) is in the block.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let bits = |ip: IpAddr| match ip.to_canonical() {
            IpAddr::V4(v4) => (u128::from(u32::from(v4)) << 96, true),
            IpAddr::V6(v6) => (u128::from(v6), false),
        };
        let ((mine, mine_v4), (theirs, theirs_v4)) = (bits(self.addr), bits(ip));
        let mask = match self.prefix {
            0 => 0,
            prefix => u128::MAX << (128 - u32::from(prefix)),
        };
        mine_v4 == theirs_v4 && (mine & mask) == (theirs & mask)
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Plain,
    Json,
}

/// The validated configuration of the proxy.
#[derive(Clone, Debug)]
pub struct Config {
    pub routes: Vec<Arc<Route>>,
    pub admin: SocketAddr,
    pub shutdown_grace_period: Duration,
    /// The last part of the grace period, in which open connections are ended one by one.
    pub close_spread_window: Duration,
    pub lame_duck: LameDuck,
    /// Peers whose new connections do not count as arrivals of an adaptive lame duck.
    pub lame_duck_ignore_sources: Vec<Cidr>,
    pub outbound_shutdown: OutboundShutdown,
    pub shutdown_endpoint: bool,
    /// The control socket of the inbound quiesce (docs/pod-lifecycle.md).
    pub drain_socket: Option<PathBuf>,
    /// The app's own probes, run by the admin server for the kubelet.
    pub app_probes: AppProbes,
    /// Where late connections go, by the pod port they addressed.
    pub handoffs: Handoffs,
    /// Where the exit's summary goes (the container's termination message), if anywhere.
    pub termination_log: Option<PathBuf>,
    /// Where the app probes go (the kubelet sent them to the pod's address).
    pub pod_ip: IpAddr,
    pub connect_timeout: Duration,
    pub http: HttpConfig,
    pub tcp: TcpConfig,
    pub log_filter: String,
    pub log_format: LogFormat,
}

/// Limits and timeouts of HTTP connections.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpConfig {
    pub detect_timeout: Duration,
    pub header_read_timeout: Duration,
    pub max_header_size: usize,
    pub h2_max_concurrent_streams: u32,
    /// `None`: no limit.
    pub response_timeout: Option<Duration>,
    /// An HTTP/2 connection without an open stream for this long gets GOAWAY; `None`: never.
    pub h2_idle_timeout: Option<Duration>,
    /// A streamed body that moves no byte for this long fails; `None`: never.
    pub body_timeout: Option<Duration>,
    /// Bodiless HTTP/1.1 requests go through the fast lane (docs/http.md); off, through hyper.
    pub fast_lane: bool,
    /// Outbound requests that got no answer are sent again within this budget; `None`: never.
    pub retry_budget: Option<RetryBudget>,
}

/// How many retries outbound requests may take (Linkerd's rule): `percent` of the requests of
/// the last [`RETRY_BUDGET_WINDOW`], plus `per_second`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryBudget {
    pub percent: u32,
    pub per_second: u32,
}

/// Linkerd's default budget: 20 % of recent requests plus 10 a second.
pub const DEFAULT_RETRY_BUDGET: RetryBudget = RetryBudget {
    percent: 20,
    per_second: 10,
};

/// The window the budget's share counts requests over.
pub const RETRY_BUDGET_WINDOW: Duration = Duration::from_secs(10);

impl std::fmt::Display for RetryBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}%+{}/s", self.percent, self.per_second)
    }
}

/// Bounds of opaque TCP streams and tunnels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpConfig {
    /// Half-closed by one side, nothing from the other for this long: both reset. `None`: no
    /// limit.
    pub half_close_timeout: Option<Duration>,
    /// No byte either way for this long: both reset. `None`: no limit (the default).
    pub idle_timeout: Option<Duration>,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            half_close_timeout: Some(DEFAULT_TCP_HALF_CLOSE_TIMEOUT),
            idle_timeout: None,
        }
    }
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            detect_timeout: DEFAULT_DETECT_TIMEOUT,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            max_header_size: DEFAULT_MAX_HEADER_SIZE,
            h2_max_concurrent_streams: DEFAULT_H2_MAX_CONCURRENT_STREAMS,
            fast_lane: true,
            retry_budget: Some(DEFAULT_RETRY_BUDGET),
            response_timeout: None,
            h2_idle_timeout: Some(DEFAULT_H2_IDLE_TIMEOUT),
            body_timeout: Some(DEFAULT_BODY_TIMEOUT),
        }
    }
}

/// A setting that could not be used: which one, the value as given, why, and a good example.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The flag (`--connect-timeout`) or variable (`LAMEDUCK_CONNECT_TIMEOUT`) it came from.
    pub setting: String,
    pub value: String,
    pub reason: String,
    pub example: &'static str,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid value {:?} for {}: {}; for example {}",
            self.value, self.setting, self.reason, self.example
        )
    }
}

impl std::error::Error for ConfigError {}

/// A flag and the variable that stands in for it.
pub(crate) struct Setting {
    pub(crate) flag: &'static str,
    pub(crate) var: &'static str,
    pub(crate) example: &'static str,
}

const INBOUND: Setting = Setting {
    flag: "--inbound",
    var: "LAMEDUCK_INBOUND",
    example: "0.0.0.0:4143=127.0.0.1:8080",
};
const OUTBOUND: Setting = Setting {
    flag: "--outbound",
    var: "LAMEDUCK_OUTBOUND",
    example: "127.0.0.1:4140=payments.default.svc:8443/tcp",
};
const ADMIN: Setting = Setting {
    flag: "--admin",
    var: "LAMEDUCK_ADMIN",
    example: "0.0.0.0:4191",
};
const GRACE: Setting = Setting {
    flag: "--shutdown-grace-period",
    var: "LAMEDUCK_SHUTDOWN_GRACE_PERIOD",
    example: "90s, 2m or 1m 30s",
};
const CLOSE_SPREAD_WINDOW: Setting = Setting {
    flag: "--close-spread-window",
    var: "LAMEDUCK_CLOSE_SPREAD_WINDOW",
    example: "10s, or 0s to reset at the deadline",
};
const LAME_DUCK: Setting = Setting {
    flag: "--lame-duck-period",
    var: "LAMEDUCK_LAME_DUCK_PERIOD",
    example: "0s, 5s or 1m",
};
const LAME_DUCK_MAX: Setting = Setting {
    flag: "--lame-duck-max",
    var: "LAMEDUCK_LAME_DUCK_MAX",
    example: "30s or 2m",
};
const LAME_DUCK_QUIET: Setting = Setting {
    flag: "--lame-duck-quiet-window",
    var: "LAMEDUCK_LAME_DUCK_QUIET_WINDOW",
    example: "1s or 500ms",
};
const LAME_DUCK_MIN: Setting = Setting {
    flag: "--lame-duck-min",
    var: "LAMEDUCK_LAME_DUCK_MIN",
    example: "2s or 0s",
};
const LAME_DUCK_IGNORE: Setting = Setting {
    flag: "--lame-duck-ignore-sources",
    var: "LAMEDUCK_LAME_DUCK_IGNORE_SOURCES",
    example: "10.0.0.7 or 10.0.0.7,fd00::7 or 10.0.0.0/24",
};
const OUTBOUND_SHUTDOWN: Setting = Setting {
    flag: "--outbound-shutdown",
    var: "LAMEDUCK_OUTBOUND_SHUTDOWN",
    example: "immediate or after-inbound",
};
const SHUTDOWN_ENDPOINT: Setting = Setting {
    flag: "--shutdown-endpoint",
    var: "LAMEDUCK_SHUTDOWN_ENDPOINT",
    example: "true or false",
};
const DRAIN_SOCKET: Setting = Setting {
    flag: "--drain-socket",
    var: "LAMEDUCK_DRAIN_SOCKET",
    example: "/lameduck/drain.sock",
};
const APP_PROBES: Setting = Setting {
    flag: "--app-probes",
    var: "LAMEDUCK_APP_PROBES",
    example: r#"{"/app-health/app/readyz": {"httpGet": {"path": "/healthz", "port": 8080}}}"#,
};
const HANDOFF: Setting = Setting {
    flag: "--handoff",
    var: "LAMEDUCK_HANDOFF",
    example: "8080=web.shop.svc.cluster.local:80",
};
const TERMINATION_LOG: Setting = Setting {
    flag: "--termination-log",
    var: "LAMEDUCK_TERMINATION_LOG",
    example: "/dev/termination-log",
};
const POD_IP: Setting = Setting {
    flag: "--pod-ip",
    var: "LAMEDUCK_POD_IP",
    example: "10.244.1.7 or fd00::7",
};
const CONNECT_TIMEOUT: Setting = Setting {
    flag: "--connect-timeout",
    var: "LAMEDUCK_CONNECT_TIMEOUT",
    example: "5s or 500ms",
};
const DETECT_TIMEOUT: Setting = Setting {
    flag: "--detect-timeout",
    var: "LAMEDUCK_DETECT_TIMEOUT",
    example: "1s or 500ms",
};
const HEADER_READ_TIMEOUT: Setting = Setting {
    flag: "--http-header-read-timeout",
    var: "LAMEDUCK_HTTP_HEADER_READ_TIMEOUT",
    example: "10s",
};
const MAX_HEADER_SIZE: Setting = Setting {
    flag: "--http-max-header-size",
    var: "LAMEDUCK_HTTP_MAX_HEADER_SIZE",
    example: "64KiB, 16384 or 1MiB",
};
const H2_MAX_CONCURRENT_STREAMS: Setting = Setting {
    flag: "--http2-max-concurrent-streams",
    var: "LAMEDUCK_HTTP2_MAX_CONCURRENT_STREAMS",
    example: "100",
};
const FAST_LANE: Setting = Setting {
    flag: "--http1-fast-lane",
    var: "LAMEDUCK_HTTP1_FAST_LANE",
    example: "true or false",
};
const RETRIES: Setting = Setting {
    flag: "--http-retries",
    var: "LAMEDUCK_HTTP_RETRIES",
    example: "true or false",
};
const RETRY_BUDGET: Setting = Setting {
    flag: "--http-retry-budget",
    var: "LAMEDUCK_HTTP_RETRY_BUDGET",
    example: "20%+10/s",
};
const RESPONSE_TIMEOUT: Setting = Setting {
    flag: "--http-response-timeout",
    var: "LAMEDUCK_HTTP_RESPONSE_TIMEOUT",
    example: "30s, or 0s for no limit",
};
const BODY_TIMEOUT: Setting = Setting {
    flag: "--http-body-timeout",
    var: "LAMEDUCK_HTTP_BODY_TIMEOUT",
    example: "5m, or 0s for no limit",
};
const H2_IDLE_TIMEOUT: Setting = Setting {
    flag: "--http2-idle-timeout",
    var: "LAMEDUCK_HTTP2_IDLE_TIMEOUT",
    example: "60s, or 0s for no limit",
};
const TCP_HALF_CLOSE_TIMEOUT: Setting = Setting {
    flag: "--tcp-half-close-timeout",
    var: "LAMEDUCK_TCP_HALF_CLOSE_TIMEOUT",
    example: "60s, or 0s for no limit",
};
const TCP_IDLE_TIMEOUT: Setting = Setting {
    flag: "--tcp-idle-timeout",
    var: "LAMEDUCK_TCP_IDLE_TIMEOUT",
    example: "1h, or 0s for no limit",
};
const LOG: Setting = Setting {
    flag: "--log",
    var: "LAMEDUCK_LOG",
    example: "info or lameduck=debug,warn",
};
const LOG_FORMAT: Setting = Setting {
    flag: "--log-format",
    var: "LAMEDUCK_LOG_FORMAT",
    example: "plain or json",
};

/// A raw value and the name of the flag or variable it came from.
pub(crate) struct Raw {
    pub(crate) value: String,
    source: String,
}

impl Raw {
    pub(crate) fn new(value: impl Into<String>, source: impl Into<String>) -> Raw {
        Raw {
            value: value.into(),
            source: source.into(),
        }
    }

    pub(crate) fn error(&self, reason: impl Into<String>, example: &'static str) -> ConfigError {
        ConfigError {
            setting: self.source.clone(),
            value: self.value.clone(),
            reason: reason.into(),
            example,
        }
    }
}

/// Reads the process environment; what `main` passes to [`Config::from_sources`].
pub fn process_env(name: &str) -> Option<OsString> {
    std::env::var_os(name)
}

impl Config {
    /// Builds the configuration from parsed flags and an environment lookup.
    pub fn from_sources(
        args: ProxyArgs,
        env: impl Fn(&str) -> Option<OsString>,
    ) -> Result<Config, ConfigError> {
        let lookup =
            |setting: &Setting, flag_value: Option<String>| resolve(setting, flag_value, &env);

        let mut routes = Vec::new();
        for (setting, direction, flags) in [
            (&INBOUND, Direction::Inbound, args.inbound),
            (&OUTBOUND, Direction::Outbound, args.outbound),
        ] {
            let raws: Vec<Raw> = if flags.is_empty() {
                match env_value(&env, setting.var, setting.example)? {
                    Some(raw) => split_list(raw),
                    None => Vec::new(),
                }
            } else {
                flags
                    .into_iter()
                    .flat_map(|value| {
                        split_list(Raw {
                            value,
                            source: setting.flag.to_string(),
                        })
                    })
                    .collect()
            };
            for raw in raws {
                routes.push(Arc::new(parse_route(&raw, direction, setting.example)?));
            }
        }
        if routes.is_empty() {
            let raw = Raw {
                value: DEFAULT_INBOUND_ROUTE.to_string(),
                source: "the default route".into(),
            };
            routes.push(Arc::new(parse_route(
                &raw,
                Direction::Inbound,
                INBOUND.example,
            )?));
        }
        check_distinct_listeners(&routes)?;

        let admin = match lookup(&ADMIN, args.admin)? {
            Some(raw) => parse_socket_addr(&raw, ADMIN.example)?,
            None => DEFAULT_ADMIN_ADDR
                .parse()
                .expect("the default admin address is valid"),
        };
        let grace_raw = lookup(&GRACE, args.shutdown_grace_period)?;
        let shutdown_grace_period = match &grace_raw {
            Some(raw) => parse_duration(raw, GRACE.example)?,
            None => DEFAULT_SHUTDOWN_GRACE_PERIOD,
        };
        let within_grace = |raw: &Raw, duration: Duration, example: &'static str| {
            if duration > shutdown_grace_period {
                return Err(raw.error(
                    format!(
                        "the lame duck must not be longer than the shutdown grace period ({})",
                        humantime::format_duration(shutdown_grace_period)
                    ),
                    example,
                ));
            }
            Ok(duration)
        };
        let close_spread_window = match lookup(&CLOSE_SPREAD_WINDOW, args.close_spread_window)? {
            Some(raw) => {
                let window = parse_duration(&raw, CLOSE_SPREAD_WINDOW.example)?;
                if window > shutdown_grace_period {
                    return Err(raw.error(
                        format!(
                            "the close-spread window is the end of the shutdown grace period ({}) and must not be longer",
                            humantime::format_duration(shutdown_grace_period)
                        ),
                        CLOSE_SPREAD_WINDOW.example,
                    ));
                }
                window
            }
            // Half the grace period at most: the connections get the first half to end by
            // themselves.
            None => DEFAULT_CLOSE_SPREAD_WINDOW.min(shutdown_grace_period / 2),
        };
        let period = lookup(&LAME_DUCK, args.lame_duck_period)?;
        let max = lookup(&LAME_DUCK_MAX, args.lame_duck_max)?;
        let quiet = lookup(&LAME_DUCK_QUIET, args.lame_duck_quiet_window)?;
        let min = lookup(&LAME_DUCK_MIN, args.lame_duck_min)?;
        let lame_duck = match (period, max) {
            (Some(_), Some(max)) => {
                return Err(max.error(
                    format!(
                        "a lame duck is either fixed ({}) or adaptive ({}), not both",
                        LAME_DUCK.flag, LAME_DUCK_MAX.flag
                    ),
                    LAME_DUCK_MAX.example,
                ));
            }
            (period, None) => {
                if let Some(raw) = quiet.as_ref().or(min.as_ref()) {
                    return Err(raw.error(
                        format!("only for an adaptive lame duck ({})", LAME_DUCK_MAX.flag),
                        LAME_DUCK_MAX.example,
                    ));
                }
                match period {
                    Some(raw) => LameDuck::Fixed(within_grace(
                        &raw,
                        parse_duration(&raw, LAME_DUCK.example)?,
                        LAME_DUCK.example,
                    )?),
                    None => LameDuck::Fixed(DEFAULT_LAME_DUCK_PERIOD),
                }
            }
            (None, Some(raw_max)) => {
                let max = parse_duration(&raw_max, LAME_DUCK_MAX.example)?;
                let max = within_grace(&raw_max, max, LAME_DUCK_MAX.example)?;
                if max.is_zero() {
                    return Err(raw_max.error("must be longer than zero", LAME_DUCK_MAX.example));
                }
                let quiet = match quiet {
                    Some(raw) => {
                        let quiet = parse_duration(&raw, LAME_DUCK_QUIET.example)?;
                        if quiet.is_zero() {
                            return Err(
                                raw.error("must be longer than zero", LAME_DUCK_QUIET.example)
                            );
                        }
                        quiet
                    }
                    None => DEFAULT_LAME_DUCK_QUIET_WINDOW,
                };
                let min = match min {
                    Some(raw) => {
                        let min = parse_duration(&raw, LAME_DUCK_MIN.example)?;
                        if min > max {
                            return Err(raw.error(
                                format!(
                                    "longer than the lame duck's maximum ({})",
                                    humantime::format_duration(max)
                                ),
                                LAME_DUCK_MIN.example,
                            ));
                        }
                        min
                    }
                    None => DEFAULT_LAME_DUCK_MIN.min(max),
                };
                LameDuck::Adaptive { quiet, min, max }
            }
        };
        let lame_duck_ignore_sources =
            match lookup(&LAME_DUCK_IGNORE, args.lame_duck_ignore_sources)? {
                None => Vec::new(),
                Some(raw) => {
                    let blocks: Option<Vec<Cidr>> = raw
                        .value
                        .split(',')
                        .map(str::trim)
                        .filter(|item| !item.is_empty())
                        .map(Cidr::parse)
                        .collect();
                    blocks.ok_or_else(|| {
                        raw.error("expected addresses or CIDRs", LAME_DUCK_IGNORE.example)
                    })?
                }
            };
        let outbound_shutdown = match lookup(&OUTBOUND_SHUTDOWN, args.outbound_shutdown)? {
            Some(raw) => match raw.value.as_str() {
                "immediate" => OutboundShutdown::Immediate,
                "after-inbound" => OutboundShutdown::AfterInbound,
                _ => {
                    return Err(raw.error(
                        "expected immediate or after-inbound",
                        OUTBOUND_SHUTDOWN.example,
                    ));
                }
            },
            None => OutboundShutdown::Immediate,
        };
        let shutdown_endpoint = match lookup(&SHUTDOWN_ENDPOINT, args.shutdown_endpoint)? {
            Some(raw) => parse_bool(&raw, SHUTDOWN_ENDPOINT.example)?,
            None => false,
        };
        let drain_socket = match lookup(&DRAIN_SOCKET, args.drain_socket)? {
            Some(raw) => Some(parse_socket_path(&raw, DRAIN_SOCKET.example)?),
            None => None,
        };
        let app_probes = match lookup(&APP_PROBES, args.app_probes)? {
            Some(raw) => AppProbes::parse(&raw.value)
                .map_err(|reason| raw.error(reason, APP_PROBES.example))?,
            None => AppProbes::default(),
        };
        let handoffs = match lookup(&HANDOFF, args.handoff)? {
            Some(raw) => {
                Handoffs::parse(&raw.value).map_err(|reason| raw.error(reason, HANDOFF.example))?
            }
            None => Handoffs::default(),
        };
        let termination_log = match lookup(&TERMINATION_LOG, args.termination_log)? {
            Some(raw) if raw.value.trim().is_empty() => {
                return Err(raw.error("expected a file path", TERMINATION_LOG.example));
            }
            Some(raw) => Some(PathBuf::from(raw.value.trim())),
            None => None,
        };
        let pod_ip = match lookup(&POD_IP, args.pod_ip)? {
            Some(raw) => raw
                .value
                .trim()
                .parse::<IpAddr>()
                .map_err(|_| raw.error("expected an IPv4 or IPv6 address", POD_IP.example))?,
            None => IpAddr::from([127, 0, 0, 1]),
        };
        let positive = |setting: &Setting, flag: Option<String>, default: Duration| match lookup(
            setting, flag,
        )? {
            Some(raw) => {
                let duration = parse_duration(&raw, setting.example)?;
                if duration.is_zero() {
                    return Err(raw.error("must be longer than zero", setting.example));
                }
                Ok(duration)
            }
            None => Ok(default),
        };
        let connect_timeout = positive(
            &CONNECT_TIMEOUT,
            args.connect_timeout,
            DEFAULT_CONNECT_TIMEOUT,
        )?;
        let mut http = HttpConfig {
            detect_timeout: positive(&DETECT_TIMEOUT, args.detect_timeout, DEFAULT_DETECT_TIMEOUT)?,
            header_read_timeout: positive(
                &HEADER_READ_TIMEOUT,
                args.http_header_read_timeout,
                DEFAULT_HEADER_READ_TIMEOUT,
            )?,
            ..HttpConfig::default()
        };
        if let Some(raw) = lookup(&FAST_LANE, args.http1_fast_lane)? {
            http.fast_lane = parse_bool(&raw, FAST_LANE.example)?;
        }
        if let Some(raw) = lookup(&RETRY_BUDGET, args.http_retry_budget)? {
            http.retry_budget = Some(parse_retry_budget(&raw)?);
        }
        if let Some(raw) = lookup(&RETRIES, args.http_retries)?
            && !parse_bool(&raw, RETRIES.example)?
        {
            http.retry_budget = None;
        }
        if let Some(raw) = lookup(&MAX_HEADER_SIZE, args.http_max_header_size)? {
            http.max_header_size = parse_size(&raw, MAX_HEADER_SIZE.example)?;
        }
        if let Some(raw) = lookup(
            &H2_MAX_CONCURRENT_STREAMS,
            args.http2_max_concurrent_streams,
        )? {
            http.h2_max_concurrent_streams = match raw.value.trim().parse::<u32>() {
                Ok(n) if (1..=10_000).contains(&n) => n,
                _ => {
                    return Err(raw.error(
                        "expected a whole number from 1 to 10000",
                        H2_MAX_CONCURRENT_STREAMS.example,
                    ));
                }
            };
        }
        // A limit that 0s turns off.
        let optional =
            |setting: &Setting, flag: Option<String>, default: Option<Duration>| match lookup(
                setting, flag,
            )? {
                Some(raw) => {
                    let timeout = parse_duration(&raw, setting.example)?;
                    Ok::<_, ConfigError>((!timeout.is_zero()).then_some(timeout))
                }
                None => Ok(default),
            };
        http.response_timeout = optional(&RESPONSE_TIMEOUT, args.http_response_timeout, None)?;
        http.body_timeout = optional(
            &BODY_TIMEOUT,
            args.http_body_timeout,
            Some(DEFAULT_BODY_TIMEOUT),
        )?;
        http.h2_idle_timeout = optional(
            &H2_IDLE_TIMEOUT,
            args.http2_idle_timeout,
            Some(DEFAULT_H2_IDLE_TIMEOUT),
        )?;
        let tcp = TcpConfig {
            half_close_timeout: optional(
                &TCP_HALF_CLOSE_TIMEOUT,
                args.tcp_half_close_timeout,
                Some(DEFAULT_TCP_HALF_CLOSE_TIMEOUT),
            )?,
            idle_timeout: optional(&TCP_IDLE_TIMEOUT, args.tcp_idle_timeout, None)?,
        };
        let log_filter = match lookup(&LOG, args.log)? {
            Some(raw) => Some(raw),
            None => env_value(&env, "RUST_LOG", LOG.example)?,
        };
        let log_filter = match log_filter {
            Some(raw) => {
                if let Err(error) = tracing_subscriber::EnvFilter::builder().parse(&raw.value) {
                    return Err(raw.error(error.to_string(), LOG.example));
                }
                raw.value
            }
            None => DEFAULT_LOG_FILTER.to_string(),
        };
        let log_format = match lookup(&LOG_FORMAT, args.log_format)? {
            Some(raw) => match raw.value.as_str() {
                "plain" => LogFormat::Plain,
                "json" => LogFormat::Json,
                _ => return Err(raw.error("expected plain or json", LOG_FORMAT.example)),
            },
            None => LogFormat::Plain,
        };

        Ok(Config {
            routes,
            admin,
            shutdown_grace_period,
            close_spread_window,
            lame_duck,
            lame_duck_ignore_sources,
            outbound_shutdown,
            shutdown_endpoint,
            drain_socket,
            app_probes,
            handoffs,
            termination_log,
            pod_ip,
            connect_timeout,
            http,
            tcp,
            log_filter,
            log_format,
        })
    }
}

/// The raw value of a setting: the flag's if given, else its variable's.
pub(crate) fn resolve(
    setting: &Setting,
    flag_value: Option<String>,
    env: &impl Fn(&str) -> Option<OsString>,
) -> Result<Option<Raw>, ConfigError> {
    if let Some(value) = flag_value {
        return Ok(Some(Raw {
            value,
            source: setting.flag.to_string(),
        }));
    }
    env_value(env, setting.var, setting.example)
}

/// Reads one variable; a value that is not UTF-8 is an error naming the variable.
pub(crate) fn env_value(
    env: &impl Fn(&str) -> Option<OsString>,
    var: &str,
    example: &'static str,
) -> Result<Option<Raw>, ConfigError> {
    match env(var) {
        None => Ok(None),
        Some(os) => match os.into_string() {
            Ok(value) => Ok(Some(Raw {
                value,
                source: var.to_string(),
            })),
            Err(os) => Err(ConfigError {
                setting: var.to_string(),
                value: os.to_string_lossy().into_owned(),
                reason: "the value is not valid UTF-8".into(),
                example,
            }),
        },
    }
}

/// Splits a comma-separated list; empty items (`a,,b`, a trailing comma, an empty variable)
/// are skipped.
fn split_list(raw: Raw) -> Vec<Raw> {
    raw.value
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| Raw {
            value: item.to_string(),
            source: raw.source.clone(),
        })
        .collect()
}

fn parse_route(
    raw: &Raw,
    direction: Direction,
    example: &'static str,
) -> Result<Route, ConfigError> {
    let Some((listen, rest)) = raw.value.split_once('=') else {
        return Err(raw.error("a route is LISTEN=TARGET[/PROTOCOL]", example));
    };
    let (target, protocol) = match rest.rsplit_once('/') {
        Some((target, protocol)) => (target, Some(protocol)),
        None => (rest, None),
    };
    let protocol = match protocol {
        None | Some("auto") => Protocol::Auto,
        Some("tcp") => Protocol::Tcp,
        Some("http") => Protocol::Http,
        Some(other) => {
            return Err(raw.error(
                format!("unknown protocol {other:?}, expected auto, http or tcp"),
                example,
            ));
        }
    };
    let listen: SocketAddr = listen.trim().parse().map_err(|_| {
        raw.error(
            format!("the listen address {listen:?} is not IP:PORT"),
            example,
        )
    })?;
    let target = parse_target(target.trim())
        .map_err(|reason| raw.error(format!("the target {target:?} {reason}"), example))?;
    Ok(Route {
        direction,
        listen,
        target,
        protocol,
    })
}

/// The target of a route that forwards each connection where it was going before the NAT
/// rules redirected it.
pub const ORIG_DST: &str = "orig-dst";

fn parse_target(target: &str) -> Result<Target, &'static str> {
    if target == ORIG_DST {
        return Ok(Target::OrigDst);
    }
    if let Ok(addr) = target.parse::<SocketAddr>() {
        if addr.port() == 0 {
            return Err("needs a port other than 0");
        }
        return Ok(Target::Addr(addr));
    }
    let Some((host, port)) = target.rsplit_once(':') else {
        return Err("is not IP:PORT, HOST:PORT or orig-dst");
    };
    let port: u16 = match port.parse() {
        Ok(port) if port != 0 => port,
        _ => return Err("needs a port from 1 to 65535"),
    };
    let valid_host = !host.is_empty()
        && host.len() <= 253
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'));
    if !valid_host {
        return Err("is not IP:PORT, HOST:PORT or orig-dst");
    }
    Ok(Target::Host {
        host: host.to_string(),
        port,
    })
}

fn parse_socket_addr(raw: &Raw, example: &'static str) -> Result<SocketAddr, ConfigError> {
    raw.value
        .trim()
        .parse()
        .map_err(|_| raw.error("expected IP:PORT", example))
}

/// Parses a humantime duration (`90s`, `2m`, `1m 30s`, `1.5s`); a bare `0` means zero.
pub(crate) fn parse_duration(raw: &Raw, example: &'static str) -> Result<Duration, ConfigError> {
    let value = raw.value.trim();
    if value == "0" {
        return Ok(Duration::ZERO);
    }
    if value.is_empty() {
        return Err(raw.error("a duration is needed", example));
    }
    if value.starts_with('-') {
        return Err(raw.error("a duration cannot be negative", example));
    }
    if value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(raw.error("a duration needs a unit", example));
    }
    let duration =
        humantime::parse_duration(value).map_err(|error| raw.error(error.to_string(), example))?;
    if duration > MAX_DURATION {
        return Err(raw.error(
            format!(
                "longer than the maximum of {}",
                humantime::format_duration(MAX_DURATION)
            ),
            example,
        ));
    }
    Ok(duration)
}

/// A size in bytes: `16384`, `64KiB`, `1MiB`, within the header-size bounds.
fn parse_size(raw: &Raw, example: &'static str) -> Result<usize, ConfigError> {
    let value = raw.value.trim();
    let (number, unit) = match value.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => value.split_at(at),
        None => (value, ""),
    };
    let multiplier = match unit.trim() {
        "" | "B" => 1,
        "KiB" | "K" | "k" | "KB" => 1024,
        "MiB" | "M" | "MB" => 1024 * 1024,
        _ => return Err(raw.error("expected bytes, KiB or MiB", example)),
    };
    let size = number
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(multiplier))
        .ok_or_else(|| raw.error("expected a whole number of bytes, KiB or MiB", example))?;
    if !(MIN_MAX_HEADER_SIZE..=MAX_MAX_HEADER_SIZE).contains(&size) {
        return Err(raw.error("must be from 8KiB to 1MiB", example));
    }
    Ok(size)
}

/// A Unix socket path: not empty, no NUL, short enough for `sun_path` (107 bytes and the NUL).
pub(crate) fn parse_socket_path(raw: &Raw, example: &'static str) -> Result<PathBuf, ConfigError> {
    let value = raw.value.as_str();
    if value.is_empty() || value.ends_with('/') {
        return Err(raw.error("expected the path of a socket file", example));
    }
    if value.contains('\0') {
        return Err(raw.error("a path cannot hold a NUL byte", example));
    }
    if value.len() > 107 {
        return Err(raw.error(
            "longer than the 107 bytes a Unix socket path may have",
            example,
        ));
    }
    Ok(PathBuf::from(value))
}

/// `PERCENT%+N/s`: a share of recent requests (0 to 100 %) and a floor per second.
fn parse_retry_budget(raw: &Raw) -> Result<RetryBudget, ConfigError> {
    let bad = || raw.error("expected PERCENT%+N/s", RETRY_BUDGET.example);
    let value = raw.value.trim();
    let (percent, per_second) = value.split_once("%+").ok_or_else(bad)?;
    let per_second = per_second.strip_suffix("/s").ok_or_else(bad)?;
    let percent: u32 = percent.trim().parse().map_err(|_| bad())?;
    let per_second: u32 = per_second.trim().parse().map_err(|_| bad())?;
    if percent > 100 || per_second > 1_000_000 {
        return Err(raw.error(
            "the share must be 0 to 100 % and the floor at most 1000000/s",
            RETRY_BUDGET.example,
        ));
    }
    Ok(RetryBudget {
        percent,
        per_second,
    })
}

pub(crate) fn parse_bool(raw: &Raw, example: &'static str) -> Result<bool, ConfigError> {
    match raw.value.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" | "enabled" => Ok(true),
        "false" | "0" | "no" | "off" | "disabled" => Ok(false),
        _ => Err(raw.error("expected true or false", example)),
    }
}

/// Two routes on one listen address would fail to bind; say so as a configuration error.
fn check_distinct_listeners(routes: &[Arc<Route>]) -> Result<(), ConfigError> {
    for (i, route) in routes.iter().enumerate() {
        if route.listen.port() == 0 {
            continue;
        }
        if let Some(other) = routes[..i]
            .iter()
            .find(|other| other.listen == route.listen)
        {
            return Err(ConfigError {
                setting: format!("--{}", route.direction),
                value: format!("{}={}", route.listen, route.target),
                reason: format!(
                    "{} is already the listen address of the {} route to {}",
                    route.listen, other.direction, other.target
                ),
                example: "a distinct LISTEN address for every route",
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config(args: ProxyArgs, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let env: HashMap<String, OsString> = env
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        Config::from_sources(args, |name| env.get(name).cloned())
    }

    fn grace(value: &str) -> Result<Duration, ConfigError> {
        config(
            ProxyArgs {
                shutdown_grace_period: Some(value.into()),
                ..Default::default()
            },
            &[],
        )
        .map(|c| c.shutdown_grace_period)
    }

    #[test]
    fn defaults_run_one_inbound_route() {
        let config = config(ProxyArgs::default(), &[]).unwrap();
        assert_eq!(config.routes.len(), 1);
        let route = &config.routes[0];
        assert_eq!(route.direction, Direction::Inbound);
        assert_eq!(route.listen, "0.0.0.0:4143".parse().unwrap());
        assert_eq!(
            route.target,
            Target::Addr("127.0.0.1:8080".parse().unwrap())
        );
        assert_eq!(route.protocol, Protocol::Auto);
        assert_eq!(config.admin, "0.0.0.0:4191".parse().unwrap());
        assert_eq!(config.shutdown_grace_period, Duration::from_secs(120));
        assert_eq!(config.lame_duck, LameDuck::Fixed(Duration::ZERO));
        assert_eq!(config.outbound_shutdown, OutboundShutdown::Immediate);
        assert!(!config.shutdown_endpoint);
        assert_eq!(config.connect_timeout, Duration::from_secs(5));
        assert_eq!(config.log_filter, "info");
        assert_eq!(config.log_format, LogFormat::Plain);
    }

    #[test]
    fn routes_parse_every_documented_form() {
        let config = config(
            ProxyArgs {
                inbound: vec!["[::]:4143=[::1]:8080/tcp".into()],
                outbound: vec!["127.0.0.1:4140=payments.default.svc:8443/tcp".into()],
                ..Default::default()
            },
            &[],
        )
        .unwrap();
        assert_eq!(
            config.routes.len(),
            2,
            "an outbound route replaces no inbound one"
        );
        assert_eq!(
            config.routes[0].target,
            Target::Addr("[::1]:8080".parse().unwrap())
        );
        assert_eq!(
            config.routes[1].target,
            Target::Host {
                host: "payments.default.svc".into(),
                port: 8443
            }
        );
        assert_eq!(config.routes[1].direction, Direction::Outbound);
        assert_eq!(config.routes[1].protocol, Protocol::Tcp);
    }

    #[test]
    fn orig_dst_routes_and_both_families_on_one_port() {
        let parsed = config(
            ProxyArgs {
                inbound: vec![
                    "0.0.0.0:4143=orig-dst".into(),
                    "[::]:4143=orig-dst/http".into(),
                ],
                outbound: vec!["127.0.0.1:4140=orig-dst/tcp".into()],
                ..Default::default()
            },
            &[],
        )
        .unwrap();
        assert!(
            parsed
                .routes
                .iter()
                .all(|route| route.target == Target::OrigDst)
        );
        assert_eq!(parsed.routes[1].protocol, Protocol::Http);
        assert_eq!(parsed.routes[0].target.to_string(), "orig-dst");
        let error = config(
            ProxyArgs::default(),
            &[("LAMEDUCK_INBOUND", "0.0.0.0:4143=orig_dst")],
        )
        .unwrap_err();
        assert!(error.to_string().contains("orig-dst"), "{error}");
    }

    #[test]
    fn only_an_outbound_route_means_no_default_inbound() {
        let config = config(
            ProxyArgs::default(),
            &[("LAMEDUCK_OUTBOUND", "127.0.0.1:4140=10.0.0.1:80")],
        )
        .unwrap();
        assert_eq!(config.routes.len(), 1);
        assert_eq!(config.routes[0].direction, Direction::Outbound);
    }

    #[test]
    fn variables_are_comma_separated_and_flags_win() {
        let env = [
            (
                "LAMEDUCK_INBOUND",
                "127.0.0.1:1=127.0.0.1:2, 127.0.0.1:3=127.0.0.1:4,",
            ),
            ("LAMEDUCK_SHUTDOWN_GRACE_PERIOD", "1m 30s"),
        ];
        let from_env = config(ProxyArgs::default(), &env).unwrap();
        assert_eq!(from_env.routes.len(), 2);
        assert_eq!(from_env.shutdown_grace_period, Duration::from_secs(90));
        let flagged = config(
            ProxyArgs {
                shutdown_grace_period: Some("7s".into()),
                ..Default::default()
            },
            &env,
        )
        .unwrap();
        assert_eq!(flagged.shutdown_grace_period, Duration::from_secs(7));
    }

    #[test]
    fn idle_bounds_default_turn_off_with_zero_and_name_their_setting() {
        let defaults = config(ProxyArgs::default(), &[]).unwrap();
        assert_eq!(defaults.http.h2_idle_timeout, Some(DEFAULT_H2_IDLE_TIMEOUT));
        assert_eq!(
            defaults.tcp.half_close_timeout,
            Some(DEFAULT_TCP_HALF_CLOSE_TIMEOUT)
        );
        assert_eq!(defaults.tcp.idle_timeout, None, "databases idle for long");
        assert_eq!(defaults.http.body_timeout, Some(DEFAULT_BODY_TIMEOUT));
        let set = config(
            ProxyArgs {
                http2_idle_timeout: Some("0s".into()),
                http_body_timeout: Some("0s".into()),
                tcp_idle_timeout: Some("1h".into()),
                ..Default::default()
            },
            &[("LAMEDUCK_TCP_HALF_CLOSE_TIMEOUT", "0s")],
        )
        .unwrap();
        assert_eq!(set.http.h2_idle_timeout, None);
        assert_eq!(set.http.body_timeout, None);
        assert_eq!(set.tcp.half_close_timeout, None);
        assert_eq!(set.tcp.idle_timeout, Some(Duration::from_secs(3600)));
        let error = config(
            ProxyArgs::default(),
            &[("LAMEDUCK_TCP_IDLE_TIMEOUT", "soon")],
        )
        .unwrap_err();
        assert_eq!(error.setting, "LAMEDUCK_TCP_IDLE_TIMEOUT");
        let error = config(
            ProxyArgs {
                http2_idle_timeout: Some("10".into()),
                ..Default::default()
            },
            &[],
        )
        .unwrap_err();
        assert_eq!(error.setting, "--http2-idle-timeout");
    }

    #[test]
    fn http_settings_parse_and_check_their_bounds() {
        let config = config(
            ProxyArgs {
                inbound: vec!["127.0.0.1:1=127.0.0.1:2/http".into()],
                http_max_header_size: Some("16KiB".into()),
                http_response_timeout: Some("30s".into()),
                ..Default::default()
            },
            &[("LAMEDUCK_HTTP2_MAX_CONCURRENT_STREAMS", "50")],
        )
        .unwrap();
        assert_eq!(config.routes[0].protocol, Protocol::Http);
        assert_eq!(config.http.max_header_size, 16 * 1024);
        assert_eq!(config.http.h2_max_concurrent_streams, 50);
        assert_eq!(config.http.response_timeout, Some(Duration::from_secs(30)));
        assert_eq!(config.http.detect_timeout, DEFAULT_DETECT_TIMEOUT);
        for (size, ok) in [
            ("8192", true),
            ("1MiB", true),
            ("4KiB", false),
            ("2MiB", false),
            ("lots", false),
        ] {
            let result = super::tests::config(
                ProxyArgs {
                    http_max_header_size: Some(size.into()),
                    ..Default::default()
                },
                &[],
            );
            assert_eq!(result.is_ok(), ok, "{size}");
        }
        let error = super::tests::config(
            ProxyArgs {
                http_header_read_timeout: Some("0s".into()),
                ..Default::default()
            },
            &[],
        )
        .unwrap_err();
        assert_eq!(error.setting, "--http-header-read-timeout");
    }

    #[test]
    fn durations_follow_humantime_and_reject_nonsense() {
        assert_eq!(grace("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(grace("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(grace("0s").unwrap(), Duration::ZERO);
        assert_eq!(grace("0").unwrap(), Duration::ZERO);
        for bad in [
            "",
            "-1s",
            "10",
            "1e3s",
            "18446744073709551615d",
            "2d",
            "soon",
        ] {
            let error = grace(bad).unwrap_err();
            assert_eq!(error.setting, "--shutdown-grace-period", "{bad:?}");
            assert_eq!(error.value, bad);
            assert!(
                error.to_string().contains("90s"),
                "the message shows a good example: {error}"
            );
        }
    }

    #[test]
    fn the_close_spread_window_is_the_end_of_the_grace_period() {
        let window = |grace: &str, window: Option<&str>, env: &[(&str, &str)]| {
            config(
                ProxyArgs {
                    shutdown_grace_period: Some(grace.into()),
                    close_spread_window: window.map(Into::into),
                    ..Default::default()
                },
                env,
            )
            .map(|c| c.close_spread_window)
        };
        // 10 s by default, and never more than half the grace period.
        assert_eq!(window("120s", None, &[]), Ok(Duration::from_secs(10)));
        assert_eq!(window("6s", None, &[]), Ok(Duration::from_secs(3)));
        assert_eq!(window("0s", None, &[]), Ok(Duration::ZERO));
        // Asked for: up to the whole grace period; 0s turns it off.
        assert_eq!(window("30s", Some("30s"), &[]), Ok(Duration::from_secs(30)));
        assert_eq!(window("30s", Some("0s"), &[]), Ok(Duration::ZERO));
        assert_eq!(
            window("30s", None, &[("LAMEDUCK_CLOSE_SPREAD_WINDOW", "20s")]),
            Ok(Duration::from_secs(20))
        );
        let error = window("30s", Some("31s"), &[]).unwrap_err();
        assert_eq!(error.setting, "--close-spread-window");
        assert!(error.reason.contains("grace period (30s)"), "{error}");
        let error = window("30s", None, &[("LAMEDUCK_CLOSE_SPREAD_WINDOW", "soon")]).unwrap_err();
        assert_eq!(error.setting, "LAMEDUCK_CLOSE_SPREAD_WINDOW");
        assert!(error.to_string().contains("10s"), "{error}");
    }

    #[test]
    fn lame_duck_longer_than_grace_is_refused() {
        let error = config(
            ProxyArgs {
                shutdown_grace_period: Some("5s".into()),
                lame_duck_period: Some("6s".into()),
                ..Default::default()
            },
            &[],
        )
        .unwrap_err();
        assert_eq!(error.setting, "--lame-duck-period");
    }

    #[test]
    fn an_adaptive_lame_duck_takes_its_bounds_and_refuses_mixed_or_impossible_ones() {
        let adaptive = config(
            ProxyArgs {
                lame_duck_max: Some("20s".into()),
                ..Default::default()
            },
            &[("LAMEDUCK_LAME_DUCK_IGNORE_SOURCES", "10.1.2.3, fd00::/8")],
        )
        .unwrap();
        assert_eq!(
            adaptive.lame_duck,
            LameDuck::Adaptive {
                quiet: DEFAULT_LAME_DUCK_QUIET_WINDOW,
                min: DEFAULT_LAME_DUCK_MIN,
                max: Duration::from_secs(20)
            }
        );
        let ignored = &adaptive.lame_duck_ignore_sources;
        assert!(ignored[0].contains("10.1.2.3".parse().unwrap()));
        assert!(ignored[0].contains("::ffff:10.1.2.3".parse().unwrap()));
        assert!(!ignored[0].contains("10.1.2.4".parse().unwrap()));
        assert!(ignored[1].contains("fd00::7".parse().unwrap()));
        assert!(!ignored[1].contains("10.1.2.3".parse().unwrap()));
        let short = config(
            ProxyArgs {
                lame_duck_max: Some("1s".into()),
                lame_duck_quiet_window: Some("300ms".into()),
                ..Default::default()
            },
            &[],
        )
        .unwrap();
        assert_eq!(
            short.lame_duck,
            LameDuck::Adaptive {
                quiet: Duration::from_millis(300),
                min: Duration::from_secs(1),
                max: Duration::from_secs(1)
            },
            "the default minimum is cut to the maximum"
        );
        for (args, env, setting) in [
            (
                ProxyArgs {
                    lame_duck_period: Some("5s".into()),
                    lame_duck_max: Some("10s".into()),
                    ..Default::default()
                },
                vec![],
                "--lame-duck-max",
            ),
            (
                ProxyArgs::default(),
                vec![("LAMEDUCK_LAME_DUCK_QUIET_WINDOW", "1s")],
                "LAMEDUCK_LAME_DUCK_QUIET_WINDOW",
            ),
            (
                ProxyArgs {
                    lame_duck_max: Some("10s".into()),
                    lame_duck_min: Some("11s".into()),
                    ..Default::default()
                },
                vec![],
                "--lame-duck-min",
            ),
            (
                ProxyArgs {
                    shutdown_grace_period: Some("5s".into()),
                    lame_duck_max: Some("6s".into()),
                    ..Default::default()
                },
                vec![],
                "--lame-duck-max",
            ),
            (
                ProxyArgs {
                    lame_duck_max: Some("10s".into()),
                    lame_duck_ignore_sources: Some("node".into()),
                    ..Default::default()
                },
                vec![],
                "--lame-duck-ignore-sources",
            ),
        ] {
            let error = config(args, &env).unwrap_err();
            assert_eq!(error.setting, setting, "{error}");
        }
    }

    #[test]
    fn errors_name_the_variable_when_the_value_came_from_it() {
        let error =
            config(ProxyArgs::default(), &[("LAMEDUCK_CONNECT_TIMEOUT", "0s")]).unwrap_err();
        assert_eq!(error.setting, "LAMEDUCK_CONNECT_TIMEOUT");
        let error = config(
            ProxyArgs::default(),
            &[("LAMEDUCK_SHUTDOWN_ENDPOINT", "maybe")],
        )
        .unwrap_err();
        assert_eq!(error.setting, "LAMEDUCK_SHUTDOWN_ENDPOINT");
        let error = config(ProxyArgs::default(), &[("RUST_LOG", "lameduck=loud")]).unwrap_err();
        assert_eq!(error.setting, "RUST_LOG");
    }

    #[test]
    fn bad_routes_are_refused_with_the_route_quoted() {
        for bad in [
            "127.0.0.1:1",
            "nonsense=127.0.0.1:2",
            "127.0.0.1:1=127.0.0.1:0",
            "127.0.0.1:1=host",
            "127.0.0.1:1=a b:80",
            "127.0.0.1:1=127.0.0.1:2/udp",
        ] {
            let error = config(
                ProxyArgs {
                    inbound: vec![bad.into()],
                    ..Default::default()
                },
                &[],
            )
            .unwrap_err();
            assert_eq!(error.value, bad);
        }
        let error = config(
            ProxyArgs {
                inbound: vec![
                    "127.0.0.1:9=127.0.0.1:2".into(),
                    "127.0.0.1:9=127.0.0.1:3".into(),
                ],
                ..Default::default()
            },
            &[],
        )
        .unwrap_err();
        assert!(error.reason.contains("already"), "{error}");
    }
}
