//! Outbound retries (docs/http.md, "Retries"): a request towards another pod that got no answer
//! is sent again when the policy allows it ([`policy::may_retry`]: it never reached the app, or
//! it is idempotent without a body), within its own deadline, and while the retry budget has
//! room: a share of the requests of the last ten seconds plus a floor per second (Linkerd's
//! rule, tower's `TpsBudget`), so that a callee going away is not hammered by retries. Beyond
//! the budget the client gets the error as it would without retries. Inbound requests are
//! never retried (the app behind them is this pod's own; a retry cannot reach another one).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tower::retry::budget::{Budget as _, TpsBudget};
use tracing::warn;

use super::policy::Unanswered;
use crate::config::{Direction, RETRY_BUDGET_WINDOW, RetryBudget};
use crate::logging::Throttle;
use crate::metrics::Metrics;
use crate::sync::lock;

/// At most one line per this long says that the budget is spent.
const EXHAUSTED_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The retries of the requests towards one target (one route's, or one original destination's:
/// a Service, through kube-proxy).
pub struct Retries {
    budget: TpsBudget,
    direction: Direction,
    metrics: Arc<Metrics>,
    exhausted_log: Mutex<Throttle>,
}

impl Retries {
    pub fn new(budget: RetryBudget, direction: Direction, metrics: Arc<Metrics>) -> Retries {
        let share = budget.percent as f32 / 100.0;
        Retries {
            budget: TpsBudget::new(RETRY_BUDGET_WINDOW, budget.per_second, share),
            direction,
            metrics,
            exhausted_log: Mutex::new(Throttle::new(EXHAUSTED_LOG_INTERVAL)),
        }
    }

    /// A request towards the target starts: it adds to the share of retries the budget allows.
    pub fn deposit(&self) {
        self.budget.deposit();
    }

    /// Whether a request that got no answer (`unanswered`), and that the policy lets go again,
    /// may: the budget's say. Counted either way; a spent budget is logged (throttled).
    pub fn withdraw(&self, unanswered: Unanswered, target: &str) -> bool {
        let allowed = self.budget.withdraw();
        let outcome = if allowed {
            "retried"
        } else {
            "budget_exhausted"
        };
        self.metrics
            .retry(self.direction, unanswered.as_str(), outcome);
        if !allowed && let Some(suppressed) = lock(&self.exhausted_log).due() {
            warn!(
                %target,
                suppressed,
                "the retry budget is spent: requests that got no answer fail instead of going again"
            );
        }
        allowed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conns::Connections;
    use crate::drain::Drain;

    #[test]
    fn the_budget_allows_its_floor_and_a_share_of_the_requests() {
        let metrics = Arc::new(Metrics::new(
            Arc::new(Connections::default()),
            Arc::new(Drain::default()),
        ));
        let budget = RetryBudget {
            percent: 20,
            per_second: 1,
        };
        let retries = Retries::new(budget, Direction::Outbound, metrics.clone());
        // The floor: one a second over the ten-second window.
        let floor = (0..100)
            .take_while(|_| retries.withdraw(Unanswered::NotConnected, "t"))
            .count();
        assert_eq!(floor, 10);
        // A share of the requests since: 20 % of 50.
        for _ in 0..50 {
            retries.deposit();
        }
        let share = (0..100)
            .take_while(|_| retries.withdraw(Unanswered::NotConnected, "t"))
            .count();
        assert_eq!(share, 10);
        let text = metrics.encode().unwrap();
        assert!(
            text.contains("lameduck_http_retries_total{direction=\"outbound\",reason=\"not_connected\",outcome=\"retried\"} 20"),
            "{text}"
        );
        assert!(text.contains("outcome=\"budget_exhausted\"} 2"), "{text}");
    }
}
