//! Bind first, run second.
//!
//! [`build`] binds the admin socket and every route's listener and returns a [`Bound`] holding
//! the real addresses (port 0 in tests becomes a real port). [`Bound::run`] is the lifecycle of
//! docs/lifecycle.md, top to bottom: serve until a trigger, then lame duck, close listeners,
//! drain, and exit as soon as the last connection closes or reset the rest when the grace
//! period runs out. It returns the [`Exit`] that `main` turns into the process status.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, UnixListener};
use tracing::{info, warn};

use crate::admin::{self, Admin, Prober};
use crate::close_spread;
use crate::config::{Config, Direction, LameDuck as LameDuckPolicy, OutboundShutdown, Route};
use crate::conns::Connections;
use crate::drain::{Drain, Phase, ShutdownReason, signal_name};
use crate::lame_duck::LameDuck;
use crate::logging::Throttle;
use crate::metrics::Metrics;
use crate::net;
use crate::proxy::{self, Handoff, ProxyContext, ProxyRoute};
use crate::quiesce::{self, InboundControl};
use crate::signals::ShutdownSignals;

/// How often the drain reports its progress in the log.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(5);
/// How long reset connections get to finish their tasks before the process exits anyway.
const FORCE_CLOSE_WAIT: Duration = Duration::from_secs(1);

/// A socket could not be bound: which one, where, and why.
#[derive(Debug)]
pub struct BuildError {
    what: String,
    at: String,
    source: io::Error,
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "failed to bind the {} on {}: {}",
            self.what, self.at, self.source
        )
    }
}

impl std::error::Error for BuildError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// How the process ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// Drained, or the grace period ran out and the rest was reset: status 0.
    Graceful,
    /// A second SIGTERM or SIGINT stopped the drain: status 128 + the signal.
    Forced(i32),
}

impl Exit {
    pub fn code(self) -> i32 {
        match self {
            Exit::Graceful => 0,
            Exit::Forced(signal) => 128 + signal,
        }
    }
}

/// Every socket bound, nothing served yet.
pub struct Bound {
    config: Config,
    admin: TcpListener,
    admin_addr: SocketAddr,
    /// Each route with its real listen address, and its listener.
    listeners: Vec<Listener>,
    /// The control socket of the inbound quiesce, when configured.
    control: Option<(PathBuf, UnixListener)>,
}

/// A route's bound listener.
struct Listener {
    route: Arc<Route>,
    v6_only: bool,
    socket: TcpListener,
}

/// Binds the admin server and every route. Must run inside a Tokio runtime.
pub fn build(config: Config) -> Result<Bound, BuildError> {
    let admin = net::bind(config.admin, false).map_err(|source| BuildError {
        what: "admin server".into(),
        at: config.admin.to_string(),
        source,
    })?;
    let admin_addr = admin.local_addr().unwrap_or(config.admin);
    let mut listeners = Vec::with_capacity(config.routes.len());
    let listens: Vec<SocketAddr> = config.routes.iter().map(|route| route.listen).collect();
    for route in &config.routes {
        let v6_only = net::v6_only(route.listen, &listens);
        let bound = match net::bind(route.listen, v6_only) {
            // A node without IPv6 (ipv6.disable=1): the IPv4 sibling serves the port alone.
            Err(error) if v6_only && net::is_ipv6_unavailable(&error) => {
                warn!(listen = %route.listen, %error, "no IPv6 here; this route listens on IPv4 only");
                continue;
            }
            bound => bound,
        };
        let bound = bound.map_err(|source| BuildError {
            what: format!("{} listener", route.direction),
            at: route.listen.to_string(),
            source,
        })?;
        let listen = bound.local_addr().unwrap_or(route.listen);
        listeners.push(Listener {
            route: Arc::new(Route {
                listen,
                ..Route::clone(route)
            }),
            v6_only,
            socket: bound,
        });
    }
    let control = match &config.drain_socket {
        Some(path) => Some((
            path.clone(),
            quiesce::bind(path).map_err(|source| BuildError {
                what: "control socket".into(),
                at: path.display().to_string(),
                source,
            })?,
        )),
        None => None,
    };
    Ok(Bound {
        config,
        admin,
        admin_addr,
        listeners,
        control,
    })
}

impl Bound {
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// The real listen address of every route, in configuration order.
    pub fn route_addrs(&self) -> Vec<(Direction, SocketAddr)> {
        self.listeners
            .iter()
            .map(|listener| (listener.route.direction, listener.route.listen))
            .collect()
    }

