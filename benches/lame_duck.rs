//! How the adaptive lame duck's rule does on simulated clusters: the real rule
//! (`lameduck::arrivals`) beside the others it was chosen against, on modelled rollouts.
//!
//! `cargo bench --bench lame_duck` (`-- --runs N`, 20,000 by default; `-- --quick` 500) prints,
//! for each rule and cluster: how often the lame duck ended while some client still routed to
//! the pod (each arrival after its end would be refused), how long it lasted, and how long after
//! the last client forgot the pod it ended. benches/README.md keeps the figures;
//! docs/pod-lifecycle.md explains the choice.
//!
//! The model, per pod going away (t = 0 is the start of its lame duck): client namespaces
//! ("nodes"), each with its own copy of the Service's rules that forgets the pod at P × (1 ± u),
//! u uniform in [-0.5, 0.5]; while it has not, each new connection from it picks one of E = 4
//! endpoints at random (kube-proxy's `statistic --mode random`), the pod among them. Clients:
//! - new-connection clients: every request a new connection;
//! - keep-alive clients (and HTTP/2 ones, alike here): a connection held on one endpoint; one
//!   held on the pod is asked to go away after its next request and the client connects again
//!   (an arrival if it lands on the pod again); one held elsewhere is closed when that pod is
//!   rolled in turn ("reshuffles" at 2 s and 4 s), and the client connects again;
//! - scrapers: one connection every 15 s to the pod's own address (no Service), until the end.
//!
//! Requests come at each client's pace ±10 %. The lame duck lasts at least 2 s and at most 16 s
//! (inject's figures for a 20 s grace period).

use std::net::IpAddr;
use std::time::Duration;

use lameduck::arrivals::{Arrivals, Rule, SILENCES, SLOWEST};
use lameduck::config::DEFAULT_LAME_DUCK_QUIET_WINDOW;

/// The rule the proxy uses by default.
const RULE: Rule = Rule {
    silences: SILENCES,
    floor: DEFAULT_LAME_DUCK_QUIET_WINDOW,
    slowest: SLOWEST,
};

const MIN: f64 = 2.0;
const MAX: f64 = 16.0;
const ENDPOINTS: u32 = 4;
const RESHUFFLES: [f64; 2] = [2.0, 4.0];

/// xorshift64*: a small, seeded generator, so that runs repeat.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn picks_the_pod(&mut self) -> bool {
        self.next() % u64::from(ENDPOINTS) == 0
    }
}

#[derive(Clone, Copy)]
enum Kind {
    NewConnections,
    KeepAlive,
    Scraper,
}

#[derive(Clone, Copy)]
struct Client {
    kind: Kind,
    /// Seconds between requests.
    pace: f64,
    /// Its node (index into the forget times); its own address unless `shared`.
    node: usize,
}

struct Cluster {
    name: &'static str,
    propagation: f64,
    nodes: usize,
    clients: Vec<Client>,
    /// Whether the clients of a node share its address (pods behind a node's masquerade, or
    /// one client namespace), rather than each its own (client pods).
    shared: bool,
    /// A node that forgets the pod last, at P × 1.5, whatever the draw (index).
    laggard: Option<usize>,
}

/// One pod's lame duck: its arrivals (time, source) in order, and when the last node forgot it.
fn simulate(cluster: &Cluster, rng: &mut Rng) -> (Vec<(f64, IpAddr)>, f64) {
    let forget: Vec<f64> = (0..cluster.nodes)
        .map(|node| match cluster.laggard == Some(node) {
            true => cluster.propagation * 1.5,
            false => cluster.propagation * (0.5 + rng.unit()),
        })
        .collect();
    let mut arrivals = Vec::new();
    for (index, client) in cluster.clients.iter().enumerate() {
        let source = match cluster.shared {
            true => IpAddr::from([10, 110, client.node as u8, 2]),
            false => IpAddr::from([10, 120, (index / 250) as u8, (index % 250) as u8]),
        };
        let routed = |t: f64| t < forget[client.node];
        let mut t = rng.unit() * client.pace;
        match client.kind {
            Kind::Scraper => {
                let mut t = rng.unit() * 15.0;
                while t < MAX {
                    arrivals.push((t, source));
                    t += 15.0;
                }
            }
            Kind::NewConnections => {
                while routed(t) && t < MAX {
                    if rng.picks_the_pod() {
                        arrivals.push((t, source));
                    }
                    t += client.pace * (0.9 + 0.2 * rng.unit());
                }
            }
            Kind::KeepAlive => {
                // Where its connection is: on the pod (asked to go away), or elsewhere.
                let mut on_pod = rng.picks_the_pod();
                let mut reconnect = on_pod;
                let mut reshuffles = RESHUFFLES.iter().peekable();
                while t < MAX {
                    if !on_pod && reshuffles.next_if(|at| **at <= t).is_some() {
                        // Its pod was rolled: it connects again (if it was on the rolled one).
                        reconnect = rng.picks_the_pod();
                    }
                    if reconnect {
                        on_pod = routed(t) && rng.picks_the_pod();
                        if on_pod {
                            arrivals.push((t, source));
                        }
                    }
                    // One held on the pod is asked to go away after this request.
                    reconnect = on_pod;
                    if !on_pod && reshuffles.peek().is_none() {
                        break;
                    }
                    t += client.pace * (0.9 + 0.2 * rng.unit());
                }
            }
        }
    }
    arrivals.sort_by(|a, b| a.0.total_cmp(&b.0));
    let last_forget = forget.iter().copied().fold(0.0, f64::max);
    (arrivals, last_forget)
}

