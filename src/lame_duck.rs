//! The lame duck: once the shutdown or the inbound quiesce has started, listeners keep
//! accepting, every connection asked to go away, for as long as the rest of the cluster still
//! sends new connections here (docs/pod-lifecycle.md).
//!
//! A fixed period is a guess at how long kube-proxy, ingresses and load balancers take to
//! forget a pod (0.2 s to minutes). The adaptive lame duck measures it instead: every
//! connection accepted meanwhile is asked to go away after its request, so its client comes
//! back through the Service and, if the endpoint still points here, arrives again. Its sides
//! keep a book of those arrivals by source (src/arrivals.rs), and it ends once the book says
//! every source has stopped (each silent for a window that follows its own rate) and the pod as
//! a whole has been quiet for as long as its request rate before the lame duck says is
//! telling; never before the minimum and never after the maximum. New connections from ignored
//! sources do not count; the admin port (where inject sends the kubelet's probes) is no route
//! and never counts. The accept loops write the book; this module only reads it.
//!
//! The rate before comes from the metrics, sampled every second ([`LameDuck::sample`]).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use serde_json::{Value, json};
use tracing::info;

use crate::arrivals::{Holder, Rule, SILENCES, SLOWEST, Source};
use crate::config::{Direction, LameDuck as Policy};
use crate::drain::Side;
use crate::metrics::Metrics;
use crate::sync::lock;

/// How often an open lame duck says, in the log, why it is still open.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(1);
/// Over how long the rate before the lame duck is measured.
const RATE_SPAN: Duration = Duration::from_secs(10);

/// Why a lame duck ended.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Ending {
    /// Every source quiet for its window (the latest arrival, if any came since the start).
    Quiet(Option<Source>),
    /// What still held it when the maximum was reached.
    Max(Option<Holder>),
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
    /// The sides whose arrivals the current or last lame duck watched (for `/status`).
    watching: Mutex<Vec<Arc<Side>>>,
    /// What the inbound side had served at each of the last seconds: the rate before.
    served: Mutex<VecDeque<(Instant, u64)>>,
}

