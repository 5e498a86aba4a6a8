//! Connections to a route's target for HTTP, pooled per route: HTTP/1.1 keep-alive connections
//! towards HTTP/1 clients ([`Http1Pool`]), one HTTP/2 prior-knowledge connection shared by the
//! streams of HTTP/2 clients ([`Http2Conn`]). Both are ours rather than hyper-util's pooled
//! client: one route has one target, so there is no key to hash, no URI to clone and no
//! checkout future per request (the pooled client cost HTTP/2 about a tenth of its CPU).
//!
//! The connector always dials the route's target, whatever the request's URI (resolving a host
//! name at connect time), so the client's `Host` / `:authority` reaches the app unchanged.
//! Pooled connections run on their own tasks, outside the drain: they hold no client, and
//! during a drain every HTTP/1 request towards the target carries `connection: close`, so a
//! pooled connection closes as its last request finishes. The shared HTTP/2 connection stays
//! open through the drain (other streams may still use it) and ends with the process.

use std::future::Future;
use std::io;
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use futures_util::task::AtomicWaker;
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tracing::debug;

use super::body::Payload;
use super::policy::BadResponse;
use super::response_head::{HeadCounts, HeadSeen};
use super::retry::Retries;
use crate::config::{Direction, RetryBudget, Target};
use crate::metrics::Metrics;
use crate::net::{self, OwnPort, OwnPorts};
use crate::sync::lock;

/// How long an idle pooled connection to a target is kept (less in the unit tests below,
/// which watch connections expire).
const POOL_IDLE_TIMEOUT: Duration = if cfg!(test) {
    Duration::from_millis(400)
} else {
    Duration::from_secs(90)
};

/// The pooled connections towards one target.
pub struct Upstream {
    /// The target as written in the route (or the original destination), for error
    /// responses: formatted once, not per request.
    pub name: String,
    pub http1: Arc<Http1Pool>,
    pub http2: Arc<Http2Conn>,
    /// Outbound: requests that got no answer go again within this budget (`retry.rs`).
    pub retries: Option<Retries>,
    /// A hand-off to the pod's Service (`proxy/handoff.rs`): the mark each request gets.
    pub handoff_mark: Option<hyper::header::HeaderValue>,
}

impl Upstream {
    pub fn new(
        target: Target,
        direction: Direction,
        connect_timeout: Duration,
        metrics: Arc<Metrics>,
        own_ports: Option<Arc<OwnPorts>>,
        retry_budget: Option<RetryBudget>,
    ) -> Upstream {
        let name = target.to_string();
        let retries = retry_budget.map(|budget| Retries::new(budget, direction, metrics.clone()));
        let connector = Connector {
            own_ports,
            target: Arc::new(target),
            direction,
            connect_timeout,
            metrics,
        };
        let http2 = Arc::new(Http2Conn {
            connector: connector.clone(),
            current: Mutex::new(None),
            dialing: tokio::sync::Mutex::new(None),
            dials: AtomicU64::new(0),
            sweeping: AtomicBool::new(false),
        });
        let http1 = Arc::new(Http1Pool {
            connector,
            idle: Mutex::new(Vec::new()),
            plain: Mutex::new(Vec::new()),
            sweeping: AtomicBool::new(false),
        });
        Upstream {
            name,
            http1,
            http2,
            retries,
            handoff_mark: None,
        }
    }

    /// The same, for a hand-off: each request carries `mark`.
    pub fn handing_off(self, mark: hyper::header::HeaderValue) -> Upstream {
        Upstream {
            handoff_mark: Some(mark),
            ..self
        }
    }
}

/// Dials the route's target.
#[derive(Clone)]
pub struct Connector {
    /// For an original destination: where its connections' ports are recorded.
    own_ports: Option<Arc<OwnPorts>>,
    target: Arc<Target>,
    direction: Direction,
    connect_timeout: Duration,
    metrics: Arc<Metrics>,
}

impl Connector {
    /// A connection, and its port's record (kept as long as the connection's task runs).
    async fn connect(&self) -> io::Result<(TcpStream, Option<OwnPort>)> {
        let own = self.own_ports.as_ref();
        match net::connect(&self.target, self.connect_timeout, own).await {
            Ok((stream, port)) => {
                let _ = stream.set_nodelay(true);
                Ok((stream, port))
            }
            Err((failure, error)) => {
                self.metrics.connect_failed(self.direction, failure);
                Err(error)
            }
        }
    }
}

