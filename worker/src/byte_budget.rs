//! Bytes several concurrent reads may hold together (one sample's media objects): each read
//! takes what it receives as it arrives, so reading stops where the budget is spent, not
//! after the objects are whole.
//!
//! Whether a sample goes over does not depend on timing: it does exactly when its objects
//! together are larger than the budget (a read that fails and is tried again gives its bytes
//! back first), so every worker decides alike.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug)]
pub struct ByteBudget {
    max: u64,
    held: AtomicU64,
}

impl ByteBudget {
    pub fn new(max: u64) -> Self {
        ByteBudget {
            max,
            held: AtomicU64::new(0),
        }
    }

    /// Bytes taken so far.
    #[cfg(test)]
    fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// A claim on this budget that gives its bytes back when dropped, unless kept.
    pub fn claim(&self) -> Claim<'_> {
        Claim {
            budget: self,
            bytes: 0,
        }
    }
}

/// One read's bytes of a [`ByteBudget`].
#[derive(Debug)]
pub struct Claim<'b> {
    budget: &'b ByteBudget,
    bytes: u64,
}

/// The budget is spent: the read that asked for more stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverBudget {
    pub max: u64,
}

impl Claim<'_> {
    /// Grows the claim to `total` bytes (a no-op when it holds that much already).
    pub fn grow_to(&mut self, total: u64) -> Result<(), OverBudget> {
        let more = total.saturating_sub(self.bytes);
        if more == 0 {
            return Ok(());
        }
        let budget = self.budget;
        let before = budget.held.fetch_add(more, Ordering::Relaxed);
        if before + more > budget.max {
            budget.held.fetch_sub(more, Ordering::Relaxed);
            return Err(OverBudget { max: budget.max });
        }
        self.bytes = total;
        Ok(())
    }

    /// The bytes stay taken: the read succeeded.
    pub fn keep(mut self) {
        self.bytes = 0;
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.budget.held.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_stop_at_the_budget_and_failed_ones_give_their_bytes_back() {
        let budget = ByteBudget::new(100);
        let mut a = budget.claim();
        a.grow_to(60).unwrap();
        a.grow_to(50).unwrap(); // never shrinks
        let mut b = budget.claim();
        assert_eq!(b.grow_to(41), Err(OverBudget { max: 100 }));
        b.grow_to(40).unwrap();
        drop(b); // a failed read
        assert_eq!(budget.held(), 60);
        a.keep();
        let mut c = budget.claim();
        c.grow_to(40).unwrap();
        c.keep();
        assert_eq!(budget.held(), 100);
        assert!(budget.claim().grow_to(1).is_err());
    }
}
