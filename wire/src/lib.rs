//! Stoker's wire format: length-prefixed frames between a trainer client and a worker.
//!
//! Every frame is a fixed 16-byte header followed by `len` payload bytes:
//!
//! ```text
//! magic "STKR" | version u8 | kind u8 | reserved u16 | len u64      (little endian)
//! ```
//!
//! The payload layout per kind is specified in `docs/protocol.md`. Decoding never trusts a
//! length: every offset is bounds-checked, so a hostile or corrupt frame yields an error, never
//! a panic or an unbounded allocation (`decode_*` are fuzzed, see `fuzz/`).
//!
//! Batches are built so that the client can read the payload once into one buffer and hand
//! out every tensor as a view of it: tensor data starts at a 64-byte aligned offset of the
//! payload and each tensor's offset is 64-byte aligned too.

mod codec;
mod frame;
#[cfg(feature = "tokio")]
pub mod io;

pub use codec::{Reader, Writer};
pub use frame::*;