/// A rule: when the lame duck ends, given the arrivals so far (times from its start).
trait Ending {
    fn name(&self) -> String;
    /// The end as things stand, before `MIN` and `MAX` are applied; `None` with no arrival.
    fn end(&mut self) -> Option<f64>;
    fn arrive(&mut self, at: f64, from: IpAddr);
}

/// The rule before this one: a fixed quiet window after the latest arrival of any source.
struct FixedWindow {
    window: f64,
    last: Option<f64>,
}

impl Ending for FixedWindow {
    fn name(&self) -> String {
        format!("any source, fixed {} s window (before)", self.window)
    }
    fn end(&mut self) -> Option<f64> {
        self.last.map(|last| last + self.window)
    }
    fn arrive(&mut self, at: f64, _: IpAddr) {
        self.last = Some(at);
    }
}

/// One rate for all sources: silent for `silences` of the mean gap of the last `recent`
/// arrivals (a rate that follows the traffic, not its sources).
struct AggregateRate {
    silences: f64,
    recent: usize,
    times: Vec<f64>,
}

impl Ending for AggregateRate {
    fn name(&self) -> String {
        format!(
            "any source, {} mean gaps of the last {}",
            self.silences, self.recent
        )
    }
    fn end(&mut self) -> Option<f64> {
        let last = *self.times.last()?;
        let from = self.times.len().saturating_sub(self.recent);
        let span = last - if from == 0 { 0.0 } else { self.times[from - 1] };
        let gap = span / (self.times.len() - from) as f64;
        Some(last + (gap * self.silences).max(RULE.floor.as_secs_f64()))
    }
    fn arrive(&mut self, at: f64, _: IpAddr) {
        self.times.push(at);
    }
}

/// The real rule, `lameduck::arrivals`, with `rule`; with the pod's request rate before the
/// lame duck, or without it.
struct PerSource {
    rule: Rule,
    expected: bool,
    arrivals: Arrivals,
}

impl Ending for PerSource {
    fn name(&self) -> String {
        let chosen = if self.rule == RULE && self.expected {
            " (chosen)"
        } else {
            ""
        };
        let expected = match self.expected {
            true => ", and the rate before",
            false => "",
        };
        let slowest = match self.rule.slowest {
            Duration::MAX => String::new(),
            slowest => format!(", none slower than one every {} s", slowest.as_secs()),
        };
        format!(
            "per source, {} mean gaps{slowest}{expected}{chosen}",
            self.rule.silences
        )
    }
    fn end(&mut self) -> Option<f64> {
        let (end, _) = self.arrivals.end(&self.rule)?;
        Some(end.as_secs_f64())
    }
    fn arrive(&mut self, at: f64, from: IpAddr) {
        self.arrivals.arrive(from, Duration::from_secs_f64(at));
    }
}

/// Runs one lame duck: when it ended, and how many arrivals came after.
fn run(rule: &mut dyn Ending, arrivals: &[(f64, IpAddr)]) -> (f64, usize) {
    for (index, (at, from)) in arrivals.iter().enumerate() {
        let end = rule.end().unwrap_or(0.0).max(MIN);
        if end <= *at {
            return (end.min(MAX), arrivals.len() - index);
        }
        rule.arrive(*at, *from);
    }
    (rule.end().unwrap_or(0.0).clamp(MIN, MAX), 0)
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    values[((values.len() - 1) as f64 * p).round() as usize]
}

