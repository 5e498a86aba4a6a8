//! The new connections a side has seen since its lame duck began, by source, and the rule that
//! says from them when the rest of the cluster has stopped sending new connections here
//! (docs/pod-lifecycle.md, "When the lame duck ends").
//!
//! Every connection accepted in a lame duck is asked to go away after its request, so a client
//! that the cluster still routes here comes back through the Service, and each of its requests
//! arrives as a new connection: the rate of arrivals is the rate of the requests that are still
//! sent here. Each *source* (the peer's address: a client pod, a node that masquerades, an
//! ingress pod) follows the routing of its own node or proxy, which forgets the pod at its own
//! time, so each source is judged on its own: it has stopped once it has been silent for
//! [`Rule::silences`] of its own mean gaps (its silence would then be improbable at its rate,
//! `exp(-silences)` for a Poisson source), and never less than [`Rule::floor`]. A busy source
//! is judged gone soon after its last connection; a quiet one (a few a second) only after tens
//! of seconds, so that a quiet service keeps its lame duck to the maximum rather than dropping
//! clients that still send.
//!
//! Sources that have not arrived yet are covered by the pod's request rate before the lame
//! duck (the *expected* rate): a request still sent here through the Service arrives as a new
//! connection, so the pod as a whole must be silent for [`EXPECTED_SILENCES`] of the gaps that
//! rate predicts: more than a source's 20, because only part of those requests come as new
//! connections (a keep-alive client held here moves to another pod at its first one, and
//! stays there), down to a fifth in a keep-alive-heavy quiet service (`exp(-100/5)` again).
//! This holds a quiet service whose nodes have not sent anything yet in the first seconds. The
//! evidence ends once the pod as a whole is quiet and every source has stopped.
//!
//! Times are offsets from the start of the lame duck, so that the rule is a pure function of
//! the arrivals (`benches/lame_duck.rs` drives it with simulated clusters).

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;

/// Sources beyond this many are counted as one (a client fleet of that size is busy enough
/// that its total says as much as its parts).
const MAX_SOURCES: usize = 4096;

/// When a source counts as gone.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rule {
    /// How many of its own mean gaps a source must be silent for.
    pub silences: f64,
    /// The shortest silence that counts, however busy the source.
    pub floor: Duration,
    /// A source whose mean gap is longer is not waited for: within a grace period its silence
    /// can never tell (a scraper every 15 s to the pod's own address, which stops only once the
    /// pod is gone); the rate before the lame duck still holds the pod as a whole.
    pub slowest: Duration,
}

/// How many of its own mean gaps a source must be silent for in the adaptive lame duck:
/// `exp(-20)`, about 2e-9, is the chance that a Poisson source still sending is that silent
/// (docs/pod-lifecycle.md says how this figure was chosen: benches/lame_duck.rs measures it;
/// the floor is `--lame-duck-quiet-window`).
pub const SILENCES: f64 = 20.0;

/// How many gaps at the pod's request rate before the lame duck it must be silent for as a
/// whole (see the module's documentation).
pub const EXPECTED_SILENCES: f64 = 100.0;

/// The slowest source the adaptive lame duck waits for ([`Rule::slowest`]): one new connection
/// every 10 s (benches/lame_duck.rs measures it).
pub const SLOWEST: Duration = Duration::from_secs(10);

/// One source's arrivals.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Source {
    /// The source's address; `None` for the sources beyond [`MAX_SOURCES`], counted together.
    pub from: Option<IpAddr>,
    pub count: u32,
    /// The latest, from the start of the lame duck.
    pub last: Duration,
}

impl Source {
    /// Its mean gap: the time from the start of the lame duck to its last arrival, over its
    /// arrivals (the time before its first counts as a gap: it was sending before the lame duck
    /// began, and its first arrival came one gap into it).
    pub fn mean_gap(&self) -> Duration {
        self.last / self.count.max(1)
    }

    /// How long it must be silent to count as gone, under `rule`.
    pub fn window(&self, rule: &Rule) -> Duration {
        self.mean_gap().mul_f64(rule.silences).max(rule.floor)
    }

