//! The inbound side's quiesce, and its return to service (docs/pod-lifecycle.md).
//!
//! In a pod, a native sidecar is signalled only after every app container has exited, so the
//! proxy's own shutdown comes too late to protect the app's inbound traffic. The app
//! containers' `preStop` hooks (`lameduck prestop`, see [`crate::hook`]) ask the proxy instead,
//! before the kubelet signals the app, to quiesce its **inbound** side: `/ready` 503, the
//! lame-duck period (still accepting, every inbound HTTP connection asked to go away), then the
//! inbound listeners close and inbound connections drain, bounded by the grace period (the
//! rest reset). The hook returns when that is done. The outbound side is not touched: the app
//! still calls out while it shuts down.
//!
//! A `preStop` hook also runs before the kubelet restarts a container (a failed liveness
//! probe), and then no SIGTERM follows: the app container's `postStart` hook (`lameduck
//! poststart`) asks the proxy to [`resume`](InboundControl::resume), which binds the inbound
//! listeners again on a fresh inbound [`Side`](crate::drain::Side).
//!
//! The requests arrive on a Unix socket in the pod's shared `emptyDir` ([`serve`]), not on the
//! admin port: nothing outside the pod can reach it, and an app's server-side request forgery
//! (which makes the app send HTTP to an address of the attacker's choice) cannot either.
//!
//! In legacy mode (the proxy an ordinary container, signalled at t = 0 with the app) the
//! proxy's own preStop hook waits until every app container has exited, so that its SIGTERM,
//! and the close of its outbound side, come after the app's end as with a native sidecar.
//! Each app container's postStart hook leaves a process behind that **holds** a connection
//! to this socket; the kernel kills it with the container (it lives in the container's PID
//! namespace), and the connection closes: `apps-gone` answers once no hold is left.
//!
//! The protocol is one line from the client (`quiesce`, `resume`, `hold` or `apps-gone`),
//! then lines from the proxy: progress, and a last line that starts with `ok ` or `error `
//! (`hold` answers `ok holding` and then keeps the connection until the client closes it).

use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::close_spread;
use crate::config::Direction;
use crate::drain::Side;
use crate::lame_duck::LameDuck;
use crate::net;
use crate::proxy::{self, ProxyContext, ProxyRoute};

/// How long a client may take to send its one-line request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long reset connections get to finish their tasks after the grace period.
const RESET_WAIT: Duration = Duration::from_secs(1);
/// The longest request line accepted.
const MAX_REQUEST: usize = 64;

/// How a quiesce ended.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// From the request to the end of the inbound drain.
    pub elapsed: Duration,
    /// Inbound connections reset when the grace period ran out (0: drained).
    pub reset: usize,
}

impl Outcome {
    fn line(&self) -> String {
        let ms = self.elapsed.as_millis();
        match self.reset {
            0 => format!("ok inbound drained in {ms} ms\n"),
            reset => format!(
                "ok grace period ran out after {ms} ms: reset {reset} inbound connections\n"
            ),
        }
    }
}

enum State {
    Serving,
    /// Quiesced (or quiescing): the receiver gives the outcome once the drain has ended.
    Quiesced(watch::Receiver<Option<Outcome>>),
}

/// Quiesces and resumes the inbound side.
pub struct InboundControl {
    /// The drain and the registry of connections are the proxy's.
    proxy: Arc<ProxyContext>,
    /// Every inbound route, with its real listen address, to bind again on resume.
    routes: Vec<Arc<ProxyRoute>>,
    /// The proxy's lame duck, shared with the shutdown and `/status`.
    lame_duck: Arc<LameDuck>,
    grace: Duration,
    /// The close-spread window at the end of `grace`.
    close_spread_window: Duration,
    state: tokio::sync::Mutex<State>,
    /// How many app containers hold a connection (legacy mode), and how many ever did.
    holds: watch::Sender<(usize, usize)>,
}

impl InboundControl {
    pub fn new(
        proxy: Arc<ProxyContext>,
        routes: Vec<Arc<ProxyRoute>>,
        lame_duck: Arc<LameDuck>,
        grace: Duration,
        close_spread_window: Duration,
    ) -> InboundControl {
        InboundControl {
            proxy,
            routes,
            lame_duck,
            grace,
            close_spread_window,
            state: tokio::sync::Mutex::new(State::Serving),
            holds: watch::Sender::new((0, 0)),
        }
    }

