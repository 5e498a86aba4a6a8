//! Locks whose holders never panic while holding them.

use std::sync::{Mutex, MutexGuard};

/// Takes `mutex`. No holder panics while holding it, so a poisoned lock (which would mean
/// one did anyway) is used as it is rather than spreading the panic.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
