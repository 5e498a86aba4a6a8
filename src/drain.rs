//! The shutdown, owned in one place.
//!
//! [`Drain`] holds every signal of the shutdown sequence: whether it has been triggered (and
//! why), the current [`Phase`], one [`Side`] per direction with its listeners' close signal and
//! the tracker of its connections, and the `terminate` token that resets whatever is still open.
//! Nothing else in the crate keeps a flag of its own. Its fields are private: the lifecycle
//! (`app`, and `quiesce` for the inbound side) calls its verbs (go away, close, force close,
//! wait until drained); listeners and connections get [`Watch`]es they can only listen to, and
//! spawn their tasks through their [`Side`]. The sequence itself is described in
//! docs/lifecycle.md.

use std::fmt;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};
#[cfg(test)]
use std::time::Duration;
use std::time::{Instant, SystemTime};

use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};
use tokio_util::task::TaskTracker;

use crate::arrivals::{Arrivals, Holder, Rule};
use crate::config::Direction;
use crate::sync::lock;

/// What started the shutdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShutdownReason {
    /// SIGTERM or SIGINT, by number.
    Signal(i32),
    /// `POST /shutdown` on the admin server.
    AdminRequest,
}

impl fmt::Display for ShutdownReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShutdownReason::Signal(signal) => f.write_str(signal_name(*signal)),
            ShutdownReason::AdminRequest => f.write_str("POST /shutdown"),
        }
    }
}

pub fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGHUP => "SIGHUP",
        _ => "signal",
    }
}

/// The phases of the lifecycle (docs/lifecycle.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    Starting = 0,
    Serving = 1,
    LameDuck = 2,
    Draining = 3,
    Terminating = 4,
}

impl Phase {
    pub const ALL: [Phase; 5] = [
        Phase::Starting,
        Phase::Serving,
        Phase::LameDuck,
        Phase::Draining,
        Phase::Terminating,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Starting => "starting",
            Phase::Serving => "serving",
            Phase::LameDuck => "lame_duck",
            Phase::Draining => "draining",
            Phase::Terminating => "terminating",
        }
    }
}

/// A token that the code which listens to it cannot cancel: only [`Drain`] and [`Side`] do.
#[derive(Clone, Debug)]
pub struct Watch(CancellationToken);

impl Watch {
    /// Resolves once the token is cancelled.
    pub fn cancelled(&self) -> WaitForCancellationFuture<'_> {
        self.0.cancelled()
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.is_cancelled()
    }

    /// One that nothing cancels.
    pub fn never() -> Watch {
        Watch(CancellationToken::new())
    }
}

/// The shutdown state of one direction's listeners and connections.
///
/// The outbound side has one for the life of the process. The inbound side has a new one each
/// time it serves again after a quiesce (an app container restarted, docs/pod-lifecycle.md): the
/// connections and listeners of the old one drain on as they were.
#[derive(Debug)]
pub struct Side {
    pub direction: Direction,
    /// Cancelled by [`Side::go_away`] when this side's connections must ask their peers to go
    /// away (HTTP `connection: close`, GOAWAY); opaque TCP ignores it.
    go_away: CancellationToken,
    /// Cancelled by [`Side::close`] when this side's listeners must stop accepting; each
    /// accept loop then accepts what is already queued and closes its socket.
    stop_accepting: CancellationToken,
    /// Tracks this side's accept loops, so that [`Side::close`] knows when every listener is
    /// closed and every queued connection spawned.
    accept_loops: TaskTracker,
    /// Cancelled by [`Side::close`] once the listeners are closed: idle HTTP/1 connections and
    /// clients that have not sent a byte are closed then. Not earlier, so that a client whose
    /// idle connection is closed reconnects to a closed port (refused, never sent) instead of
    /// racing the listener's close.
    listeners_closed: CancellationToken,
    /// Tracks this side's connection tasks: [`Side::drained`] waits for them.
    connections: TaskTracker,
    /// Cancelled by [`Side::spread_close`] when the close-spread window opens: each connection
    /// still open then ends itself, as cleanly as its protocol allows, at the time the window
    /// gave it (src/close_spread.rs).
    spread: CancellationToken,
    /// Cancelled by [`Side::force_close`] (the inbound quiesce, when its grace period runs
    /// out), and as a child of the drain's own with everything else ([`Drain::force_close`]):
    /// this side's connections are reset now.
    terminate: CancellationToken,
    /// Set by [`Side::record_arrivals`] when an adaptive lame duck starts: from then on the
    /// accept loops write the new connections that tell it its peers still send here into
    /// `arrivals` (before, an accept costs no lock for it).
    recording: AtomicBool,
    /// The new connections since the lame duck started, by source (src/arrivals.rs); read by
    /// the lame duck and `/status`.
    arrivals: Mutex<Option<Book>>,
    /// Set by [`Side::refuse_late`] before [`Side::close`]: then each listener, once it has
    /// accepted its queue, goes on accepting what still arrives and resets it at once (a late
    /// connection: counted, never left to time out), until [`Side::stop_refusing`].
    refuses_late: AtomicBool,
    /// The tasks that refuse late connections, one per listener; not part of the drain.
    refusers: TaskTracker,
    /// Cancelled by [`Side::stop_refusing`] (the inbound side serving again after a restart of
    /// the app container): the refusers close their listeners and end.
    stop_refusing: CancellationToken,
    /// The late connections refused so far.
    late: Mutex<Late>,
}

