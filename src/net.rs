//! Sockets, below everything else: binding a listener, closing it without resetting a
//! handshake in progress, the connection limit from the file-descriptor limit, connecting to a
//! target, resetting a socket, and the back-off and error handling shared by accept loops and
//! connects. Nothing here knows about routes, protocols or the drain.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, Ordering};
use std::time::Duration;

use socket2::{Domain, Socket, Type};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tracing::{debug, warn};

use crate::config::Target;
use crate::logging::Throttle;

/// Queue length for connections whose handshake is done but which are not yet accepted.
const LISTEN_BACKLOG: i32 = 1024;
/// At most one log line per this interval about exhausted resources.
const EXHAUSTION_LOG_INTERVAL: Duration = Duration::from_secs(1);

/// Binds a listening TCP socket on `addr`. With `v6_only` an IPv6 socket takes IPv6 alone, so
/// that an IPv4 socket can listen on the same port (a dual-stack pod); see [`v6_only`].
pub fn bind(addr: SocketAddr, v6_only: bool) -> io::Result<TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    if addr.is_ipv6() {
        socket.set_only_v6(v6_only)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    TcpListener::from_std(socket.into())
}

/// Whether binding failed because the host has no IPv6 at all.
pub fn is_ipv6_unavailable(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EAFNOSUPPORT | libc::EADDRNOTAVAIL)
    )
}

/// Whether the IPv6 listener on `addr` must leave IPv4 to another listener of `all` on the same
/// port. Otherwise an IPv6 socket on `[::]` takes IPv4 too (Linux's default), as a lone one
/// should.
pub fn v6_only(addr: SocketAddr, all: &[SocketAddr]) -> bool {
    addr.is_ipv6()
        && all
            .iter()
            .any(|other| other.is_ipv4() && other.port() == addr.port())
}

/// Where a connection was going before the NAT rules redirected it to the proxy
/// (`SO_ORIGINAL_DST`), or why it has no such destination. A connection that was not redirected
/// (sent to the proxy's own address) has none either: forwarding it would loop.
pub fn original_destination(stream: &TcpStream) -> Result<SocketAddr, OrigDstRefusal> {
    let socket = socket2::SockRef::from(stream);
    let local = stream
        .local_addr()
        .map_err(|_| OrigDstRefusal::NotRedirected)?;
    let original = match local {
        SocketAddr::V4(_) => socket.original_dst(),
        SocketAddr::V6(_) => socket.original_dst_ipv6(),
    };
    let original = original
        .ok()
        .and_then(|addr| addr.as_socket())
        .ok_or(OrigDstRefusal::NotRedirected)?;
    // IPv4 clients of an IPv6 socket come as IPv4-mapped addresses on either side.
    let canonical = |addr: SocketAddr| SocketAddr::new(addr.ip().to_canonical(), addr.port());
    if canonical(original) == canonical(local) {
        return Err(OrigDstRefusal::NotRedirected);
    }
    Ok(canonical(original))
}

/// Whether `ip` is one of this network namespace's own addresses (a socket can be bound to
/// it). Two system calls: for the rare check of a destination on one of the proxy's ports.
pub fn is_local_ip(ip: std::net::IpAddr) -> bool {
    ip.is_loopback() || std::net::UdpSocket::bind((ip, 0)).is_ok()
}

/// Why a connection on an `orig-dst` route is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OrigDstRefusal {
    /// No NAT rule redirected it: it was sent to the proxy's port itself.
    NotRedirected,
    /// Its destination is one of the proxy's own listeners: forwarding it would loop.
    ToProxy,
    /// It is one of the proxy's own connections, sent back by NAT rules that do not exempt
    /// the proxy: forwarding it would loop.
    Loop,
}

impl OrigDstRefusal {
    pub fn as_str(self) -> &'static str {
        match self {
            OrigDstRefusal::NotRedirected => "not_redirected",
            OrigDstRefusal::ToProxy => "to_proxy",
            OrigDstRefusal::Loop => "loop",
        }
    }
}

/// Makes the kernel drop new handshakes on `listener` (their clients retry, and meet the closed
/// port once it is closed) while connections whose handshake is done can still be accepted.
pub fn refuse_new_handshakes(listener: &std::net::TcpListener) -> io::Result<()> {
    socket2::SockRef::from(listener).attach_filter(&DROP_SYN)
}