    /// Serves, then shuts down, step by step as docs/lifecycle.md describes them.
    pub async fn run(self, mut signals: ShutdownSignals) -> Exit {
        // Start: the admin server, every route's accept loop, the drain socket.
        let running = self.start();
        if signals.arrived() {
            info!("a shutdown signal arrived during start-up");
        } else {
            running.drain.start_serving();
            info!("serving");
        }
        // Serve until SIGTERM, SIGINT or POST /shutdown.
        let reason = running.until_triggered(&mut signals).await;
        // Lame duck, close the listeners, drain; at the deadline or a second signal, reset
        // whatever is left.
        running.shut_down(reason, &mut signals).await
    }

    /// Spawns the admin server, every route's accept loop and the drain socket's server.
    fn start(self) -> Running {
        let Bound {
            config,
            admin,
            admin_addr,
            listeners,
            control,
        } = self;
        let drain = Arc::new(Drain::default());
        let conns = Arc::new(Connections::default());
        let metrics = Arc::new(Metrics::new(conns.clone(), drain.clone()));
        let lame_duck = Arc::new(LameDuck::new(config.lame_duck, metrics.clone()));
        if matches!(config.lame_duck, LameDuckPolicy::Adaptive { .. }) {
            // The rate the inbound side served before a lame duck tells how telling its
            // silences are (src/arrivals.rs).
            tokio::spawn(lame_duck.clone().sample_every_second());
        }
        let admin_state = Admin {
            drain: drain.clone(),
            conns: conns.clone(),
            metrics: metrics.clone(),
            shutdown_endpoint: config.shutdown_endpoint,
            grace_period: config.shutdown_grace_period,
            lame_duck: lame_duck.clone(),
            prober: Prober::new(config.app_probes.clone(), config.pod_ip),
        };
        if !config.app_probes.is_empty() {
            info!(
                probes = config.app_probes.len(),
                pod_ip = %config.pod_ip,
                "running the app's probes for the kubelet on /app-health/"
            );
        }
        tokio::spawn(admin::serve(admin, Arc::new(admin_state)));
        info!(listen = %admin_addr, shutdown_endpoint = config.shutdown_endpoint, "admin server listening");

        let max_connections = net::connection_limit();
        metrics.set_connection_limit(max_connections);
        info!(
            max_connections,
            "connection limit from the file-descriptor limit"
        );
        let proxy = Arc::new(ProxyContext {
            drain: drain.clone(),
            conns: conns.clone(),
            metrics: metrics.clone(),
            connect_timeout: config.connect_timeout,
            http: config.http.clone(),
            tcp: config.tcp,
            limit: Arc::new(tokio::sync::Semaphore::new(max_connections)),
            listeners: listeners
                .iter()
                .map(|listener| listener.route.listen)
                .chain([admin_addr])
                .collect(),
            own_ports: Arc::default(),
            refusal_log: Mutex::new(Throttle::new(Duration::from_secs(1))),
            lame_duck_ignore_sources: matches!(config.lame_duck, LameDuckPolicy::Adaptive { .. })
                .then(|| config.lame_duck_ignore_sources.clone()),
            handoff: Handoff::new(
                &config.handoffs,
                &config.pod_ip.to_string(),
                config.connect_timeout,
                &metrics,
            )
            .map(Arc::new),
        });
        let mut inbound_routes = Vec::new();
        for Listener {
            route,
            v6_only,
            socket,
        } in listeners
        {
            info!(direction = %route.direction, listen = %route.listen, target = %route.target, protocol = route.protocol.as_str(), "listening");
            let served = Arc::new(ProxyRoute::new(
                route.clone(),
                v6_only,
                config.connect_timeout,
                &proxy,
            ));
            if route.direction == Direction::Inbound {
                inbound_routes.push(served.clone());
            }
            let side = drain.side(route.direction);
            side.spawn_accept_loop(proxy::accept::accept_loop(
                socket,
                served,
                proxy.clone(),
                side.clone(),
            ));
        }
        if let Some((path, socket)) = control {
            let inbound = Arc::new(InboundControl::new(
                proxy.clone(),
                inbound_routes,
                lame_duck.clone(),
                config.shutdown_grace_period,
                config.close_spread_window,
            ));
            info!(path = %path.display(), "control socket listening (inbound quiesce for preStop hooks)");
            tokio::spawn(quiesce::serve(socket, path, inbound));
        }
        Running {
            config,
            drain,
            conns,
            metrics,
            lame_duck,
        }
    }
}

/// The proxy once started: what the shutdown needs.
struct Running {
    config: Config,
    drain: Arc<Drain>,
    conns: Arc<Connections>,
    metrics: Arc<Metrics>,
    lame_duck: Arc<LameDuck>,
}