/// The late connections of a side.
#[derive(Debug, Default)]
struct Late {
    count: u64,
    /// Of those, handed off to the pod's Service (src/proxy/handoff.rs).
    handed_off: u64,
    /// The hand-off's own connections that the node's Service rules sent back here.
    loops: u64,
    /// The last one: when, from where.
    last: Option<(Instant, IpAddr)>,
    /// Those that tell that the cluster still sends here (not from an ignored source), by
    /// source, from when the listeners began to refuse them (src/arrivals.rs): the linger
    /// reads it.
    book: Option<Book>,
}

/// New connections by source, from when the book started (src/arrivals.rs).
#[derive(Debug)]
struct Book {
    started: tokio::time::Instant,
    arrivals: Arrivals,
}

impl Book {
    fn new(arrivals: Arrivals) -> Book {
        Book {
            started: tokio::time::Instant::now(),
            arrivals,
        }
    }

    fn arrive(&mut self, from: IpAddr) {
        self.arrivals.arrive(from, self.started.elapsed());
    }

    /// When it says the sources have stopped under `rule`, and what holds it that long.
    fn quiet_at(&self, rule: &Rule) -> Option<(tokio::time::Instant, Holder)> {
        let (end, holder) = self.arrivals.end(rule)?;
        Some((self.started + end, holder))
    }
}

impl Side {
    fn new(direction: Direction, terminate: &CancellationToken) -> Side {
        Side {
            direction,
            go_away: CancellationToken::new(),
            stop_accepting: CancellationToken::new(),
            accept_loops: TaskTracker::new(),
            listeners_closed: CancellationToken::new(),
            connections: TaskTracker::new(),
            spread: CancellationToken::new(),
            terminate: terminate.child_token(),
            recording: AtomicBool::new(false),
            arrivals: Mutex::new(None),
            refuses_late: AtomicBool::new(false),
            refusers: TaskTracker::new(),
            stop_refusing: CancellationToken::new(),
            late: Mutex::new(Late::default()),
        }
    }

    /// Makes [`Side::close`] keep the listeners to refuse late connections at once, rather
    /// than close them (docs/pod-lifecycle.md, "Never a black hole").
    pub fn refuse_late(&self) {
        self.refuses_late.store(true, Ordering::Release);
    }

    /// Whether a listener of this side, once closing, refuses late connections.
    pub fn refuses_late(&self) -> bool {
        self.refuses_late.load(Ordering::Acquire)
    }

    /// Runs a task that refuses late connections on a listener; it must end soon after
    /// [`Side::refusing_stopped`] resolves.
    pub fn spawn_refuser(&self, refuser: impl Future<Output = ()> + Send + 'static) {
        self.refusers.spawn(refuser);
    }

