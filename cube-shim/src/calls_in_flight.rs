//! The task service's calls being answered, so that the shim exits only once they
//! are. containerd's Shutdown makes the shim's `wait` return, and the ttrpc server then
//! closes every connection at once, answers still to be worked out or written among
//! them (StopPodSandbox failed with "ttrpc: closed" when a Kill was still running).

use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How many task calls are being answered.
#[derive(Debug, Default)]
pub struct CallsInFlight {
    count: Mutex<usize>,
    idle: Condvar,
}

/// One call being answered; it is counted until dropped.
#[must_use = "a call is counted only while its guard lives"]
pub struct Call<'a>(&'a CallsInFlight);

impl CallsInFlight {
    /// Counts a call until the guard returned is dropped (at the end of the handler).
    pub fn enter(&self) -> Call<'_> {
        *self.count.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        Call(self)
    }

    /// Calls being answered now.
    pub fn count(&self) -> usize {
        *self.count.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until no call is being answered, or `limit` has passed (a call that
    /// blocks, such as a Wait on a process that never ends, must not keep the shim
    /// alive); true when none is.
    pub fn wait_idle(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let mut count = self.count.lock().unwrap_or_else(PoisonError::into_inner);
        while *count > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            count = self
                .idle
                .wait_timeout(count, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }
}

impl Drop for Call<'_> {
    fn drop(&mut self) {
        let mut count = self.0.count.lock().unwrap_or_else(PoisonError::into_inner);
        *count = count.saturating_sub(1);
        if *count == 0 {
            self.0.idle.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn waits_for_the_calls_being_answered_and_no_longer_than_its_limit() {
        let calls = Arc::new(CallsInFlight::default());
        assert!(calls.wait_idle(Duration::ZERO), "no call: idle at once");

        let (entered, has_entered) = std::sync::mpsc::channel();
        let (finish, finished) = std::sync::mpsc::channel::<()>();
        let answering = {
            let calls = Arc::clone(&calls);
            std::thread::spawn(move || {
                let _call = calls.enter();
                entered.send(()).unwrap();
                finished.recv().unwrap();
            })
        };
        has_entered.recv().unwrap();
        assert_eq!(calls.count(), 1);
        assert!(
            !calls.wait_idle(Duration::from_millis(20)),
            "a call still being answered is waited for, up to the limit"
        );
        finish.send(()).unwrap();
        assert!(calls.wait_idle(Duration::from_secs(60)));
        assert_eq!(calls.count(), 0);
        answering.join().unwrap();

        // Guards of calls that overlap: idle once the last one ends.
        let first = calls.enter();
        let second = calls.enter();
        drop(first);
        assert_eq!(calls.count(), 1);
        drop(second);
        assert!(calls.wait_idle(Duration::ZERO));
    }
}