    /// When it counts as gone, if nothing more arrives from it.
    pub fn gone_at(&self, rule: &Rule) -> Duration {
        self.last + self.window(rule)
    }
}

/// Why the evidence says the lame duck is still open: what is judged gone last.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Holder {
    /// A source still sending, as far as its rate says.
    Source(Source),
    /// The pod as a whole: at the rate expected (requests a second before the lame duck), a
    /// silence this short says nothing.
    Expected { rate: f64 },
}

/// The arrivals of one lame duck, by source.
#[derive(Debug, Default)]
pub struct Arrivals {
    sources: HashMap<Option<IpAddr>, Source>,
    total: u64,
    /// The latest arrival from any source.
    last: Option<Duration>,
    /// Requests (and opaque TCP connections) a second before the lame duck began; zero when
    /// the pod was idle or it is not known.
    expected_rate: f64,
}

impl Arrivals {
    /// The book of a lame duck before which the pod served `expected_rate` requests a second.
    pub fn expecting(expected_rate: f64) -> Arrivals {
        Arrivals {
            expected_rate: if expected_rate.is_finite() {
                expected_rate.max(0.0)
            } else {
                0.0
            },
            ..Arrivals::default()
        }
    }

    /// When the evidence says the rest of the cluster has stopped sending here under `rule`,
    /// and what holds it that long; `None` when nothing holds it (nothing arrived and nothing
    /// was expected).
    pub fn end(&self, rule: &Rule) -> Option<(Duration, Holder)> {
        let expected = (self.expected_rate > 0.0).then(|| {
            let gap = Duration::from_secs_f64(1.0 / self.expected_rate);
            let quiet =
                self.last.unwrap_or_default() + gap.mul_f64(EXPECTED_SILENCES).max(rule.floor);
            (
                quiet,
                Holder::Expected {
                    rate: self.expected_rate,
                },
            )
        });
        let source = self
            .last_to_go(rule)
            .map(|source| (source.gone_at(rule), Holder::Source(source)));
        match (expected, source) {
            (Some(expected), Some(source)) if source.0 > expected.0 => Some(source),
            (Some(expected), _) => Some(expected),
            (None, source) => source,
        }
    }

    /// A new connection from `from`, `at` after the start of the lame duck.
    pub fn arrive(&mut self, from: IpAddr, at: Duration) {
        self.total += 1;
        let key = match self.sources.len() < MAX_SOURCES || self.sources.contains_key(&Some(from)) {
            true => Some(from),
            false => None,
        };
        let source = self.sources.entry(key).or_insert(Source {
            from: key,
            count: 0,
            last: Duration::ZERO,
        });
        source.count = source.count.saturating_add(1);
        source.last = source.last.max(at);
        self.last = self.last.max(Some(at));
    }

    /// Arrivals so far.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// How many sources have sent something.
    pub fn sources(&self) -> usize {
        self.sources.len()
    }

    /// The latest arrival.
    pub fn last(&self) -> Option<Source> {
        self.sources
            .values()
            .max_by_key(|source| source.last)
            .copied()
    }