    /// Resolves when the refusers must close their listeners.
    pub fn refusing_stopped(&self) -> WaitForCancellationFuture<'_> {
        self.stop_refusing.cancelled()
    }

    /// Closes the listeners that refuse late connections, and waits until they are closed.
    pub async fn stop_refusing(&self) {
        self.stop_refusing.cancel();
        self.refusers.close();
        self.refusers.wait().await;
    }

    /// A listener of this side begins to refuse late connections: the book of late arrivals
    /// starts now (once).
    pub fn refusing_from_now(&self) {
        lock(&self.late)
            .book
            .get_or_insert_with(|| Book::new(Arrivals::default()));
    }

    /// Counts a late connection from `from`, and writes it in the book of late arrivals when
    /// it `counts` (it is not from an ignored source); how many so far.
    pub fn arrived_late(&self, from: IpAddr, counts: bool) -> u64 {
        let mut late = lock(&self.late);
        late.count += 1;
        late.last = Some((Instant::now(), from));
        if counts && let Some(book) = late.book.as_mut() {
            book.arrive(from);
        }
        late.count
    }

    /// A late connection was handed off to the pod's Service rather than refused.
    pub fn handed_off(&self) {
        lock(&self.late).handed_off += 1;
    }

    /// One of the hand-off's own connections came back here (not a late connection); how many
    /// so far.
    pub fn came_back(&self) -> u64 {
        let mut late = lock(&self.late);
        late.loops += 1;
        late.loops
    }

    /// Late connections handed off so far, and the hand-off's connections that came back.
    pub fn handoffs(&self) -> (u64, u64) {
        let late = lock(&self.late);
        (late.handed_off, late.loops)
    }

    /// Late connections so far (refused or handed off), and the last one: when, from where.
    pub fn late(&self) -> (u64, Option<(Instant, IpAddr)>) {
        let late = lock(&self.late);
        (late.count, late.last)
    }

    /// When the book of late arrivals says they have stopped under `rule`, what holds it that
    /// long, and when the book started; `None` when none has come (src/arrivals.rs).
    pub fn late_quiet_at(
        &self,
        rule: &Rule,
    ) -> Option<(tokio::time::Instant, Holder, tokio::time::Instant)> {
        let late = lock(&self.late);
        let book = late.book.as_ref()?;
        let (quiet_at, holder) = book.quiet_at(rule)?;
        Some((quiet_at, holder, book.started))
    }

    /// Starts the book of new connections of a lame duck starting now, which expects
    /// `expected_rate` a second (src/arrivals.rs); a book already started is kept.
    pub fn record_arrivals(&self, expected_rate: f64) {
        lock(&self.arrivals).get_or_insert_with(|| Book::new(Arrivals::expecting(expected_rate)));
        self.recording.store(true, Ordering::Release);
    }

    /// Records a new connection from `from` that counts for the lame duck, once its book is
    /// started.
    pub fn arrived(&self, from: IpAddr) {
        if !self.recording.load(Ordering::Acquire) {
            return;
        }
        if let Some(book) = lock(&self.arrivals).as_mut() {
            book.arrive(from);
        }
    }

    /// When the book says the rest of the cluster has stopped sending here under `rule`, and
    /// what holds it that long (src/arrivals.rs); `None` before the book or with nothing in it.
    pub fn quiet_at(&self, rule: &Rule) -> Option<(tokio::time::Instant, Holder)> {
        lock(&self.arrivals).as_ref()?.quiet_at(rule)
    }

    /// Reads the book: when it started and what is in it.
    pub fn with_arrivals<T>(
        &self,
        read: impl FnOnce(tokio::time::Instant, &Arrivals) -> T,
    ) -> Option<T> {
        lock(&self.arrivals)
            .as_ref()
            .map(|book| read(book.started, &book.arrivals))
    }

    /// Runs an accept loop of this side; it must end soon after [`Side::stop_accepting`]
    /// resolves.
    pub fn spawn_accept_loop(&self, accept_loop: impl Future<Output = ()> + Send + 'static) {
        self.accept_loops.spawn(accept_loop);
    }

    /// Resolves when this side's listeners must stop accepting.
    pub fn stop_accepting(&self) -> WaitForCancellationFuture<'_> {
        self.stop_accepting.cancelled()
    }

    /// Runs a task that serves a connection of this side (or part of one: a tunnel, a parked
    /// keep-alive connection): the side is drained when every such task has ended.
    pub fn spawn(&self, connection: impl Future<Output = ()> + Send + 'static) {
        self.connections.spawn(connection);
    }

    /// Asks this side's connections to ask their peers to go away.
    pub fn go_away(&self) {
        self.go_away.cancel();
    }

    /// Closes the listeners, waits until each has accepted its queue and closed, then tells
    /// the connections that the listeners are closed.
    pub async fn close(&self) {
        self.stop_accepting.cancel();
        self.accept_loops.close();
        self.accept_loops.wait().await;
        self.listeners_closed.cancel();
    }

    /// Resolves once [`Side::close`] has closed every listener.
    pub fn listeners_closed(&self) -> WaitForCancellationFuture<'_> {
        self.listeners_closed.cancelled()
    }

    /// Resolves once every connection task of this side has ended.
    pub async fn drained(&self) {
        self.connections.close();
        self.connections.wait().await;
    }

    /// Opens the close-spread window: every connection of this side ends at its time (one each
    /// connection was given before this call, or at once).
    pub fn spread_close(&self) {
        self.spread.cancel();
    }

    /// Resets this side's connections now and closes its listeners without waiting.
    pub fn force_close(&self) {
        // Reset first: a connection task on another worker thread that saw `listeners_closed`
        // before `terminate` would close its idle connection with a FIN instead of the reset.
        self.terminate.cancel();
        self.go_away.cancel();
        self.stop_accepting.cancel();
        self.listeners_closed.cancel();
    }

    /// What a new connection of this side listens to.
    pub fn conn_tokens(&self) -> ConnTokens {
        // The side's own tokens, shared: nothing cancels one connection alone, so a child
        // token each would only cost an allocation and the parent's lock on every open and
        // close.
        ConnTokens {
            go_away: Watch(self.go_away.clone()),
            listeners_closed: Watch(self.listeners_closed.clone()),
            spread: Watch(self.spread.clone()),
            terminate: Watch(self.terminate.clone()),
        }
    }
}

