//! A sample's preparation stops once nobody waits for it: the request it is for was
//! cancelled, timed out or lost its connection, and its task was dropped. The blocking work
//! reads the flag between media, between a frame list's frames and before each packet of a
//! clip, so its CPU slot is free within one image or frame.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Set when the waiting side goes away; read by the work.
#[derive(Debug, Clone, Default)]
pub struct Cancel(Arc<AtomicBool>);

impl Cancel {
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// A guard that sets the flag when it is dropped: the waiting side holds it, so the flag
    /// is set when that side is dropped part way (or done, when nothing reads it any more).
    pub fn on_drop(&self) -> SetOnDrop {
        SetOnDrop(self.clone())
    }
}

pub struct SetOnDrop(Cancel);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0 .0.store(true, Ordering::Relaxed);
    }
}