    /// Counts one app container as running until `client` closes its connection.
    async fn hold(&self, client: tokio::net::unix::OwnedReadHalf) {
        self.holds.send_modify(|(now, ever)| {
            *now += 1;
            *ever += 1;
        });
        let mut client = client;
        let mut sink = [0u8; 64];
        while matches!(client.read(&mut sink).await, Ok(n) if n > 0) {}
        self.holds.send_modify(|(now, _)| *now -= 1);
    }

    /// Resolves once no app container holds a connection; how many ever did.
    async fn apps_gone(&self) -> usize {
        let mut holds = self.holds.subscribe();
        let _ = holds.wait_for(|(now, _)| *now == 0).await;
        holds.borrow().1
    }

    /// Starts the quiesce unless it has started already; the receiver yields its outcome.
    pub async fn quiesce(self: &Arc<Self>) -> watch::Receiver<Option<Outcome>> {
        let mut state = self.state.lock().await;
        if let State::Quiesced(outcome) = &*state {
            return outcome.clone();
        }
        let (sender, receiver) = watch::channel(None);
        *state = State::Quiesced(receiver.clone());
        self.proxy.drain.set_inbound_quiesced(true);
        let side = self.proxy.drain.side(Direction::Inbound);
        let control = self.clone();
        tokio::spawn(async move {
            let outcome = control.run(&side).await;
            match outcome.reset {
                0 => info!(
                    elapsed_ms = outcome.elapsed.as_millis() as u64,
                    "inbound side drained"
                ),
                reset => warn!(
                    elapsed_ms = outcome.elapsed.as_millis() as u64,
                    reset, "inbound quiesce: the grace period ran out; reset the rest"
                ),
            }
            let _ = sender.send(Some(outcome));
        });
        receiver
    }

    /// Lame duck, close the inbound listeners, drain; reset what is left at the grace period.
    async fn run(&self, side: &Arc<Side>) -> Outcome {
        let started = Instant::now();
        let deadline = started + self.grace;
        let shutting_down = self.proxy.drain.reason().is_some();
        info!(
            lame_duck = %self.lame_duck.policy(),
            grace_period = %humantime::format_duration(self.grace),
            inbound_connections = self.inbound_open(),
            "inbound quiesce: /ready 503, asking inbound connections to go away"
        );
        side.go_away();
        let conns = &self.proxy.conns;
        let window = self.close_spread_window;
        let drained = tokio::time::timeout_at(deadline.into(), async {
            // The last part of the grace period: what is still open then is ended one by one.
            let spread = async {
                close_spread::open(side, Direction::Inbound, conns, window, deadline).await;
                std::future::pending::<()>().await
            };
            let drain = async {
                if shutting_down {
                    // The shutdown's own sequence runs the lame duck and closes the listeners.
                    side.listeners_closed().await;
                } else {
                    self.lame_duck.run(std::slice::from_ref(side)).await;
                    side.close().await;
                    info!("inbound quiesce: inbound listeners closed, draining");
                }
                side.drained().await;
            };
            tokio::select! {
                () = spread => {}
                () = drain => {}
            }
        })
        .await;
        let mut reset = 0;
        if drained.is_err() {
            let survivors: Vec<_> = conns
                .snapshot()
                .into_iter()
                .filter(|conn| conn.direction() == Direction::Inbound)
                .collect();
            reset = survivors.len();
            self.proxy
                .metrics
                .force_closed(survivors.iter().map(|conn| conn.protocol()));
            side.force_close();
            let _ = tokio::time::timeout(RESET_WAIT, side.drained()).await;
        }
        Outcome {
            elapsed: started.elapsed(),
            reset,
        }
    }

    fn inbound_open(&self) -> usize {
        self.proxy
            .conns
            .snapshot()
            .iter()
            .filter(|conn| conn.direction() == Direction::Inbound)
            .count()
    }

