//! Locking the service's shared tables: a panic in one request must not make a
//! sandbox's processes or watchers unreachable for every later one.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks a std mutex, ignoring poisoning (the data stays usable after a panic).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
