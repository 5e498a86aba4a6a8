//! The close-spread window: the last part of the grace period, in which the connections still
//! open are ended one by one, evenly spread over the window, each as cleanly as its protocol
//! allows (docs/lifecycle.md, "The close-spread window").
//!
//! Without it every long-lived connection (a TCP stream, a WebSocket, a gRPC stream) is reset
//! at the same instant when the grace period runs out, and all their clients reconnect at once
//! onto the pods that remain. [`open`] waits for the window, gives each open connection of a
//! side its own time in it and tells the side's connections that the window is open; each
//! connection task waits for its time with [`at_slot`] and ends itself: a FIN each way for TCP,
//! a Close frame for a WebSocket, `grpc-status: 14` trailers for a gRPC stream, the end of the
//! stream or `RST_STREAM(CANCEL)` for other HTTP/2 streams. What is still open at the deadline
//! is reset as before.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::info;

use crate::config::Direction;
use crate::conns::{Connection, Connections};
use crate::drain::{Cancelled, Side, Watch};

/// The part of the window, at its end, in which no connection is given its time: the last
/// ones' peers answer (a FIN, a Close frame) before the deadline resets whatever is left.
/// A tenth of the window, at most a second: peers answer within milliseconds, and an even
/// spread matters more than the margin.
fn answer_time(window: Duration) -> Duration {
    (window / 10).min(Duration::from_secs(1))
}

/// Opens the close-spread window of `side` (its connections go `direction`) when `window`
/// before `deadline` has come, and not before the side's listeners have closed (a client that
/// reconnects must not come back to this proxy): gives each connection of that direction open
/// then its time, evenly spread from then to the answer time before the deadline, oldest
/// first, and tells the side's connections. Does nothing with a zero window.
pub async fn open(
    side: &Side,
    direction: Direction,
    conns: &Connections,
    window: Duration,
    deadline: Instant,
) {
    if window.is_zero() {
        return;
    }
    tokio::time::sleep_until(deadline.checked_sub(window).unwrap_or(deadline).into()).await;
    side.listeners_closed().await;
    let start = Instant::now();
    let last = deadline
        .checked_sub(answer_time(window))
        .unwrap_or(start)
        .max(start);
    let open: Vec<Arc<Connection>> = conns
        .snapshot()
        .into_iter()
        .filter(|conn| conn.direction() == direction)
        .collect();
    for (conn, at) in open.iter().zip(times(open.len(), start, last)) {
        conn.set_spread_at(at);
    }
    if !open.is_empty() {
        info!(
            %direction,
            connections = open.len(),
            over_ms = last.duration_since(start).as_millis() as u64,
            "close spread: ending the connections still open one by one"
        );
    }
    side.spread_close();
}

/// `count` times evenly spread from `start` to `last`, the first at `start`.
fn times(count: usize, start: Instant, last: Instant) -> impl Iterator<Item = Instant> {
    let span = last.duration_since(start);
    let step = if count > 1 {
        span / u32::try_from(count - 1).unwrap_or(u32::MAX)
    } else {
        Duration::ZERO
    };
    (0..count).map(move |i| start + step * u32::try_from(i).unwrap_or(u32::MAX))
}

/// Resolves at `conn`'s time in the close-spread window, once the window is open (`spread` is
/// its side's token); at once for a connection that opened after the window did.
pub async fn at_slot(spread: &Watch, conn: &Connection) {
    Cancelled::new(spread).await;
    if let Some(at) = conn.spread_at() {
        tokio::time::sleep_until(at.into()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_evenly_spread_from_the_start_to_the_last() {
        let start = Instant::now();
        let last = start + Duration::from_secs(9);
        let all: Vec<Duration> = times(10, start, last)
            .map(|at| at.duration_since(start))
            .collect();
        let expected: Vec<Duration> = (0..10).map(Duration::from_secs).collect();
        assert_eq!(all, expected);
        assert_eq!(times(1, start, last).next(), Some(start));
        assert_eq!(times(0, start, last).count(), 0);
    }

    #[test]
    fn the_answer_time_is_a_tenth_of_the_window_and_at_most_a_second() {
        assert_eq!(
            answer_time(Duration::from_secs(5)),
            Duration::from_millis(500)
        );
        assert_eq!(answer_time(Duration::from_secs(60)), Duration::from_secs(1));
    }
}