/// What one connection task listens to: its side's tokens.
#[derive(Debug)]
pub struct ConnTokens {
    /// Cancelled when the connection should ask its peer to go away.
    pub go_away: Watch,
    /// Cancelled when the side's listeners have closed: idle HTTP/1 connections and clients
    /// that have not sent a byte are closed then.
    pub listeners_closed: Watch,
    /// Cancelled when the close-spread window opens: the connection ends at its time.
    pub spread: Watch,
    /// Cancelled when the connection must be reset now (grace period over, or "stop now").
    pub terminate: Watch,
}

#[derive(Debug)]
pub struct Drain {
    /// Cancelled by [`Drain::trigger`]: the shutdown has started and `/ready` answers 503.
    shutdown: CancellationToken,
    reason: OnceLock<ShutdownReason>,
    started_at: OnceLock<(Instant, SystemTime)>,
    phase: AtomicU8,
    /// The inbound side serving now (replaced when it serves again after a quiesce).
    inbound: Mutex<Arc<Side>>,
    outbound: Arc<Side>,
    /// When the inbound side was quiesced (docs/pod-lifecycle.md), while it is: `/ready` answers
    /// 503.
    inbound_quiesced: Mutex<Option<Instant>>,
    /// Cancelled by [`Drain::force_close`] when the grace period runs out or a second signal
    /// arrives: every side's `terminate` with it, so every connection task resets its sockets
    /// and ends.
    terminate: CancellationToken,
}

impl Default for Drain {
    fn default() -> Self {
        let terminate = CancellationToken::new();
        Drain {
            shutdown: CancellationToken::new(),
            reason: OnceLock::new(),
            started_at: OnceLock::new(),
            phase: AtomicU8::new(Phase::Starting as u8),
            inbound: Mutex::new(Arc::new(Side::new(Direction::Inbound, &terminate))),
            outbound: Arc::new(Side::new(Direction::Outbound, &terminate)),
            inbound_quiesced: Mutex::new(None),
            terminate,
        }
    }
}

impl Drain {
    /// Starts the shutdown. Returns false (and changes nothing) when it had already started.
    pub fn trigger(&self, reason: ShutdownReason) -> bool {
        if self.reason.set(reason).is_err() {
            return false;
        }
        let _ = self.started_at.set((Instant::now(), SystemTime::now()));
        self.set_phase(Phase::LameDuck);
        self.shutdown.cancel();
        true
    }

    /// Resolves once the shutdown has been triggered.
    pub async fn triggered(&self) -> ShutdownReason {
        self.shutdown.cancelled().await;
        *self
            .reason
            .get()
            .expect("the reason is set before the token is cancelled")
    }

    pub fn reason(&self) -> Option<ShutdownReason> {
        self.reason.get().copied()
    }

