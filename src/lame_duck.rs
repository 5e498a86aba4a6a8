//! The lame duck: once the shutdown or the inbound quiesce has started, listeners keep
//! accepting, every connection asked to go away, for as long as the rest of the cluster still
//! sends new connections here (docs/pod-lifecycle.md).
//!
//! A fixed period is a guess at how long kube-proxy, ingresses and load balancers take to
//! forget a pod (0.2 s to minutes). The adaptive lame duck measures it instead: every
//! connection accepted meanwhile is asked to go away after its request, so its client comes
//! back through the Service and, if the endpoint still points here, arrives again. The lame
//! duck ends once no new connection has arrived for the quiet window, never before the
//! minimum and never after the maximum. New connections from ignored sources (the kubelet's
//! probes come from the node's address) do not count; the admin port is no route and never
//! counts. The accept loops record arrivals on their [`Side`]; this module only reads them.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use serde_json::{Value, json};
use tracing::info;

use crate::config::LameDuck as Policy;
use crate::drain::{Arrival, Side};
use crate::metrics::Metrics;
use crate::sync::lock;

/// How often an open lame duck says, in the log, why it is still open.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(1);

/// Why a lame duck ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// No new connection for the quiet window (the last one, if any came since the start).
    Quiet(Option<Arrival>),
    /// New connections were still arriving when the maximum was reached.
    Max(Option<Arrival>),
    /// A fixed period is over.
    Period,
}

impl Ending {
    pub fn as_str(self) -> &'static str {
        match self {
            Ending::Quiet(_) => "quiet",
            Ending::Max(_) => "max",
            Ending::Period => "period",
        }
    }
}

/// Where a lame duck is, for `/status`.
#[derive(Clone, Copy, Debug)]
enum State {
    NotStarted,
    Open { since: Instant },
    Ended { lasted: Duration, why: Ending },
}

/// The lame duck of one proxy: its policy, and what the current or last one did.
#[derive(Debug)]
pub struct LameDuck {
    policy: Policy,
    metrics: Arc<Metrics>,
    state: Mutex<State>,
    /// The sides whose arrivals the open lame duck watches (for `/status`).
    watching: Mutex<Vec<Arc<Side>>>,
}