impl std::fmt::Debug for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::Connect(error) | SendError::NotConnected(error, _) => {
                f.debug_tuple("Connect").field(error).finish()
            }
            SendError::Http(error) | SendError::Fresh(error) | SendError::Unsent(error, _) => {
                f.debug_tuple("Http").field(error).finish()
            }
            SendError::BadHead(why) => f.debug_tuple("BadHead").field(why).finish(),
        }
    }
}

/// Why a request could not be sent to the target, or got no response.
pub enum SendError {
    /// No connection to the target (refused, unresolvable, or not within the connect timeout).
    Connect(io::Error),
    /// The connection failed before the response's head arrived.
    Http(hyper::Error),
    /// The same, on an HTTP/1 connection dialled for this request: the target's answer, never
    /// the keep-alive race (the policy replays only that).
    Fresh(hyper::Error),
    /// No connection for this request, which is handed back whole (a retry may send it).
    NotConnected(io::Error, Box<Request<Payload>>),
    /// The connection failed before the request was written, which is handed back whole.
    Unsent(hyper::Error, Box<Request<Payload>>),
    /// hyper's HTTP/1 client found the response's head "too large": why, as the policy says.
    BadHead(BadResponse),
}

/// Idle HTTP/1.1 keep-alive connections to a route's target, the most recently used on top.
///
/// A request takes the top one (or dials a new one) and gets, with its response, a [`Lease`]
/// that puts the connection back once the response body has been read to its end; a response
/// cut short, or one that asks to close, never brings its connection back. No key, no
/// hashing and no task per request: one route, one target. A connection idle for
/// [`POOL_IDLE_TIMEOUT`] is closed (by a sweep every half of that, or when the pool is next
/// used). Each connection runs on a task of its own, outside the drain (see the module's
/// documentation).
pub struct Http1Pool {
    connector: Connector,
    idle: Mutex<Vec<Idle>>,
    /// Idle connections of the fast lane (`h1/lane.rs`), which speaks HTTP/1.1 on them itself:
    /// kept apart from hyper's, swept alike.
    plain: Mutex<Vec<PlainIdle>>,
    /// Set once the sweeping task runs (from the first connection on).
    sweeping: AtomicBool,
}

struct Idle {
    sender: Sender,
    since: Instant,
}

/// A connection of hyper's HTTP/1 client: its requests' sender, the counts of the response
/// head it is reading, and the end of the task that runs it.
struct Sender {
    requests: http1::SendRequest<Payload>,
    head: Arc<HeadCounts>,
    task: Arc<TaskEnd>,
}

/// Whether the task running a connection has ended, for the request waiting on it (see
/// [`Http1Pool::send`]).
#[derive(Default)]
struct TaskEnd {
    ended: AtomicBool,
    waiter: AtomicWaker,
}

impl TaskEnd {
    /// Resolves once the task has ended.
    fn ended(&self) -> impl Future<Output = ()> + '_ {
        std::future::poll_fn(|cx| {
            if self.ended.load(Ordering::Acquire) {
                return Poll::Ready(());
            }
            self.waiter.register(cx.waker());
            match self.ended.load(Ordering::Acquire) {
                true => Poll::Ready(()),
                false => Poll::Pending,
            }
        })
    }
}

/// Held by a connection's task: marks its end when the task drops it, after the connection.
struct EndsWithTask(Arc<TaskEnd>);

impl Drop for EndsWithTask {
    fn drop(&mut self) {
        self.0.ended.store(true, Ordering::Release);
        self.0.waiter.wake();
    }
}

impl std::ops::Deref for Sender {
    type Target = http1::SendRequest<Payload>;
    fn deref(&self) -> &Self::Target {
        &self.requests
    }
}

impl std::ops::DerefMut for Sender {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.requests
    }
}

/// A connection to the target that the fast lane speaks HTTP/1.1 on itself, with its port's
/// record (an original destination's).
pub struct PlainConn {
    pub stream: TcpStream,
    _port: Option<OwnPort>,
}

struct PlainIdle {
    conn: PlainConn,
    since: Instant,
}