/// A classic BPF socket filter that drops TCP segments with SYN set (the flags are byte 13 of
/// the TCP header, where a socket filter starts) and keeps the rest: the last segment of a
/// handshake already under way, and data, still come in.
const DROP_SYN: [libc::sock_filter; 4] = [
    bpf(libc::BPF_LD | libc::BPF_B | libc::BPF_ABS, 0, 0, 13),
    bpf(libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K, 0, 1, 0x02),
    bpf(libc::BPF_RET | libc::BPF_K, 0, 0, 0),
    bpf(libc::BPF_RET | libc::BPF_K, 0, 0, u32::MAX),
];

const fn bpf(code: u32, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    }
}

/// File descriptors kept for everything that is not a proxy connection: the runtime, the
/// listeners, admin connections, name resolution.
const RESERVED_FDS: u64 = 32;

/// How many proxy connections may be open at once: each holds two file descriptors (client
/// and target). Raises the soft file-descriptor limit to the hard one first, as servers do;
/// beyond the limit new connections wait in the kernel's listen queue instead of failing.
pub fn connection_limit() -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read or write the struct passed to them.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return Semaphore::MAX_PERMITS;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit = raised;
            }
        }
    }
    if limit.rlim_cur == libc::RLIM_INFINITY {
        return Semaphore::MAX_PERMITS;
    }
    let pairs = limit.rlim_cur.saturating_sub(RESERVED_FDS) / 2;
    (pairs.max(1) as usize).min(Semaphore::MAX_PERMITS)
}

/// Errors that say the process ran out of something, not that one connection went bad.
pub fn is_resource_exhaustion(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// A pause after a failure that the next try would meet again at once (the process is out of
/// file descriptors or memory): doubles from [`Backoff::MIN`] to [`Backoff::MAX`], and starts
/// over after a success.
#[derive(Debug)]
pub struct Backoff {
    next: Duration,
}

impl Backoff {
    /// Short enough that a freed descriptor is used soon, long enough not to spin.
    pub const MIN: Duration = Duration::from_millis(5);
    /// Bounds the wait once resources are back.
    pub const MAX: Duration = Duration::from_millis(100);

    /// Waits for the current pause, then doubles it.
    pub async fn wait(&mut self) {
        tokio::time::sleep(self.next).await;
        self.next = (self.next * 2).min(Self::MAX);
    }

    /// A try succeeded: the next failure waits the shortest pause again.
    pub fn reset(&mut self) {
        self.next = Self::MIN;
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { next: Self::MIN }
    }
}

/// What an accept loop does after an error: skip a connection that died in the queue, back
/// off when the process ran out of resources (the error repeats at once until something is
/// freed, so retrying straight away would spin), and log the latter at most once per
/// [`EXHAUSTION_LOG_INTERVAL`].
pub struct AcceptErrors {
    backoff: Backoff,
    log: Throttle,
}

impl Default for AcceptErrors {
    fn default() -> Self {
        AcceptErrors {
            backoff: Backoff::default(),
            log: Throttle::new(EXHAUSTION_LOG_INTERVAL),
        }
    }
}

impl AcceptErrors {
    /// An accept succeeded: the next exhaustion starts with the shortest pause again.
    pub fn succeeded(&mut self) {
        self.backoff.reset();
    }

    /// Handles one accept error; resolves when accepting may be tried again.
    pub async fn failed(&mut self, error: &io::Error, listen: SocketAddr) {
        if !is_resource_exhaustion(error) {
            // ECONNABORTED and friends: that connection is gone, the next one may be fine.
            debug!(%listen, %error, "accept failed for one connection");
            return;
        }
        if let Some(suppressed) = self.log.due() {
            warn!(%listen, %error, suppressed, "accept failed: out of resources, backing off");
        }
        self.backoff.wait().await;
    }
}

/// Connects to `target`, resolving a host name now, within `timeout`. When the process is out
/// of file descriptors or memory, connecting is retried with back-off until the timeout: the
/// client keeps its place instead of being reset for the proxy's own shortage.
///
/// With `own`, the connection's local port is chosen before connecting and recorded there for
/// as long as the returned [`OwnPort`] lives (see [`OwnPorts`]).
pub(crate) async fn connect(
    target: &Target,
    timeout: Duration,
    own: Option<&Arc<OwnPorts>>,
) -> Result<(TcpStream, Option<OwnPort>), (ConnectFailure, io::Error)> {
    let attempt = async {
        let mut backoff = Backoff::default();
        loop {
            match connect_once(target, own).await {
                Err((_, error)) if is_resource_exhaustion(&error) => {
                    debug!(%error, "no resources to connect to the target yet; retrying");
                    backoff.wait().await;
                }
                result => return result,
            }
        }
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(result) => result,
        Err(_) => Err((
            ConnectFailure::Timeout,
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "no connection within {}",
                    humantime::format_duration(timeout)
                ),
            ),
        )),
    }
}