    /// Serves inbound again after a quiesce (the app container restarted): waits for the
    /// quiesce to end, binds the inbound listeners anew, `/ready` 200 again.
    pub async fn resume(&self) -> Result<&'static str, String> {
        let mut state = self.state.lock().await;
        let State::Quiesced(outcome) = &mut *state else {
            return Ok("inbound side already serving");
        };
        if self.proxy.drain.reason().is_some() {
            return Err("the proxy is shutting down".into());
        }
        let _ = outcome.wait_for(Option::is_some).await;
        // The old side's listeners may still refuse late connections on the same ports.
        self.proxy
            .drain
            .side(Direction::Inbound)
            .stop_refusing()
            .await;
        let mut bound = Vec::with_capacity(self.routes.len());
        for proxy_route in &self.routes {
            let listen = proxy_route.route.listen;
            let listener = net::bind(listen, proxy_route.v6_only)
                .map_err(|error| format!("cannot bind the inbound listener {listen}: {error}"))?;
            bound.push((proxy_route.clone(), listener));
        }
        if self.proxy.drain.reason().is_some() {
            return Err("the proxy is shutting down".into());
        }
        let (side, _) = self.proxy.drain.renew_inbound();
        for (proxy_route, listener) in bound {
            side.spawn_accept_loop(proxy::accept::accept_loop(
                listener,
                proxy_route,
                self.proxy.clone(),
                side.clone(),
            ));
        }
        *state = State::Serving;
        self.proxy.drain.set_inbound_quiesced(false);
        info!("inbound side serving again");
        Ok("inbound side serving again")
    }
}

/// Binds the control socket at `path`: a stale socket left by an earlier run is replaced; any
/// other file there is an error. Any user may connect (the app containers run as users of
/// their own); only containers that mount the volume can see it.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path)?,
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "a file that is not a socket is in the way",
            ));
        }
        Err(error) if error.kind() == io::ErrorKind::NotFound => {}
        Err(error) => return Err(error),
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(listener)
}

/// Answers requests on the control socket until the process exits.
pub async fn serve(listener: UnixListener, path: PathBuf, control: Arc<InboundControl>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(answer(stream, control.clone()));
            }
            Err(error) => {
                warn!(path = %path.display(), %error, "control socket: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn answer(stream: UnixStream, control: Arc<InboundControl>) {
    let who = match stream.peer_cred() {
        // The pid is 0 when the peer is in another PID namespace (another container).
        Ok(cred) => match cred.pid().filter(|pid| *pid > 0) {
            Some(pid) => format!("uid {} pid {pid}", cred.uid()),
            None => format!("uid {}", cred.uid()),
        },
        Err(_) => "an unknown peer".into(),
    };
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let mut reader = BufReader::new(read).take(MAX_REQUEST as u64);
    let request = tokio::time::timeout(REQUEST_TIMEOUT, reader.read_line(&mut line)).await;
    let reply = match request {
        Ok(Ok(_)) => match line.trim() {
            "quiesce" => {
                info!(from = %who, "inbound quiesce requested (preStop)");
                let mut outcome = control.quiesce().await;
                let _ = write
                    .write_all(
                        format!(
                            "quiescing inbound: lame duck {}, grace period {}, {} inbound connections open\n",
                            control.lame_duck.policy(),
                            humantime::format_duration(control.grace),
                            control.inbound_open()
                        )
                        .as_bytes(),
                    )
                    .await;
                match outcome.wait_for(Option::is_some).await {
                    Ok(done) => done.as_ref().map_or_else(String::new, Outcome::line),
                    Err(_) => "error the quiesce ended without an outcome\n".into(),
                }
            }
            "hold" => {
                let _ = write.write_all(b"ok holding\n").await;
                info!(from = %who, "an app container holds the control socket (legacy mode)");
                control.hold(reader.into_inner().into_inner()).await;
                info!(from = %who, "an app container let go of the control socket: it has exited");
                return;
            }
            "apps-gone" => {
                info!(from = %who, "waiting until every app container has exited (legacy mode)");
                let ever = control.apps_gone().await;
                info!(app_containers = ever, "every app container has exited");
                format!("ok every app container has exited ({ever} held the socket)\n")
            }
            "resume" => {
                info!(from = %who, "inbound resume requested (postStart)");
                match control.resume().await {
                    Ok(what) => format!("ok {what}\n"),
                    Err(error) => {
                        warn!(%error, "inbound resume refused");
                        format!("error {error}\n")
                    }
                }
            }
            other => format!(
                "error unknown request {other:?}; expected quiesce, resume, hold or apps-gone\n"
            ),
        },
        Ok(Err(error)) => format!("error cannot read the request: {error}\n"),
        Err(_) => "error no request within 5 s\n".into(),
    };
    let _ = write.write_all(reply.as_bytes()).await;
    let _ = write.shutdown().await;
}