/// An idle list, locked, once the entries idle for [`POOL_IDLE_TIMEOUT`] are closed (the
/// oldest are at the bottom).
fn unexpired<T>(list: &Mutex<Vec<T>>, since: fn(&T) -> Instant) -> MutexGuard<'_, Vec<T>> {
    let mut list = lock(list);
    let now = Instant::now();
    let expired = list
        .iter()
        .take_while(|entry| now.duration_since(since(entry)) >= POOL_IDLE_TIMEOUT)
        .count();
    list.drain(..expired);
    list
}

/// Whether the target has closed an idle connection, or sent on it what no request asked
/// for: costs no system call unless the socket was reported readable.
fn closed_or_unexpected(stream: &TcpStream) -> bool {
    match stream.try_read(&mut [0u8; 1]) {
        Err(error) => error.kind() != io::ErrorKind::WouldBlock,
        Ok(_) => true,
    }
}

impl Http1Pool {
    /// Sends `request` on an idle connection or a new one (`fresh`: a new one only). A request
    /// that an idle connection could not take at all (the target had closed it) goes to the
    /// next one.
    // Not an `async fn` (docs/architecture.md, "One note on `async fn`").
    #[allow(clippy::manual_async_fn)]
    pub fn send(
        self: &Arc<Self>,
        mut request: Request<Payload>,
        fresh: bool,
    ) -> impl Future<Output = Result<(Response<Incoming>, Lease), SendError>> + '_ {
        async move {
            loop {
                let (mut sender, reused) = match (!fresh).then(|| self.checkout()).flatten() {
                    Some(sender) => (sender, true),
                    // Boxed: dialling is rare, and its future (connect, handshake) would
                    // otherwise make every request's future larger by its size.
                    None => match Box::pin(self.dial()).await {
                        Ok(sender) => (sender, false),
                        Err(SendError::Connect(error)) => {
                            return Err(SendError::NotConnected(error, Box::new(request)));
                        }
                        Err(other) => return Err(other),
                    },
                };
                if let Err(error) = sender.ready().await {
                    match reused {
                        true => continue,
                        false => return Err(SendError::Unsent(error, Box::new(request))),
                    }
                }
                let mut sending = pin!(sender.try_send_request(request));
                let answered = tokio::select! {
                    biased;
                    sent = &mut sending => Some(sent),
                    // hyper answers every request its connection took, also when the
                    // connection fails. One sent at the instant it failed can be left in the
                    // channel to the connection instead (hyper's failing connection looks for
                    // a request there while the sending is still under way), held by the
                    // sender and answered never. Once the task has ended, dropping the sender
                    // drops the channel, which hands the request back unsent.
                    () = sender.task.ended() => None,
                };
                let (sender, sent) = match answered {
                    Some(sent) => (Some(sender), sent),
                    None => {
                        drop(sender);
                        debug!("the connection to the target ended without taking the request");
                        (None, sending.await)
                    }
                };
                match sent {
                    Ok(response) => {
                        let lease = Lease {
                            sender,
                            pool: self.clone(),
                            done: false,
                        };
                        return Ok((response, lease));
                    }
                    Err(mut error) => match error.take_message() {
                        Some(unsent) if reused => request = unsent,
                        Some(unsent) => {
                            return Err(SendError::Unsent(error.into_error(), Box::new(unsent)));
                        }
                        None if error.error().is_parse_too_large()
                            && let Some(sender) = sender =>
                        {
                            return Err(SendError::BadHead(sender.head.why_too_large()));
                        }
                        None if reused => return Err(SendError::Http(error.into_error())),
                        None => return Err(SendError::Fresh(error.into_error())),
                    },
                }
            }
        }
    }

    /// The idle connections, once those idle for too long are closed (the oldest are at the
    /// bottom).
    fn idle(&self) -> MutexGuard<'_, Vec<Idle>> {
        unexpired(&self.idle, |entry| entry.since)
    }

    fn checkout(&self) -> Option<Sender> {
        let mut idle = self.idle();
        while let Some(entry) = idle.pop() {
            if !entry.sender.is_closed() {
                return Some(entry.sender);
            }
        }
        None
    }

    /// The fast lane's idle connections, once those idle for too long are closed.
    fn plain(&self) -> MutexGuard<'_, Vec<PlainIdle>> {
        unexpired(&self.plain, |entry| entry.since)
    }

    /// An idle connection for the fast lane that the target has not closed, if there is one.
    pub fn checkout_plain(&self) -> Option<PlainConn> {
        let mut plain = self.plain();
        while let Some(entry) = plain.pop() {
            if !closed_or_unexpected(&entry.conn.stream) {
                return Some(entry.conn);
            }
        }
        None
    }

    /// A new connection for the fast lane.
    pub async fn dial_plain(self: &Arc<Self>) -> io::Result<PlainConn> {
        start_sweeping(&self.sweeping, self, Http1Pool::sweep);
        let (stream, port) = self.connector.connect().await?;
        Ok(PlainConn {
            stream,
            _port: port,
        })
    }

    /// A fast-lane connection whose last response was read to its end, for the next request.
    pub fn put_plain(&self, conn: PlainConn) {
        let entry = PlainIdle {
            conn,
            since: Instant::now(),
        };
        self.plain().push(entry);
    }

    /// Closes what has been idle for too long, and the fast lane's connections that the
    /// target closed (hyper's notice that by themselves).
    fn sweep(&self) {
        drop(self.idle());
        self.plain()
            .retain(|entry| !closed_or_unexpected(&entry.conn.stream));
    }

    async fn dial(self: &Arc<Self>) -> Result<Sender, SendError> {
        start_sweeping(&self.sweeping, self, Http1Pool::sweep);
        let (stream, port) = self.connector.connect().await.map_err(SendError::Connect)?;
        let io = UnreadAware::new(stream);
        let head = io.head.counts();
        let (requests, connection) = http1::handshake(TokioIo::new(io))
            .await
            .map_err(SendError::Http)?;
        let task = Arc::new(TaskEnd::default());
        let end = EndsWithTask(task.clone());
        tokio::spawn(async move {
            if let Err(error) = connection.with_upgrades().await {
                debug!(%error, "connection to the target ended with an error");
            }
            drop(port);
            drop(end);
        });
        Ok(Sender {
            requests,
            head,
            task,
        })
    }

    fn put(&self, sender: Sender) {
        let entry = Idle {
            sender,
            since: Instant::now(),
        };
        self.idle().push(entry);
    }
}