    /// When the shutdown started: a monotonic instant for deadlines and wall time for metrics.
    pub fn started_at(&self) -> Option<(Instant, SystemTime)> {
        self.started_at.get().copied()
    }

    pub fn phase(&self) -> Phase {
        Phase::ALL[self.phase.load(Ordering::Acquire) as usize]
    }

    pub fn set_phase(&self, phase: Phase) {
        self.phase.store(phase as u8, Ordering::Release);
    }

    /// Marks the proxy as serving, unless a shutdown already started (a signal during start-up).
    pub fn start_serving(&self) {
        let _ = self.phase.compare_exchange(
            Phase::Starting as u8,
            Phase::Serving as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// What `/ready` reports: true only while serving with the inbound side open.
    pub fn is_ready(&self) -> bool {
        self.phase() == Phase::Serving && !self.is_inbound_quiesced()
    }

    pub fn is_inbound_quiesced(&self) -> bool {
        self.inbound_quiesced_at().is_some()
    }

    /// When the inbound side was quiesced, while it is.
    pub fn inbound_quiesced_at(&self) -> Option<Instant> {
        *lock(&self.inbound_quiesced)
    }

    pub fn set_inbound_quiesced(&self, quiesced: bool) {
        *lock(&self.inbound_quiesced) = quiesced.then(Instant::now);
    }

    /// The side of `direction` serving now.
    pub fn side(&self, direction: Direction) -> Arc<Side> {
        match direction {
            Direction::Inbound => lock(&self.inbound).clone(),
            Direction::Outbound => self.outbound.clone(),
        }
    }

    /// Resets every connection now, on every side (those of inbound sides replaced after a
    /// quiesce too), and closes the listeners without waiting.
    pub fn force_close(&self) {
        self.terminate.cancel();
        for direction in [Direction::Inbound, Direction::Outbound] {
            self.side(direction).force_close();
        }
    }

    /// Resolves once every connection task of the current sides has ended.
    pub async fn drained(&self) {
        let (inbound, outbound) = (
            self.side(Direction::Inbound),
            self.side(Direction::Outbound),
        );
        tokio::join!(inbound.drained(), outbound.drained());
    }

    /// Puts a fresh inbound side in place of the current one and returns both (new, old).
    pub fn renew_inbound(&self) -> (Arc<Side>, Arc<Side>) {
        let fresh = Arc::new(Side::new(Direction::Inbound, &self.terminate));
        let old = std::mem::replace(&mut *lock(&self.inbound), fresh.clone());
        (fresh, old)
    }
}

pin_project_lite::pin_project! {
    /// `token.cancelled()` for a future that is polled many times before the token is cancelled
    /// (a connection's select between serving and the drain): once its waker is registered with
    /// the token, a poll with the same waker is one atomic load instead of a poll of the token's
    /// `Notified` (which takes the token's lock). The token wakes that waker when it is cancelled.
    pub struct Cancelled<'a> {
        token: &'a CancellationToken,
        #[pin]
        wait: WaitForCancellationFuture<'a>,
        registered: Option<Waker>,
    }
}

impl<'a> Cancelled<'a> {
    pub fn new(watch: &'a Watch) -> Cancelled<'a> {
        let token = &watch.0;
        Cancelled {
            token,
            wait: token.cancelled(),
            registered: None,
        }
    }
}

impl Future for Cancelled<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.project();
        if this.token.is_cancelled() {
            return Poll::Ready(());
        }
        if let Some(waker) = this.registered.as_ref()
            && waker.will_wake(cx.waker())
        {
            return Poll::Pending;
        }
        if this.wait.poll(cx).is_ready() {
            return Poll::Ready(());
        }
        *this.registered = Some(cx.waker().clone());
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn cancelled_wakes_the_task_that_polled_it_when_the_token_is_cancelled() {
        let token = CancellationToken::new();
        let waiter = {
            let watch = Watch(token.clone());
            tokio::spawn(async move {
                let mut cancelled = std::pin::pin!(Cancelled::new(&watch));
                // Pending twice with the same waker: the second poll is the cheap one.
                for _ in 0..2 {
                    let pending = std::future::poll_fn(|cx| {
                        Poll::Ready(cancelled.as_mut().poll(cx).is_pending())
                    });
                    assert!(pending.await);
                }
                cancelled.await;
            })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished());
        token.cancel();
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("the cancelled future woke its task")
            .expect("the task ran to its end");
    }
}