/// One try at every address `target` resolves to.
async fn connect_once(
    target: &Target,
    own: Option<&Arc<OwnPorts>>,
) -> Result<(TcpStream, Option<OwnPort>), (ConnectFailure, io::Error)> {
    let addrs: Vec<SocketAddr> = match target {
        Target::Addr(addr) => vec![*addr],
        Target::Host { host, port } => tokio::net::lookup_host((host.as_str(), *port))
            .await
            .map_err(|error| (ConnectFailure::Resolve, error))?
            .collect(),
        // Resolved per connection before connecting; a route's own `orig-dst` is no address.
        Target::OrigDst => Vec::new(),
    };
    let mut last = io::Error::new(
        io::ErrorKind::NotFound,
        format!("{target} resolved to no address"),
    );
    for addr in addrs {
        let connected = match own {
            None => TcpStream::connect(addr).await.map(|stream| (stream, None)),
            Some(own) => connect_from_own_port(addr, own).await,
        };
        match connected {
            Ok(connected) => return Ok(connected),
            Err(error) => last = error,
        }
    }
    let failure = match last.kind() {
        io::ErrorKind::ConnectionRefused => ConnectFailure::Refused,
        io::ErrorKind::NotFound => ConnectFailure::Resolve,
        _ => ConnectFailure::Other,
    };
    Err((failure, last))
}

/// Binds a port, records it, then connects from it: the record is there before the first SYN
/// leaves, so that a redirect straight back to the proxy finds it.
async fn connect_from_own_port(
    addr: SocketAddr,
    own: &Arc<OwnPorts>,
) -> io::Result<(TcpStream, Option<OwnPort>)> {
    let (socket, any) = match addr {
        SocketAddr::V4(_) => (
            tokio::net::TcpSocket::new_v4()?,
            SocketAddr::from(([0, 0, 0, 0], 0)),
        ),
        SocketAddr::V6(_) => (
            tokio::net::TcpSocket::new_v6()?,
            SocketAddr::from(([0u16; 8], 0)),
        ),
    };
    match own.dials_only {
        // From a port of the dial range: one the kernel would never give a client.
        Some(_) => bind_dial_port(&socket, any, own)?,
        None => socket.bind(any)?,
    }
    let port = OwnPorts::record(own, socket.local_addr()?.port());
    let stream = socket.connect(addr).await?;
    if let Some(after) = own.dials_only {
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            drop(port);
        });
        return Ok((stream, None));
    }
    Ok((stream, Some(port)))
}

/// The ports the hand-off dials from: below Linux's ephemeral range (32768 to 60999 by
/// default, where the kernel picks the ports of clients' connections), so that a late client of
/// the pod is never taken for one of the hand-off's own connections come back, whatever port
/// its kernel picked.
const DIAL_PORTS: std::ops::RangeInclusive<u16> = 20_000..=32_767;

/// Binds `socket` to a free port of [`DIAL_PORTS`] (one in use is skipped).
fn bind_dial_port(
    socket: &tokio::net::TcpSocket,
    any: SocketAddr,
    own: &OwnPorts,
) -> io::Result<()> {
    let mut last = io::Error::from(io::ErrorKind::AddrInUse);
    for _ in 0..64 {
        let port = own.next_dial_port();
        match socket.bind(SocketAddr::new(any.ip(), port)) {
            Ok(()) => return Ok(()),
            Err(error) if error.kind() == io::ErrorKind::AddrInUse => last = error,
            Err(error) => return Err(error),
        }
    }
    Err(last)
}