/// A connection to the target as hyper's HTTP/1 client reads it. A FIN after bytes were sent
/// and before any came back is looked at a little longer ([`net::reset_wait`]): an RST right
/// behind it says that the target closed the connection with the request unread (a pooled
/// connection it closed as the request went out), and hyper gets that reset (a request that
/// never reached the app, which may go again) rather than a close after which the app may have
/// read it.
pub struct UnreadAware {
    stream: TcpStream,
    /// Bytes went out since the last ones came in.
    awaiting: bool,
    /// After such a FIN: until when to look for the RST, and the next look.
    looking: Option<(tokio::time::Instant, Pin<Box<tokio::time::Sleep>>)>,
    /// The response head in progress, counted.
    head: HeadSeen,
}

impl UnreadAware {
    fn new(stream: TcpStream) -> UnreadAware {
        UnreadAware {
            stream,
            awaiting: false,
            looking: None,
            head: HeadSeen::default(),
        }
    }

    /// Bytes went out: the first since the last response's came in begin a request.
    fn wrote(&mut self, written: usize) {
        if written > 0 && !self.awaiting {
            self.head.request_sent();
        }
        self.awaiting |= written > 0;
    }

    /// The connection, once hyper has handed it over (an upgrade: a tunnel from then on).
    pub fn into_inner(self) -> TcpStream {
        self.stream
    }
}

impl AsyncRead for UnreadAware {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.looking.is_none() {
            let before = buf.filled().len();
            ready!(Pin::new(&mut this.stream).poll_read(cx, buf))?;
            this.head.read(&buf.filled()[before..]);
            if buf.filled().len() > before || !this.awaiting {
                this.awaiting = false;
                return Poll::Ready(Ok(()));
            }
            // A FIN with a request unanswered.
            let until = tokio::time::Instant::now() + net::reset_wait(&this.stream);
            this.looking = Some((until, Box::pin(tokio::time::sleep(Duration::ZERO))));
        }
        let Some((until, next)) = this.looking.as_mut() else {
            return Poll::Ready(Ok(()));
        };
        loop {
            if net::reset_arrived(&this.stream) {
                this.looking = None;
                return Poll::Ready(Err(io::ErrorKind::ConnectionReset.into()));
            }
            if tokio::time::Instant::now() >= *until {
                this.looking = None;
                this.awaiting = false;
                return Poll::Ready(Ok(()));
            }
            ready!(next.as_mut().poll(cx));
            next.as_mut()
                .reset(tokio::time::Instant::now() + Duration::from_millis(1));
        }
    }
}