impl LameDuck {
    pub fn new(policy: Policy, metrics: Arc<Metrics>) -> LameDuck {
        LameDuck {
            policy,
            metrics,
            state: Mutex::new(State::NotStarted),
            watching: Mutex::new(Vec::new()),
        }
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Runs a lame duck over `sides` (their listeners accepting, their connections asked to
    /// go away by the caller) until it ends; a zero fixed period ends at once, unlogged.
    pub async fn run(&self, sides: &[Arc<Side>]) -> Ending {
        let started = Instant::now();
        if self.policy == Policy::Fixed(Duration::ZERO) {
            return Ending::Period;
        }
        *lock(&self.state) = State::Open { since: started };
        *lock(&self.watching) = sides.to_vec();
        info!(lame_duck = %self.policy, "lame duck: still accepting, asking connections to go away");
        let why = match self.policy {
            Policy::Fixed(period) => {
                tokio::time::sleep(period).await;
                Ending::Period
            }
            Policy::Adaptive { quiet, min, max } => {
                let mut progress =
                    tokio::time::interval_at(started + PROGRESS_INTERVAL, PROGRESS_INTERVAL);
                loop {
                    let last = last_arrival(sides).filter(|arrival| arrival.at >= started);
                    let (end, why) = adaptive_end(started, last, quiet, min, max);
                    if Instant::now() >= end {
                        break why;
                    }
                    tokio::select! {
                        // The window as it stands is over: look again at the arrivals.
                        () = tokio::time::sleep_until(end) => {}
                        // Time to say why it is still open.
                        _ = progress.tick() => match last {
                            Some(arrival) => info!(
                                last_arrival_ms_ago = arrival.at.elapsed().as_millis() as u64,
                                from = %arrival.from,
                                "lame duck still open: new connections keep arriving"
                            ),
                            None => info!("lame duck still open: its minimum has not passed"),
                        },
                    }
                }
            }
        };
        let lasted = started.elapsed();
        *lock(&self.state) = State::Ended { lasted, why };
        lock(&self.watching).clear();
        self.metrics.lame_duck_ended(lasted, why.as_str());
        let ms = lasted.as_millis() as u64;
        match why {
            Ending::Period => info!(
                lasted_ms = ms,
                "lame duck over: its fixed period has passed"
            ),
            Ending::Quiet(Some(arrival)) => info!(
                lasted_ms = ms,
                last_from = %arrival.from,
                last_ms_ago = arrival.at.elapsed().as_millis() as u64,
                "lame duck over: no new connection for the quiet window"
            ),
            Ending::Quiet(None) => info!(
                lasted_ms = ms,
                "lame duck over: no new connection arrived during it"
            ),
            Ending::Max(arrival) => info!(
                lasted_ms = ms,
                last_from = arrival.map(|a| a.from.to_string()).unwrap_or_default(),
                "lame duck over: its maximum was reached while new connections kept arriving"
            ),
        }
        why
    }

    /// The policy and the current or last lame duck, for `/status`.
    pub fn status(&self) -> Value {
        let ms = |duration: Duration| duration.as_millis() as u64;
        let mut status = match self.policy {
            Policy::Fixed(period) => json!({"mode": "fixed", "period_ms": ms(period)}),
            Policy::Adaptive { quiet, min, max } => json!({
                "mode": "adaptive",
                "quiet_window_ms": ms(quiet),
                "min_ms": ms(min),
                "max_ms": ms(max),
            }),
        };
        let state = *lock(&self.state);
        status["state"] = match state {
            State::NotStarted => "not started".into(),
            State::Open { .. } => "open".into(),
            State::Ended { .. } => "ended".into(),
        };
        let arrival = |arrival: Option<Arrival>| match arrival {
            Some(arrival) => json!({
                "ms_ago": ms(arrival.at.elapsed()),
                "from": arrival.from.to_string(),
            }),
            None => Value::Null,
        };
        match state {
            State::NotStarted => {}
            State::Open { since } => {
                status["elapsed_ms"] = ms(since.elapsed()).into();
                let last = last_arrival(&lock(&self.watching)).filter(|a| a.at >= since);
                status["last_arrival"] = arrival(last);
            }
            State::Ended { lasted, why } => {
                status["lasted_ms"] = ms(lasted).into();
                status["ended"] = why.as_str().into();
                if let Ending::Quiet(last) | Ending::Max(last) = why {
                    status["last_arrival"] = arrival(last);
                }
            }
        }
        status
    }
}

/// The latest arrival on any of `sides`.
fn last_arrival(sides: &[Arc<Side>]) -> Option<Arrival> {
    sides
        .iter()
        .filter_map(|side| side.last_arrival())
        .max_by_key(|arrival| arrival.at)
}

/// When an adaptive lame duck that started at `started` ends, as things stand, and why: a
/// quiet window after the last arrival (or after the start), not before the minimum, at the
/// maximum at the latest.
fn adaptive_end(
    started: Instant,
    last: Option<Arrival>,
    quiet: Duration,
    min: Duration,
    max: Duration,
) -> (Instant, Ending) {
    let quiet_from = last.map_or(started, |arrival| arrival.at.max(started));
    let end = (quiet_from + quiet).max(started + min);
    if end >= started + max {
        let why = match last {
            Some(_) if quiet_from + quiet > started + max => Ending::Max(last),
            _ => Ending::Quiet(last),
        };
        return (started + max, why);
    }
    (end, Ending::Quiet(last))
}

#[cfg(test)]
mod tests {
    use super::*;

    const QUIET: Duration = Duration::from_secs(1);
    const MIN: Duration = Duration::from_secs(2);
    const MAX: Duration = Duration::from_secs(10);

    fn arrival(at: Instant) -> Option<Arrival> {
        Some(Arrival {
            at,
            from: "10.0.0.9".parse().unwrap(),
        })
    }

    #[test]
    fn it_ends_a_quiet_window_after_the_last_arrival_between_its_bounds() {
        let t0 = Instant::now();
        let secs = Duration::from_secs;
        // Nothing arrives: the minimum.
        assert_eq!(adaptive_end(t0, None, QUIET, MIN, MAX).0, t0 + MIN);
        // Arrivals early on: the minimum still.
        assert_eq!(
            adaptive_end(
                t0,
                arrival(t0 + Duration::from_millis(500)),
                QUIET,
                MIN,
                MAX
            )
            .0,
            t0 + MIN
        );
        // Arrivals later: a quiet window after the last one.
        let (end, why) = adaptive_end(t0, arrival(t0 + secs(5)), QUIET, MIN, MAX);
        assert_eq!(end, t0 + secs(6));
        assert_eq!(why.as_str(), "quiet");
        // Arrivals up to the end: the maximum, and it says so.
        let (end, why) = adaptive_end(
            t0,
            arrival(t0 + Duration::from_millis(9_500)),
            QUIET,
            MIN,
            MAX,
        );
        assert_eq!(end, t0 + MAX);
        assert_eq!(why.as_str(), "max");
        // A quiet window that ends exactly at the maximum is quiet.
        let (_, why) = adaptive_end(t0, arrival(t0 + secs(9)), QUIET, MIN, MAX);
        assert_eq!(why.as_str(), "quiet");
    }

    #[tokio::test(start_paused = true)]
    async fn arrivals_keep_it_open_and_quiet_ends_it() {
        let registry_drain = Arc::new(crate::drain::Drain::default());
        let conns = Arc::new(crate::conns::Connections::default());
        let metrics = Arc::new(Metrics::new(conns, registry_drain.clone()));
        let lame_duck = Arc::new(LameDuck::new(
            Policy::Adaptive {
                quiet: QUIET,
                min: MIN,
                max: MAX,
            },
            metrics.clone(),
        ));
        let side = registry_drain.side(crate::config::Direction::Inbound);
        let started = Instant::now();
        let running = {
            let (lame_duck, side) = (lame_duck.clone(), side.clone());
            tokio::spawn(async move { lame_duck.run(&[side]).await })
        };
        // A new connection every 300 ms for 4 s.
        for _ in 0..13 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            side.arrived("10.0.0.9".parse().unwrap());
            assert_eq!(lame_duck.status()["state"], "open");
        }
        let why = running.await.unwrap();
        let lasted = started.elapsed();
        assert_eq!(why.as_str(), "quiet");
        assert!(
            lasted >= Duration::from_millis(4_900) && lasted <= Duration::from_millis(5_000),
            "{lasted:?}"
        );
        let status = lame_duck.status();
        assert_eq!(status["ended"], "quiet");
        assert_eq!(status["last_arrival"]["from"], "10.0.0.9");
        let text = metrics.encode().unwrap();
        assert!(
            text.contains("lameduck_lame_ducks_total{ended=\"quiet\"} 1"),
            "{text}"
        );
    }
}