impl Running {
    /// Serves until the first trigger: a signal, or `POST /shutdown` (which triggers the drain
    /// itself).
    async fn until_triggered(&self, signals: &mut ShutdownSignals) -> ShutdownReason {
        tokio::select! {
            // The kubelet, a supervisor or an operator sent SIGTERM or SIGINT.
            signal = signals.next() => {
                self.drain.trigger(ShutdownReason::Signal(signal));
                self.drain.reason().unwrap_or(ShutdownReason::Signal(signal))
            }
            // A loopback client posted /shutdown.
            reason = self.drain.triggered() => reason,
        }
    }

    /// Runs the drain sequence until every connection has closed, the grace period runs out,
    /// or a second signal asks to stop now.
    async fn shut_down(&self, reason: ShutdownReason, signals: &mut ShutdownSignals) -> Exit {
        let (exit, ending) = self.drain_until_done(reason, signals).await;
        if let Some(path) = &self.config.termination_log {
            let message = self.termination_message(reason, &ending);
            // The kubelet reads at most 4096 bytes of it.
            let message = &message[..floor_char_boundary(&message, 4096)];
            if let Err(error) = std::fs::write(path, message) {
                warn!(path = %path.display(), %error, "cannot write the termination message");
            }
        }
        exit
    }

    /// What `kubectl describe pod` shows of the proxy's exit: how its shutdown ended, how long
    /// it took, the lame duck, the late connections, and what was reset.
    fn termination_message(&self, reason: ShutdownReason, ending: &Ending) -> String {
        let took = self
            .drain
            .started_at()
            .map_or(Duration::ZERO, |(started, _)| started.elapsed());
        let seconds = |duration: Duration| format!("{:.1} s", duration.as_secs_f64());
        let mut message = match ending {
            Ending::Drained => format!(
                "lameduck: shutdown by {reason}: drained in {}",
                seconds(took)
            ),
            Ending::Reset { why, survivors } => format!(
                "lameduck: shutdown by {reason}: {why} after {}; {} connections reset{}",
                seconds(took),
                survivors.len(),
                match survivors.first() {
                    Some(first) => format!(", the first: {first}"),
                    None => String::new(),
                }
            ),
        };
        message.push_str(&format!(
            " (grace period {})",
            humantime::format_duration(self.config.shutdown_grace_period)
        ));
        let lame_duck = self.lame_duck.status();
        if let Some(lasted) = lame_duck["lasted_ms"].as_u64() {
            message.push_str(&format!(
                "; lame duck {} ({})",
                seconds(Duration::from_millis(lasted)),
                lame_duck["ended"].as_str().unwrap_or("ended"),
            ));
        }
        let inbound = self.drain.side(Direction::Inbound);
        let (late, _) = inbound.late();
        if late > 0 {
            let (handed_off, _) = inbound.handoffs();
            message.push_str(&format!(
                "; {late} late connections ({handed_off} handed off to the Service, {} refused)",
                late - handed_off
            ));
        }
        message.push('\n');
        message
    }

    /// Runs the drain and returns how the process ends, and how the drain did.
    async fn drain_until_done(
        &self,
        reason: ShutdownReason,
        signals: &mut ShutdownSignals,
    ) -> (Exit, Ending) {
        let (drain, config) = (&self.drain, &self.config);
        let (started, _) = drain
            .started_at()
            .expect("the drain records when it was triggered");
        let deadline = started + config.shutdown_grace_period;
        info!(
            trigger = %reason,
            grace_period = %humantime::format_duration(config.shutdown_grace_period),
            close_spread_window = %humantime::format_duration(config.close_spread_window),
            lame_duck = %config.lame_duck,
            open_connections = self.conns.len(),
            "shutdown started"
        );
        let sequence = drain_sequence(drain, config, &self.lame_duck, deadline);
        tokio::pin!(sequence);
        // The last part of the grace period: what is still open then is ended one by one.
        let spread = async {
            let window = config.close_spread_window;
            let (inbound, outbound) = (
                drain.side(Direction::Inbound),
                drain.side(Direction::Outbound),
            );
            let conns = &self.conns;
            tokio::join!(
                close_spread::open(&inbound, Direction::Inbound, conns, window, deadline),
                close_spread::open(&outbound, Direction::Outbound, conns, window, deadline),
            );
            std::future::pending::<()>().await
        };
        tokio::pin!(spread);
        let mut progress =
            tokio::time::interval_at((started + PROGRESS_INTERVAL).into(), PROGRESS_INTERVAL);
        loop {
            tokio::select! {
                // The last connection closed.
                () = &mut sequence => {
                    info!(elapsed_ms = started.elapsed().as_millis() as u64, "drained: every connection closed, exiting");
                    return (Exit::Graceful, Ending::Drained);
                }
                // The grace period ran out.
                () = tokio::time::sleep_until(deadline.into()) => {
                    let why = "the grace period ran out";
                    let survivors = self.force_close(why).await;
                    return (Exit::Graceful, Ending::Reset { why, survivors });
                }
                // Never resolves: it opens the close-spread window when its time comes.
                () = &mut spread => {}
                // A second SIGTERM or SIGINT: stop now.
                signal = signals.next() => {
                    warn!(signal = signal_name(signal), "second shutdown signal: stopping now");
                    let why = "a second signal asked to stop now";
                    let survivors = self.force_close(why).await;
                    return (Exit::Forced(signal), Ending::Reset { why, survivors });
                }
                // Time to tell the operator how the drain is going.
                _ = progress.tick() => {
                    let left = deadline.saturating_duration_since(std::time::Instant::now());
                    info!(
                        phase = drain.phase().as_str(),
                        open_connections = self.conns.len(),
                        grace_left_ms = left.as_millis() as u64,
                        "draining"
                    );
                }
            }
        }
    }