    /// The sources `rule` waits for: none slower than [`Rule::slowest`].
    fn waited_for<'a>(&'a self, rule: &'a Rule) -> impl Iterator<Item = &'a Source> + 'a {
        self.sources
            .values()
            .filter(|source| source.mean_gap() <= rule.slowest)
    }

    /// The source that is judged gone last under `rule`, and when; `None` before any arrival
    /// of a source it waits for.
    pub fn last_to_go(&self, rule: &Rule) -> Option<Source> {
        self.waited_for(rule)
            .max_by_key(|source| source.gone_at(rule))
            .copied()
    }

    /// The sources not yet judged gone `at`, under `rule`.
    pub fn still_sending(&self, rule: &Rule, at: Duration) -> usize {
        self.waited_for(rule)
            .filter(|source| source.gone_at(rule) > at)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULE: Rule = Rule {
        silences: SILENCES,
        floor: Duration::from_millis(250),
        slowest: SLOWEST,
    };

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn each_source_is_judged_by_its_own_rate() {
        let mut arrivals = Arrivals::default();
        let (busy, quiet): (IpAddr, IpAddr) =
            ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        // A busy source: one every 10 ms for a second. Its window: 20 mean gaps, 200 ms, but
        // never less than the floor.
        for at in 1..=100 {
            arrivals.arrive(busy, ms(at * 10));
        }
        let busy_source = arrivals.last_to_go(&RULE).unwrap();
        assert_eq!(busy_source.mean_gap(), ms(10));
        assert_eq!(busy_source.window(&RULE), ms(250));
        assert_eq!(busy_source.gone_at(&RULE), ms(1_250));
        // A quiet one, once a second: 20 s of silence.
        for at in [1_000, 2_000] {
            arrivals.arrive(quiet, ms(at));
        }
        let last = arrivals.last_to_go(&RULE).unwrap();
        assert_eq!(last.from, Some(quiet));
        assert_eq!(last.gone_at(&RULE), ms(22_000));
        assert_eq!(arrivals.still_sending(&RULE, ms(1_300)), 1);
        assert_eq!(arrivals.still_sending(&RULE, ms(22_000)), 0);
        assert_eq!((arrivals.total(), arrivals.sources()), (102, 2));
        assert_eq!(arrivals.last().unwrap().from, Some(quiet));
    }

    #[test]
    fn the_rate_before_the_lame_duck_holds_it_until_the_pod_as_a_whole_is_quiet() {
        // Ten requests a second before: 100 gaps of 100 ms, from the start or the last arrival.
        let mut arrivals = Arrivals::expecting(10.0);
        assert_eq!(
            arrivals.end(&RULE),
            Some((ms(10_000), Holder::Expected { rate: 10.0 }))
        );
        let busy: IpAddr = "10.0.0.1".parse().unwrap();
        for at in 1..=100 {
            arrivals.arrive(busy, ms(at * 10));
        }
        assert_eq!(arrivals.end(&RULE).unwrap().0, ms(11_000));
        // A source slower than the pod's rate holds it longer.
        arrivals.arrive("10.0.0.2".parse().unwrap(), ms(3_000));
        let (end, holder) = arrivals.end(&RULE).unwrap();
        assert_eq!(end, ms(63_000));
        assert!(matches!(holder, Holder::Source(source) if source.count == 1));
        // One slower than one every 10 s is not waited for: the pod's rate alone holds it.
        arrivals.arrive("10.0.0.3".parse().unwrap(), ms(12_000));
        assert_eq!(arrivals.end(&RULE).unwrap().0, ms(63_000));
        let mut scraped = Arrivals::expecting(10.0);
        scraped.arrive("10.0.0.3".parse().unwrap(), ms(12_000));
        assert_eq!(
            scraped.end(&RULE),
            Some((ms(22_000), Holder::Expected { rate: 10.0 }))
        );
        // An idle pod, or none known: only the sources hold it.
        assert_eq!(Arrivals::expecting(0.0).end(&RULE), None);
        assert_eq!(Arrivals::expecting(f64::NAN).end(&RULE), None);
    }

    #[test]
    fn sources_beyond_the_bound_are_counted_together() {
        let mut arrivals = Arrivals::default();
        for n in 0..(MAX_SOURCES as u32 + 10) {
            arrivals.arrive(IpAddr::from(n.to_be_bytes()), ms(u64::from(n)));
        }
        assert_eq!(arrivals.sources(), MAX_SOURCES + 1);
        let together = arrivals.sources[&None];
        assert_eq!(together.count, 10);
        assert_eq!(together.last, ms(u64::from(MAX_SOURCES as u32 + 9)));
        // A known source is still its own.
        arrivals.arrive(IpAddr::from(7u32.to_be_bytes()), ms(9_999));
        assert_eq!(
            arrivals.sources[&Some(IpAddr::from(7u32.to_be_bytes()))].count,
            2
        );
    }
}