/// The local ports of the proxy's own connections to original destinations, while they live.
///
/// NAT rules that do not exempt the proxy's own connections send each of them back to the
/// proxy, which would forward it again, and again: a connection storm. Such a connection comes
/// from one of these ports, on one of the pod's addresses, and is refused instead. A count per
/// port (64 KiB in all): an IPv4 and an IPv6 connection may share a port number.
pub struct OwnPorts {
    counts: Box<[AtomicU8]>,
    /// For connections that can come back only as they are dialled (the hand-off's: the node's
    /// Service rules send a connection back at its handshake, never later): how long after its
    /// connect a port stays recorded. `None`: as long as its connection lives.
    dials_only: Option<Duration>,
    /// Dials so far, and this process's own walk through [`DIAL_PORTS`]: where it starts and
    /// its step (coprime with the range's size).
    next_dial: AtomicU32,
    dial_walk: (u64, u64),
}

impl std::fmt::Debug for OwnPorts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OwnPorts")
    }
}

impl Default for OwnPorts {
    fn default() -> Self {
        OwnPorts {
            counts: (0..=u16::MAX).map(|_| AtomicU8::new(0)).collect(),
            dials_only: None,
            next_dial: AtomicU32::new(0),
            dial_walk: {
                use std::hash::BuildHasher;
                let seed =
                    std::collections::hash_map::RandomState::new().hash_one(std::process::id());
                dial_walk(seed)
            },
        }
    }
}

/// The size of [`DIAL_PORTS`].
const DIAL_SPAN: u64 = (*DIAL_PORTS.end() - *DIAL_PORTS.start()) as u64 + 1;

/// A walk through [`DIAL_PORTS`] from `seed`: a start and a step coprime with the range's size,
/// so that every port comes once before any comes again. A port used again soon could meet its
/// last connection's NAT record (conntrack keeps a reset one for seconds) and follow that
/// connection's old route instead of the Service's rules: a hand-off the rules sent back to
/// the pod would come back once more. Each process has its own walk: two pods never walk the
/// range in step, one pod's dials arriving at another from the ports that one dials from.
fn dial_walk(seed: u64) -> (u64, u64) {
    fn gcd(a: u64, b: u64) -> u64 {
        if b == 0 { a } else { gcd(b, a % b) }
    }
    let start = seed % DIAL_SPAN;
    let mut step = (seed >> 32) % DIAL_SPAN;
    while gcd(step, DIAL_SPAN) != 1 {
        step += 1;
    }
    (start, step)
}

impl OwnPorts {
    /// Ports of [`DIAL_PORTS`], recorded for `after` past their connect only, not for their
    /// connection's life: a client of this pod is never taken for one of them.
    pub fn dials_only(after: Duration) -> OwnPorts {
        OwnPorts {
            dials_only: Some(after),
            ..OwnPorts::default()
        }
    }

    fn record(own: &Arc<OwnPorts>, port: u16) -> OwnPort {
        own.counts[usize::from(port)].fetch_add(1, Ordering::AcqRel);
        OwnPort {
            own: own.clone(),
            port,
        }
    }

    /// The port of the next dial, along this process's walk.
    fn next_dial_port(&self) -> u16 {
        let n = u64::from(self.next_dial.fetch_add(1, Ordering::Relaxed));
        let (start, step) = self.dial_walk;
        *DIAL_PORTS.start() + ((start + n % DIAL_SPAN * step) % DIAL_SPAN) as u16
    }

    /// Whether one of the proxy's own connections to an original destination uses `port`.
    pub fn contains(&self, port: u16) -> bool {
        self.counts[usize::from(port)].load(Ordering::Acquire) > 0
    }
}

/// A port in [`OwnPorts`], until dropped with its connection.
pub struct OwnPort {
    own: Arc<OwnPorts>,
    port: u16,
}

impl Drop for OwnPort {
    fn drop(&mut self) {
        self.own.counts[usize::from(self.port)].fetch_sub(1, Ordering::AcqRel);
    }
}

/// Why connecting to a target failed.
#[derive(Clone, Copy, Debug)]
pub enum ConnectFailure {
    Refused,
    Timeout,
    Resolve,
    Other,
}

impl ConnectFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            ConnectFailure::Refused => "refused",
            ConnectFailure::Timeout => "timeout",
            ConnectFailure::Resolve => "resolve",
            ConnectFailure::Other => "other",
        }
    }
}