impl LameDuck {
    pub fn new(policy: Policy, metrics: Arc<Metrics>) -> LameDuck {
        LameDuck {
            policy,
            metrics,
            state: Mutex::new(State::NotStarted),
            watching: Mutex::new(Vec::new()),
            served: Mutex::new(VecDeque::new()),
        }
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The rule the adaptive lame duck judges its sources by.
    fn rule(&self) -> Option<Rule> {
        match self.policy {
            Policy::Adaptive { quiet, .. } => Some(Rule {
                silences: SILENCES,
                floor: quiet,
                slowest: SLOWEST,
            }),
            Policy::Fixed(_) => None,
        }
    }

    /// Notes what the inbound side has served by now; an adaptive lame duck calls it every
    /// second until the process exits ([`LameDuck::sample_every_second`]).
    pub fn sample(&self) {
        let now = Instant::now();
        let served = self.metrics.served(Direction::Inbound);
        let mut samples = lock(&self.served);
        while samples
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) > RATE_SPAN)
        {
            samples.pop_front();
        }
        samples.push_back((now, served));
    }

    pub async fn sample_every_second(self: Arc<Self>) {
        let mut every = tokio::time::interval(Duration::from_secs(1));
        loop {
            every.tick().await;
            self.sample();
        }
    }

    /// Requests (and opaque TCP connections) a second that the inbound side served over the
    /// last [`RATE_SPAN`]; zero before a second of samples.
    fn rate_before(&self) -> f64 {
        let samples = lock(&self.served);
        let Some((then, before)) = samples.front().copied() else {
            return 0.0;
        };
        let span = then.elapsed().as_secs_f64();
        if span < 1.0 {
            return 0.0;
        }
        let now = self.metrics.served(Direction::Inbound);
        now.saturating_sub(before) as f64 / span
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
        let why = match (self.policy, self.rule()) {
            (Policy::Adaptive { min, max, .. }, Some(rule)) => {
                let rate = self.rate_before();
                for side in sides {
                    let expected = match side.direction {
                        // What the cluster sends here: once the lame duck is over, what still
                        // comes is refused at once and counted, not left to time out.
                        Direction::Inbound => {
                            side.refuse_late();
                            rate
                        }
                        Direction::Outbound => 0.0,
                    };
                    side.record_arrivals(expected);
                }
                info!(
                    lame_duck = %self.policy,
                    requests_per_second_before = (rate * 10.0).round() / 10.0,
                    "lame duck: still accepting, asking connections to go away"
                );
                self.adaptive(sides, &rule, started, min, max).await
            }
            (policy, _) => {
                info!(lame_duck = %policy, "lame duck: still accepting, asking connections to go away");
                tokio::time::sleep(policy.longest()).await;
                Ending::Period
            }
        };
        let lasted = started.elapsed();
        *lock(&self.state) = State::Ended { lasted, why };
        self.metrics.lame_duck_ended(lasted, why.as_str());
        let ms = lasted.as_millis() as u64;
        let totals = sides
            .iter()
            .filter_map(|side| side.with_arrivals(|_, book| (book.total(), book.sources())))
            .fold((0, 0), |(total, sources), (more, others)| {
                (total + more, sources + others)
            });
        match why {
            Ending::Period => info!(
                lasted_ms = ms,
                "lame duck over: its fixed period has passed"
            ),
            Ending::Quiet(Some(last)) => info!(
                lasted_ms = ms,
                new_connections = totals.0,
                sources = totals.1,
                last_from = %show(last.from),
                last_ms_ago = (lasted.saturating_sub(last.last)).as_millis() as u64,
                "lame duck over: every source of new connections has been quiet for its window"
            ),
            Ending::Quiet(None) => info!(
                lasted_ms = ms,
                "lame duck over: no new connection arrived during it"
            ),
            Ending::Max(holder) => info!(
                lasted_ms = ms,
                new_connections = totals.0,
                sources = totals.1,
                still = %holder.map_or_else(String::new, |holder| why_open(holder, started)),
                "lame duck over: its maximum was reached while new connections may still arrive"
            ),
        }
        why
    }

    /// An adaptive lame duck: until its sides' books say the rest of the cluster has stopped
    /// sending here, between `min` and `max`.
    async fn adaptive(
        &self,
        sides: &[Arc<Side>],
        rule: &Rule,
        started: Instant,
        min: Duration,
        max: Duration,
    ) -> Ending {
        let mut progress = tokio::time::interval_at(started + PROGRESS_INTERVAL, PROGRESS_INTERVAL);
        loop {
            let evidence = sides
                .iter()
                .filter_map(|side| side.quiet_at(rule))
                .max_by_key(|(at, _)| *at);
            // With nothing in the books, nothing says the cluster still sends here: a floor.
            let quiet_at = evidence.map_or(started + rule.floor, |(at, _)| at);
            let end = quiet_at.max(started + min).min(started + max);
            if Instant::now() >= end {
                let last = last_arrival(sides);
                return match evidence {
                    Some((at, holder)) if at > started + max => Ending::Max(Some(holder)),
                    _ => Ending::Quiet(last),
                };
            }
            tokio::select! {
                // The window as it stands is over: look again at the book.
                () = tokio::time::sleep_until(end) => {}
                // Time to say why it is still open.
                _ = progress.tick() => match evidence {
                    Some((_, holder)) => info!(
                        still = %why_open(holder, started),
                        "lame duck still open: new connections may still arrive"
                    ),
                    None => info!("lame duck still open: its minimum has not passed"),
                },
            }
        }
    }

    /// Once `side` has drained: while new connections may still come, the process stays, so
    /// that its pod's address answers them (its listeners refuse them at once, or hand them
    /// off, and write them in a book of late arrivals) rather than vanish under clients that
    /// still route here; until the evidence says they have stopped (with the rule of the lame
    /// duck), or `deadline`. The evidence is the lame duck's own book and the late one: a lame
    /// duck cut short by its maximum saw sources that had not stopped, and they are waited for
    /// even when none of them has come back yet (a pause of the whole cluster's traffic, or a
    /// drain quicker than their gaps); a lame duck that ended quiet has nothing more to say.
    /// With neither, it ends at once.
    pub async fn linger(&self, side: &Side, deadline: Instant) {
        let Some(rule) = self.rule() else { return };
        let started = Instant::now();
        let lame_duck = side
            .quiet_at(&rule)
            .zip(side.with_arrivals(|book_started, _| book_started))
            .map(|((quiet_at, holder), book_started)| (quiet_at, holder, book_started));
        let mut announced = false;
        loop {
            let evidence = [lame_duck, side.late_quiet_at(&rule)]
                .into_iter()
                .flatten()
                .max_by_key(|(quiet_at, ..)| *quiet_at);
            let Some((quiet_at, holder, book_started)) = evidence else {
                break;
            };
            if quiet_at <= Instant::now() || Instant::now() >= deadline {
                break;
            }
            if !announced {
                info!(
                    late_connections = side.late().0,
                    still = %why_open(holder, book_started),
                    grace_left_ms = deadline.saturating_duration_since(Instant::now()).as_millis() as u64,
                    "lingering: new connections may still come; the pod's address answers them (handed off to the Service, or refused at once) until they stop"
                );
                announced = true;
            }
            tokio::time::sleep_until(quiet_at.min(deadline)).await;
        }
        let (late, last) = side.late();
        if late > 0 || announced {
            let (handed_off, loops) = side.handoffs();
            info!(
                late_connections = late,
                handed_off,
                handoff_loops = loops,
                last_from = last.map(|(_, from)| from.to_string()).unwrap_or_default(),
                last_ms_ago = last.map_or(0, |(at, _)| at.elapsed().as_millis() as u64),
                lingered_ms = started.elapsed().as_millis() as u64,
                "late connections after the lame duck (handed off or refused)"
            );
        }
    }

    /// The policy and the current or last lame duck, for `/status`.
    pub fn status(&self) -> Value {
        let ms = |duration: Duration| duration.as_millis() as u64;
        let mut status = match self.policy {
            Policy::Fixed(period) => json!({"mode": "fixed", "period_ms": ms(period)}),
            Policy::Adaptive { quiet, min, max } => json!({
                "mode": "adaptive",
                "quiet_window_ms": ms(quiet),
                "silences": SILENCES,
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
        let watching = lock(&self.watching).clone();
        match state {
            State::NotStarted => {}
            State::Open { since } => {
                status["elapsed_ms"] = ms(since.elapsed()).into();
                status["last_arrival"] = last_arrival_json(&watching);
                if let Some(rule) = self.rule() {
                    let at = since.elapsed();
                    let (total, sources, sending) = watching
                        .iter()
                        .filter_map(|side| {
                            side.with_arrivals(|_, book| {
                                (book.total(), book.sources(), book.still_sending(&rule, at))
                            })
                        })
                        .fold((0, 0, 0), |sum, more| {
                            (sum.0 + more.0, sum.1 + more.1, sum.2 + more.2)
                        });
                    status["new_connections"] = total.into();
                    status["sources"] = sources.into();
                    status["sources_still_sending"] = sending.into();
                }
            }
            State::Ended { lasted, why } => {
                status["lasted_ms"] = ms(lasted).into();
                status["ended"] = why.as_str().into();
                status["last_arrival"] = last_arrival_json(&watching);
            }
        }
        status
    }
}

/// The latest arrival on any of `sides`, for `/status`: how long ago, from where.
fn last_arrival_json(sides: &[Arc<Side>]) -> Value {
    let latest = sides
        .iter()
        .filter_map(|side| {
            side.with_arrivals(|started, book| {
                book.last()
                    .map(|source| (started.elapsed().saturating_sub(source.last), source.from))
            })
            .flatten()
        })
        .min_by_key(|(ago, _)| *ago);
    match latest {
        Some((ago, from)) => json!({"ms_ago": ago.as_millis() as u64, "from": show(from)}),
        None => Value::Null,
    }
}

/// The latest arrival on any of `sides`, as offsets from the start of its lame duck.
fn last_arrival(sides: &[Arc<Side>]) -> Option<Source> {
    sides
        .iter()
        .filter_map(|side| side.with_arrivals(|_, book| book.last()).flatten())
        .max_by_key(|source| source.last)
}

/// What holds a lame duck open, for the log.
fn why_open(holder: Holder, started: Instant) -> String {
    match holder {
        Holder::Source(source) => format!(
            "{} sent {} new connections, about one every {} ms, the last {} ms ago",
            show(source.from),
            source.count,
            source.mean_gap().as_millis(),
            started.elapsed().saturating_sub(source.last).as_millis()
        ),
        Holder::Expected { rate } => format!(
            "the pod served {rate:.1} requests a second before; at that rate the silence is \
             still too short to tell"
        ),
    }
}

fn show(from: Option<std::net::IpAddr>) -> String {
    from.map_or_else(|| "other sources".into(), |ip| ip.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const QUIET: Duration = Duration::from_millis(250);
    const MIN: Duration = Duration::from_secs(2);
    const MAX: Duration = Duration::from_secs(10);

    fn lame_duck() -> (Arc<LameDuck>, Arc<Metrics>, Arc<crate::drain::Drain>) {
        let drain = Arc::new(crate::drain::Drain::default());
        let conns = Arc::new(crate::conns::Connections::default());
        let metrics = Arc::new(Metrics::new(conns, drain.clone()));
        let lame_duck = Arc::new(LameDuck::new(
            Policy::Adaptive {
                quiet: QUIET,
                min: MIN,
                max: MAX,
            },
            metrics.clone(),
        ));
        (lame_duck, metrics, drain)
    }

    #[tokio::test(start_paused = true)]
    async fn arrivals_keep_it_open_until_their_source_is_quiet_for_its_window() {
        let (lame_duck, metrics, drain) = lame_duck();
        let side = drain.side(Direction::Inbound);
        let started = Instant::now();
        let running = {
            let (lame_duck, side) = (lame_duck.clone(), side.clone());
            tokio::spawn(async move { lame_duck.run(&[side]).await })
        };
        // A new connection every 100 ms for 4 s: 20 of its gaps (2 s) after the last.
        for _ in 0..40 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            side.arrived("10.0.0.9".parse().unwrap());
            assert_eq!(lame_duck.status()["state"], "open");
        }
        assert_eq!(lame_duck.status()["sources_still_sending"], 1);
        let why = running.await.unwrap();
        let lasted = started.elapsed();
        assert_eq!(why.as_str(), "quiet");
        assert!(
            lasted >= Duration::from_millis(5_990) && lasted <= Duration::from_millis(6_100),
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

    #[tokio::test(start_paused = true)]
    async fn without_arrivals_it_ends_at_its_minimum_and_a_slow_source_holds_it_to_its_maximum() {
        let (lame_duck, _, drain) = lame_duck();
        let side = drain.side(Direction::Inbound);
        let started = Instant::now();
        assert_eq!(lame_duck.run(&[side]).await, Ending::Quiet(None));
        assert_eq!(started.elapsed(), MIN);
        // One arrival 1 s into a second lame duck (a new book): its gap is a second, its window
        // twenty, beyond the maximum.
        let (lame_duck, _, drain) = self::lame_duck();
        let side = drain.side(Direction::Inbound);
        let started = Instant::now();
        let running = {
            let (lame_duck, side) = (lame_duck.clone(), side.clone());
            tokio::spawn(async move { lame_duck.run(&[side]).await })
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        side.arrived("10.0.0.7".parse().unwrap());
        let why = running.await.unwrap();
        assert_eq!(started.elapsed(), MAX);
        assert!(
            matches!(why, Ending::Max(Some(Holder::Source(source))) if source.count == 1),
            "{why:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_lame_duck_cut_short_lingers_for_its_sources_and_one_that_ended_quiet_does_not() {
        let (lame_duck, _, drain) = lame_duck();
        let side = drain.side(Direction::Inbound);
        let started = Instant::now();
        let running = {
            let (lame_duck, side) = (lame_duck.clone(), side.clone());
            tokio::spawn(async move { lame_duck.run(&[side]).await })
        };
        // One every 250 ms up to 9.75 s: its window (5 s) runs past the 10 s maximum.
        for _ in 0..39 {
            tokio::time::sleep(Duration::from_millis(250)).await;
            side.arrived("10.0.0.9".parse().unwrap());
        }
        assert!(matches!(running.await.unwrap(), Ending::Max(Some(_))));
        side.refusing_from_now();
        // No late connection comes: the linger still lasts until the source's window is over.
        lame_duck
            .linger(&side, started + Duration::from_secs(60))
            .await;
        assert_eq!(started.elapsed(), Duration::from_millis(14_750));
        // A lame duck that ended quiet, with no late connection after it: no linger.
        let (lame_duck, _, drain) = self::lame_duck();
        let side = drain.side(Direction::Inbound);
        let running = {
            let (lame_duck, side) = (lame_duck.clone(), side.clone());
            tokio::spawn(async move { lame_duck.run(&[side]).await })
        };
        for _ in 0..10 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            side.arrived("10.0.0.9".parse().unwrap());
        }
        assert!(matches!(running.await.unwrap(), Ending::Quiet(Some(_))));
        side.refusing_from_now();
        let lingering = Instant::now();
        lame_duck
            .linger(&side, lingering + Duration::from_secs(60))
            .await;
        assert_eq!(lingering.elapsed(), Duration::ZERO);
    }
}
