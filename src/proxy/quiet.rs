//! A bound on a state in which nothing moves: an HTTP/2 connection with no stream, a TCP
//! stream half-closed by one side whose other side sends nothing, an idle TCP stream.
//!
//! [`Quiet`] watches a progress counter (requests started, bytes moved) and resolves once it
//! has not moved for its limit. It looks every quarter of the limit instead of re-arming a
//! timer on every movement, so the data path pays nothing for it; it therefore fires between
//! the limit and 1.25 times the limit after the last movement.

use std::time::Duration;

use tokio::time::Instant;

/// Checks per limit: the bound is exceeded by at most a quarter.
const CHECKS: u32 = 4;

#[derive(Debug)]
pub struct Quiet {
    period: Duration,
    next_check: Instant,
    last: u64,
    quiet_checks: u32,
    /// `busy()` at the last check: its end falls somewhere before the next, which counts as a
    /// movement there.
    was_busy: bool,
}

impl Quiet {
    /// Starts watching at `progress`, the counter's value now.
    pub fn new(limit: Duration, progress: u64) -> Quiet {
        let period = (limit / CHECKS).max(Duration::from_millis(1));
        Quiet {
            period,
            next_check: Instant::now() + period,
            last: progress,
            quiet_checks: 0,
            was_busy: false,
        }
    }

    /// Resolves once `progress()` has not moved, and `busy()` has not been true, for the limit:
    /// the end of a busy spell counts as a movement (it happened after the last check that saw
    /// it busy). Cancel-safe: the state lives in `self`, so it can be polled again in a
    /// `select!` loop.
    pub async fn expired(&mut self, progress: impl Fn() -> u64, busy: impl Fn() -> bool) {
        loop {
            tokio::time::sleep_until(self.next_check).await;
            // From now, not from the missed check: a late poll must not count several quiet
            // checks at once.
            self.next_check = Instant::now() + self.period;
            let now = progress();
            let busy = busy();
            if now != self.last || busy || self.was_busy {
                self.last = now;
                self.was_busy = busy;
                self.quiet_checks = 0;
                continue;
            }
            self.quiet_checks += 1;
            if self.quiet_checks >= CHECKS {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[tokio::test(start_paused = true)]
    async fn fires_between_the_limit_and_a_quarter_more_after_the_last_movement() {
        let counter = AtomicU64::new(0);
        let limit = Duration::from_secs(60);
        let mut quiet = Quiet::new(limit, 0);
        let started = Instant::now();
        // Movement for 100 s: never expires meanwhile.
        let moving = async {
            for _ in 0..100 {
                tokio::time::sleep(Duration::from_secs(1)).await;
                counter.fetch_add(1, Ordering::Relaxed);
            }
        };
        tokio::select! {
            () = quiet.expired(|| counter.load(Ordering::Relaxed), || false) => {
                panic!("expired while the counter moved");
            }
            () = moving => {}
        }
        let last_movement = Instant::now();
        quiet
            .expired(|| counter.load(Ordering::Relaxed), || false)
            .await;
        let quiet_for = last_movement.elapsed();
        assert!(
            quiet_for >= limit && quiet_for <= limit + limit / 4,
            "expired {quiet_for:?} after the last movement"
        );
        assert!(started.elapsed() > Duration::from_secs(100));
    }

    /// A long request on an HTTP/2 connection: the bound counts from the request's end, not
    /// from the last check that saw it.
    #[tokio::test(start_paused = true)]
    async fn fires_between_the_limit_and_a_quarter_more_after_being_busy() {
        let limit = Duration::from_secs(60);
        let busy_until = Instant::now() + Duration::from_secs(40);
        let mut quiet = Quiet::new(limit, 0);
        quiet.expired(|| 0, || Instant::now() < busy_until).await;
        let quiet_for = busy_until.elapsed();
        assert!(
            quiet_for >= limit && quiet_for <= limit + limit / 4,
            "expired {quiet_for:?} after the busy spell ended"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn busy_keeps_it_from_expiring() {
        let mut quiet = Quiet::new(Duration::from_secs(10), 0);
        let expired = tokio::time::timeout(Duration::from_secs(100), quiet.expired(|| 0, || true));
        assert!(expired.await.is_err());
    }
}