impl AsyncWrite for UnreadAware {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = ready!(Pin::new(&mut this.stream).poll_write(cx, buf))?;
        this.wrote(written);
        Poll::Ready(Ok(written))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = ready!(Pin::new(&mut this.stream).poll_write_vectored(cx, bufs))?;
        this.wrote(written);
        Poll::Ready(Ok(written))
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// A pooled connection lent to one request, until its response body ends.
pub struct Lease {
    sender: Option<Sender>,
    pool: Arc<Http1Pool>,
    done: bool,
}

impl Lease {
    /// The response body was read to its end: the connection may serve another request.
    pub fn done(&mut self) {
        self.done = true;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let Some(sender) = self.sender.take() else {
            return;
        };
        if !self.done || sender.is_closed() {
            return;
        }
        if sender.is_ready() {
            self.pool.put(sender);
            return;
        }
        // Still finishing the request's body (the target answered early) or its own
        // bookkeeping: back once it can take a request, if it can. (No runtime: the process is
        // ending, and the connection with it.)
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let pool = self.pool.clone();
        runtime.spawn(async move {
            let mut sender = sender;
            if sender.ready().await.is_ok() {
                pool.put(sender);
            }
        });
    }
}

/// Every half of [`POOL_IDLE_TIMEOUT`], from the first connection on and while the pool
/// exists, `sweep` closes what has been idle for too long.
fn start_sweeping<P: Send + Sync + 'static>(started: &AtomicBool, pool: &Arc<P>, sweep: fn(&P)) {
    if started.swap(true, Ordering::Relaxed) {
        return;
    }
    let pool: Weak<P> = Arc::downgrade(pool);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(POOL_IDLE_TIMEOUT / 2);
        every.tick().await;
        loop {
            every.tick().await;
            let Some(pool) = pool.upgrade() else { return };
            sweep(&pool);
        }
    });
}

/// The HTTP/2 connection to a route's target that every HTTP/2 client's streams share. It is
/// dialled when first needed (one dial at a time: the streams that wait for it share its
/// outcome, the connection or the failure, so a target that does not answer costs them one
/// connect timeout, not one each), and again once the target has closed it or sent GOAWAY. Once no request has started on it
/// for [`POOL_IDLE_TIMEOUT`], the proxy lets it go: it closes as its last stream ends.
pub struct Http2Conn {
    connector: Connector,
    current: Mutex<Option<SharedConn>>,
    /// Held while dialling; the last dial's failure, if it failed.
    dialing: tokio::sync::Mutex<Option<(io::ErrorKind, String)>>,
    /// Dials finished so far.
    dials: AtomicU64,
    /// Set once the sweeping task runs (from the first connection on).
    sweeping: AtomicBool,
}

struct SharedConn {
    sender: http2::SendRequest<Payload>,
    last_used: Instant,
}