    /// Resets every connection still open, then names each in the log (reset first: the lines
    /// of thousands of survivors must not delay their resets).
    async fn force_close(&self, why: &str) -> Vec<String> {
        self.drain.set_phase(Phase::Terminating);
        let survivors = self.conns.snapshot();
        warn!(
            connections = survivors.len(),
            "{why}: resetting the remaining connections"
        );
        self.metrics
            .force_closed(survivors.iter().map(|conn| conn.protocol()));
        self.drain.force_close();
        let closed = tokio::time::timeout(FORCE_CLOSE_WAIT, self.drain.drained()).await;
        for conn in &survivors {
            warn!("force-closing {}", conn.describe());
        }
        if closed.is_err() {
            warn!("some connection tasks did not finish in time; exiting anyway");
        }
        survivors.iter().map(|conn| conn.describe()).collect()
    }
}

/// How a drain ended.
enum Ending {
    /// Every connection closed by itself.
    Drained,
    /// The rest was reset: why, and those reset.
    Reset {
        why: &'static str,
        survivors: Vec<String>,
    },
}

/// The longest prefix of `text` of at most `max` bytes that ends on a character boundary.
fn floor_char_boundary(text: &str, max: usize) -> usize {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    end
}

/// Lame duck, then close the listeners, then wait until every connection has closed, and while
/// late connections may still come, linger. After an inbound quiesce (the app's preStop hook)
/// the lame duck has been served already: peers have stopped routing to the pod, and the app has
/// exited (a native sidecar is signalled last).
async fn drain_sequence(
    drain: &Drain,
    config: &Config,
    lame_duck: &LameDuck,
    deadline: std::time::Instant,
) {
    let after_inbound = config.outbound_shutdown == OutboundShutdown::AfterInbound;
    let (inbound, outbound) = (
        drain.side(Direction::Inbound),
        drain.side(Direction::Outbound),
    );
    inbound.go_away();
    if !after_inbound {
        outbound.go_away();
    }
    if drain.is_inbound_quiesced() {
        info!("the inbound side was quiesced already: no lame duck");
    } else {
        // Every listener still accepting counts: new connections on any of them mean peers
        // still send here.
        let mut sides = vec![inbound.clone()];
        if !after_inbound {
            sides.push(outbound.clone());
        }
        lame_duck.run(&sides).await;
    }
    drain.set_phase(Phase::Draining);
    if after_inbound {
        inbound.close().await;
        inbound.drained().await;
        info!("inbound side drained; closing the outbound listeners");
        outbound.go_away();
        outbound.close().await;
        outbound.drained().await;
    } else {
        tokio::join!(inbound.close(), outbound.close());
        tokio::join!(inbound.drained(), outbound.drained());
    }
    // Never a black hole: while late connections may still come, the pod's address answers.
    // After an inbound quiesce the pod's termination began with it (the preStop hook): the
    // linger ends within the grace period counted from there, so that the kubelet's deadline
    // (the grace period, the app's own budget and 5 s, docs/pod-lifecycle.md) never finds the
    // proxy lingering, however long the app took to exit.
    let linger_until = drain.inbound_quiesced_at().map_or(deadline, |quiesced| {
        deadline.min(quiesced + config.shutdown_grace_period)
    });
    lame_duck.linger(&inbound, linger_until.into()).await;
    // The late connections handed off to the pod's Service finish (within the grace period).
    inbound.drained().await;
}