fn clusters() -> Vec<Cluster> {
    let harness = || {
        let mut clients = Vec::new();
        for node in 0..4 {
            clients.push(Client {
                kind: Kind::NewConnections,
                pace: 0.035,
                node,
            });
            clients.push(Client {
                kind: Kind::KeepAlive,
                pace: 0.035,
                node,
            });
        }
        for node in 0..2 {
            clients.push(Client {
                kind: Kind::KeepAlive,
                pace: 0.035,
                node,
            });
        }
        clients
    };
    let busy = |name, propagation| Cluster {
        name,
        propagation,
        nodes: 4,
        clients: harness(),
        shared: true,
        laggard: None,
    };
    let mut scraped = busy("busy (P = 2 s) and a scraper every 15 s", 2.0);
    scraped.clients.push(Client {
        kind: Kind::Scraper,
        pace: 15.0,
        node: 0,
    });
    scraped.shared = false;
    vec![
        busy("busy, 4 nodes, about 280 req/s (P = 0.5 s)", 0.5),
        busy("busy, 4 nodes, about 280 req/s (P = 2 s)", 2.0),
        busy("busy, 4 nodes, about 280 req/s (P = 10 s)", 10.0),
        Cluster {
            name: "100 new connections/s per pod from 4 nodes (P = 2 s)",
            propagation: 2.0,
            nodes: 4,
            clients: (0..4)
                .map(|node| Client {
                    kind: Kind::NewConnections,
                    pace: 0.01,
                    node,
                })
                .collect(),
            shared: true,
            laggard: None,
        },
        Cluster {
            name: "quiet: 2 req/s per pod, 3 nodes (P = 10 s)",
            propagation: 10.0,
            nodes: 3,
            clients: (0..3)
                .flat_map(|node| {
                    [Kind::NewConnections, Kind::KeepAlive].map(|kind| Client {
                        kind,
                        pace: 1.0,
                        node,
                    })
                })
                .collect(),
            shared: true,
            laggard: None,
        },
        Cluster {
            name: "uneven: 100/s from a node, 1/s from one forgetting last (P = 10 s)",
            propagation: 10.0,
            nodes: 2,
            clients: vec![
                Client {
                    kind: Kind::NewConnections,
                    pace: 0.0025,
                    node: 0,
                },
                Client {
                    kind: Kind::NewConnections,
                    pace: 0.25,
                    node: 1,
                },
            ],
            shared: true,
            laggard: Some(1),
        },
        scraped,
        Cluster {
            name: "40 keep-alive client pods on 4 nodes (P = 2 s)",
            propagation: 2.0,
            nodes: 4,
            clients: (0..40)
                .map(|index| Client {
                    kind: Kind::KeepAlive,
                    pace: 0.1,
                    node: index % 4,
                })
                .collect(),
            shared: false,
            laggard: None,
        },
    ]
}

/// The pod's request rate before its lame duck: each request lands on it one time in
/// `ENDPOINTS`, and one keep-alive client in `ENDPOINTS` holds its connection on it.
fn rate_before(cluster: &Cluster) -> f64 {
    cluster
        .clients
        .iter()
        .map(|client| match client.kind {
            Kind::Scraper => 1.0 / client.pace,
            _ => 1.0 / client.pace / f64::from(ENDPOINTS),
        })
        .sum()
}

type MakeRule = Box<dyn Fn(f64) -> Box<dyn Ending>>;

fn rules() -> Vec<MakeRule> {
    let per_source = |silences: f64, slowest: Duration, expected: bool| -> MakeRule {
        Box::new(move |rate| {
            Box::new(PerSource {
                rule: Rule {
                    silences,
                    slowest,
                    ..RULE
                },
                expected,
                arrivals: Arrivals::expecting(if expected { rate } else { 0.0 }),
            })
        })
    };
    vec![
        Box::new(|_| {
            Box::new(FixedWindow {
                window: 1.0,
                last: None,
            })
        }),
        Box::new(|_| {
            Box::new(AggregateRate {
                silences: 20.0,
                recent: 32,
                times: Vec::new(),
            })
        }),
        per_source(RULE.silences, Duration::MAX, false),
        per_source(RULE.silences, Duration::MAX, true),
        per_source(10.0, SLOWEST, true),
        per_source(14.0, SLOWEST, true),
        per_source(RULE.silences, SLOWEST, true),
        per_source(30.0, SLOWEST, true),
    ]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let runs: usize = match args.iter().position(|arg| arg == "--runs") {
        Some(at) => args[at + 1].parse().expect("--runs N"),
        None if args.iter().any(|arg| arg == "--quick") => 500,
        None => 20_000,
    };
    println!("{runs} lame ducks per cluster and rule; min {MIN} s, max {MAX} s\n");
    for cluster in clusters() {
        println!(
            "## {} ({:.1} requests/s at the pod before)\n",
            cluster.name,
            rate_before(&cluster)
        );
        println!(
            "| rule | ended while routed | arrivals refused (mean) | lasted p50 / p99 (s) | after the last node forgot p50 / p99 (s) | at its max |"
        );
        println!("|---|---|---|---|---|---|");
        for make in rules() {
            let mut rng = Rng(0x5eed_1ab5_d0c5 ^ cluster.propagation.to_bits());
            let (mut early, mut refused, mut at_max) = (0usize, 0usize, 0usize);
            let (mut lasted, mut after) = (Vec::new(), Vec::new());
            let mut name = String::new();
            for _ in 0..runs {
                let (arrivals, last_forget) = simulate(&cluster, &mut rng);
                let mut rule = make(rate_before(&cluster));
                name = rule.name();
                let (end, lost) = run(rule.as_mut(), &arrivals);
                early += usize::from(lost > 0);
                refused += lost;
                at_max += usize::from(end >= MAX);
                lasted.push(end);
                after.push(end - last_forget);
            }
            println!(
                "| {name} | {:.4} % | {:.3} | {:.1} / {:.1} | {:+.1} / {:+.1} | {:.1} % |",
                100.0 * early as f64 / runs as f64,
                refused as f64 / runs as f64,
                percentile(&mut lasted, 0.5),
                percentile(&mut lasted, 0.99),
                percentile(&mut after, 0.5),
                percentile(&mut after, 0.99),
                100.0 * at_max as f64 / runs as f64,
            );
        }
        println!();
    }
}