impl Http2Conn {
    /// Sends `request` on the shared connection, or on a new one when there is none (or it
    /// is closing). A request that the connection could not take at all (it had just closed)
    /// goes to a new one, once.
    // Not an `async fn`, as `Http1Pool::send`.
    #[allow(clippy::manual_async_fn)]
    pub fn send(
        self: &Arc<Self>,
        request: Request<Payload>,
    ) -> impl Future<Output = Result<Response<Incoming>, SendError>> + '_ {
        let mut request = Some(request);
        async move {
            let mut fresh = false;
            loop {
                let Some(sent) = self.try_send(&mut request) else {
                    // Boxed, as in `Http1Pool::send`.
                    match (Box::pin(self.dial()).await, request.take()) {
                        (Ok(()), unsent) => request = unsent,
                        (Err(SendError::Connect(error)), Some(unsent)) => {
                            return Err(SendError::NotConnected(error, Box::new(unsent)));
                        }
                        (Err(error), _) => return Err(error),
                    }
                    fresh = true;
                    continue;
                };
                match sent.await {
                    Ok(response) => return Ok(response),
                    Err(mut error) => match error.take_message() {
                        Some(unsent) if !fresh => {
                            fresh = true;
                            request = Some(unsent);
                        }
                        Some(unsent) => {
                            return Err(SendError::Unsent(error.into_error(), Box::new(unsent)));
                        }
                        None => return Err(SendError::Http(error.into_error())),
                    },
                }
            }
        }
    }

    /// Takes the request and starts it on the current connection, if there is one that can
    /// take it (else the request stays where it is); the returned future holds no lock.
    fn try_send(
        &self,
        request: &mut Option<Request<Payload>>,
    ) -> Option<
        impl Future<
            Output = Result<
                Response<Incoming>,
                hyper::client::conn::TrySendError<Request<Payload>>,
            >,
        > + use<>,
    > {
        let mut current = self.current();
        let shared = current.as_mut().filter(|shared| shared.sender.is_ready())?;
        shared.last_used = Instant::now();
        Some(shared.sender.try_send_request(request.take()?))
    }

    fn current(&self) -> MutexGuard<'_, Option<SharedConn>> {
        let mut current = lock(&self.current);
        if current
            .as_ref()
            .is_some_and(|shared| shared.last_used.elapsed() >= POOL_IDLE_TIMEOUT)
        {
            *current = None;
        }
        current
    }

    /// Dials a new connection, unless another stream dialled while this one waited to: then
    /// its outcome is this one's too.
    async fn dial(self: &Arc<Self>) -> Result<(), SendError> {
        let before = self.dials.load(Ordering::Acquire);
        let mut failed = self.dialing.lock().await;
        if self
            .current()
            .as_ref()
            .is_some_and(|shared| shared.sender.is_ready())
        {
            return Ok(());
        }
        if self.dials.load(Ordering::Acquire) != before
            && let Some((kind, message)) = failed.as_ref()
        {
            return Err(SendError::Connect(io::Error::new(*kind, message.clone())));
        }
        start_sweeping(&self.sweeping, self, |conn| drop(conn.current()));
        let dialled = self.handshake().await;
        self.dials.fetch_add(1, Ordering::Release);
        *failed = dialled.as_ref().err().map(|error| match error {
            SendError::Connect(error) => (error.kind(), error.to_string()),
            SendError::Http(error) | SendError::Fresh(error) | SendError::Unsent(error, _) => {
                (io::ErrorKind::Other, error.to_string())
            }
            SendError::NotConnected(error, _) => (error.kind(), error.to_string()),
            SendError::BadHead(why) => (io::ErrorKind::InvalidData, format!("{why:?}")),
        });
        let sender = dialled?;
        *self.current() = Some(SharedConn {
            sender,
            last_used: Instant::now(),
        });
        Ok(())
    }

    async fn handshake(&self) -> Result<http2::SendRequest<Payload>, SendError> {
        let (stream, port) = self.connector.connect().await.map_err(SendError::Connect)?;
        let (sender, connection) = http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .handshake(TokioIo::new(stream))
            .await
            .map_err(SendError::Http)?;
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                debug!(%error, "HTTP/2 connection to the target ended with an error");
            }
            drop(port);
        });
        Ok(sender)
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use hyper::body::Incoming;
    use hyper::{Request, Response};
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio::time::timeout;

    use super::super::body::Payload;
    use super::{POOL_IDLE_TIMEOUT, Upstream};
    use crate::config::{Direction, Target};
    use crate::conns::Connections;
    use crate::drain::Drain;
    use crate::metrics::Metrics;

    /// Long enough for any expiry here (the sweep runs every half of the idle timeout).
    const PATIENCE: Duration = Duration::from_secs(10);

    fn upstream_to(addr: SocketAddr) -> Upstream {
        let metrics = Metrics::new(Arc::new(Connections::default()), Arc::new(Drain::default()));
        Upstream::new(
            Target::Addr(addr),
            Direction::Inbound,
            Duration::from_secs(5),
            Arc::new(metrics),
            None,
            None,
        )
    }

    fn get() -> Request<Payload> {
        Request::get("http://app.test/")
            .body(Payload::Bytes(None))
            .unwrap()
    }

    /// A connection back in the pool is closed (the target reads its EOF) once it has been
    /// idle for the idle timeout, not before, with no further request to notice it: the
    /// sweep closes it.
    #[tokio::test]
    async fn an_idle_http1_connection_to_the_target_is_closed_after_the_idle_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = upstream_to(listener.local_addr().unwrap());
        let target = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            while !head.ends_with(b"\r\n\r\n") {
                let mut byte = [0u8; 1];
                assert_eq!(stream.read(&mut byte).await.unwrap(), 1, "no whole request");
                head.push(byte[0]);
            }
            stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await
                .unwrap();
            let answered = Instant::now();
            let mut rest = [0u8; 64];
            let read = stream.read(&mut rest).await.unwrap();
            (read, answered.elapsed())
        });

        let (response, mut lease) = upstream.http1.send(get(), false).await.unwrap();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "ok");
        lease.done();
        drop(lease);
        assert_eq!(upstream.http1.idle().len(), 1, "not back in the pool");

        let (read, idle_for) = timeout(PATIENCE, target)
            .await
            .expect("the idle connection was never closed")
            .unwrap();
        assert_eq!(read, 0, "the target got bytes instead of a close");
        assert!(
            idle_for >= POOL_IDLE_TIMEOUT,
            "closed after {idle_for:?}, before the idle timeout"
        );
        assert!(upstream.http1.idle().is_empty(), "still in the pool");
    }

    /// The shared HTTP/2 connection is let go once no request has started on it for the idle
    /// timeout: the target sees it end, not before; the next request dials a new one.
    #[tokio::test]
    async fn an_idle_http2_connection_to_the_target_is_closed_after_the_idle_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = upstream_to(listener.local_addr().unwrap());
        let (ended_tx, mut ended) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let ended_tx = ended_tx.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(|_: Request<Incoming>| async {
                        Ok::<_, hyper::Error>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                    });
                    let served = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                    let _ = ended_tx.send((Instant::now(), served.map_err(|e| format!("{e:?}"))));
                });
            }
        });

        // Idle counts from the last request's start (`last_used`), not from its answer.
        let started = Instant::now();
        let response = upstream.http2.send(get()).await.unwrap();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "ok");

        let (at, served) = timeout(PATIENCE, ended.recv())
            .await
            .expect("the idle HTTP/2 connection was never closed")
            .unwrap();
        let idle_for = at - started;
        assert!(served.is_ok(), "the connection ended with {served:?}");
        assert!(
            idle_for >= POOL_IDLE_TIMEOUT,
            "closed after {idle_for:?}, before the idle timeout"
        );

        let response = upstream.http2.send(get()).await.unwrap();
        assert_eq!(
            response.into_body().collect().await.unwrap().to_bytes(),
            "ok"
        );
        assert_eq!(
            upstream
                .http2
                .dials
                .load(std::sync::atomic::Ordering::Acquire),
            2,
            "the second request did not dial a new connection"
        );
    }

    /// A request sent at the instant its connection is reset gets its answer (an error: the
    /// target never answers), never a wait for ever. hyper's failing HTTP/1 connection looks
    /// for a queued request while the sending of one may still be under way; when the sending
    /// thread is preempted just then, the request is left in the channel, unanswered, for as
    /// long as the sender lives (`Http1Pool::send`). The window is a few instructions wide, so
    /// the test makes it come: a target that resets every connection as it accepts it, fresh
    /// connections only, more runtime threads than cores, and enough sends that without the
    /// fix some of them wait (the commit that added this test has the rate). With it, each
    /// send ends as soon as its connection's task has: none can time out.
    #[test]
    fn a_request_sent_as_its_connection_is_reset_is_answered() {
        const SENDS: usize = 100_000;
        const SENDERS: usize = 8;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let target = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::Acquire) {
                        return;
                    }
                    if let Ok(stream) = stream {
                        crate::net::reset(&stream);
                    }
                }
            })
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .unwrap();
        let upstream = Arc::new(upstream_to(addr));
        let waited = runtime.block_on(async move {
            let senders: Vec<_> = (0..SENDERS)
                .map(|_| {
                    let upstream = upstream.clone();
                    tokio::spawn(async move {
                        let mut waited = 0;
                        for _ in 0..SENDS / SENDERS {
                            match timeout(PATIENCE, upstream.http1.send(get(), true)).await {
                                Err(_) => waited += 1,
                                Ok(sent) => assert!(sent.is_err(), "the target answered"),
                            }
                        }
                        waited
                    })
                })
                .collect();
            let mut waited = 0;
            for sender in senders {
                waited += sender.await.unwrap();
            }
            waited
        });
        stop.store(true, Ordering::Release);
        let _ = std::net::TcpStream::connect(addr);
        target.join().unwrap();
        assert_eq!(
            waited, 0,
            "requests left waiting on a connection that had ended"
        );
    }
}