/// Makes the socket send an RST instead of a FIN when it is closed: a peer must never mistake
/// a broken stream for a complete one.
pub fn reset(socket: impl AsFd) {
    let _ = socket2::SockRef::from(&socket).set_linger(Some(Duration::ZERO));
}

/// Whether an RST has arrived on a connected socket: its pending error is a reset (after the
/// peer's FIN, Linux reports the reset as `EPIPE`). Reading it clears it.
pub fn reset_arrived(socket: impl AsFd) -> bool {
    match socket2::SockRef::from(&socket).take_error() {
        Ok(Some(error)) => matches!(error.raw_os_error(), Some(libc::ECONNRESET | libc::EPIPE)),
        _ => false,
    }
}

/// How long to look for an RST behind a peer's FIN: a peer that closed before the last bytes
/// sent to it arrived resets the connection when they do, a round trip after its FIN at most;
/// four of the socket's smoothed round trips, between 10 ms (room for a busy peer's scheduling
/// between its FIN and its close) and 50 ms.
pub fn reset_wait(socket: impl AsFd) -> Duration {
    let mut info = std::mem::MaybeUninit::<libc::tcp_info>::zeroed();
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `info`, a tcp_info it may leave zeroed.
    let rc = unsafe {
        libc::getsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&socket.as_fd()),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            info.as_mut_ptr().cast(),
            &mut len,
        )
    };
    // SAFETY: zeroed is a valid tcp_info, and getsockopt wrote a valid one when it succeeded.
    let rtt = match rc {
        0 => Duration::from_micros(u64::from(unsafe { info.assume_init() }.tcpi_rtt)),
        _ => Duration::ZERO,
    };
    (rtt * 4).clamp(Duration::from_millis(10), Duration::from_millis(50))
}

/// Bytes waiting in the socket's receive queue.
pub fn unread_bytes(fd: RawFd) -> usize {
    let mut pending: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int; `fd` belongs to a socket that the caller keeps open.
    let rc = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut pending) };
    if rc == 0 { pending.max(0) as usize } else { 0 }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    use super::{DIAL_PORTS, DIAL_SPAN, DROP_SYN, OwnPorts, dial_walk};

    /// Once the filter is on, a new connection attempt does not complete (its SYN is dropped),
    /// while a connection whose handshake was done already is accepted with its bytes.
    #[test]
    fn the_closing_filter_drops_new_handshakes_and_keeps_queued_connections() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut queued = TcpStream::connect(addr).unwrap();
        socket2::SockRef::from(&listener)
            .attach_filter(&DROP_SYN)
            .unwrap();
        queued.write_all(b"request").unwrap();
        let late = TcpStream::connect_timeout(&addr, Duration::from_millis(300));
        assert!(late.is_err(), "a handshake completed after the filter");
        let (mut accepted, _) = listener.accept().unwrap();
        accepted
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut bytes = [0u8; 7];
        accepted.read_exact(&mut bytes).unwrap();
        assert_eq!(&bytes, b"request");
    }

    /// A process's hand-off dials walk the whole range before a port comes again, and two
    /// processes walk it apart.
    #[test]
    fn dial_ports_come_once_each_before_any_comes_again() {
        let own = OwnPorts::dials_only(Duration::from_secs(1));
        let mut seen = vec![false; DIAL_SPAN as usize];
        for _ in 0..DIAL_SPAN {
            let port = own.next_dial_port();
            assert!(DIAL_PORTS.contains(&port), "{port}");
            let index = usize::from(port - DIAL_PORTS.start());
            assert!(!seen[index], "{port} came twice in one walk");
            seen[index] = true;
        }
        // Whatever the seed: a step that shares a factor with the range is moved past.
        for seed in [0, 1, 2 << 32, 12_768 << 32, u64::MAX] {
            let (_, step) = dial_walk(seed);
            assert!((1..DIAL_SPAN).contains(&step), "{seed}: {step}");
        }
        let other = OwnPorts::dials_only(Duration::from_secs(1));
        let ours: Vec<u16> = (0..8).map(|_| own.next_dial_port()).collect();
        let theirs: Vec<u16> = (0..8).map(|_| other.next_dial_port()).collect();
        assert_ne!(ours, theirs);
    }
}
