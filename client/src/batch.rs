//! A batch as the trainer receives it: metadata plus tensors that are views of one buffer.

use crate::buffer::AlignedBuf;
use std::sync::Arc;
use stoker_wire::{BatchHead, DType, Skipped, TensorMeta};

pub struct Batch {
    pub epoch: u64,
    pub global_batch: u64,
    pub rank: u32,
    pub world_size: u32,
    /// Dataset sample ids, in row order.
    pub sample_ids: Vec<u64>,
    /// Samples the worker could not serve, and why (the batch is short by these).
    pub skipped: Vec<Skipped>,
    pub tensors: Vec<TensorMeta>,
    /// The whole frame payload; every tensor lies inside it at its aligned offset.
    pub payload: Arc<AlignedBuf>,
    /// The worker that served it.
    pub worker: String,
}

/// One tensor of a batch: metadata and its bytes, borrowed from the batch payload.
pub struct TensorView<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [u64],
    pub bytes: &'a [u8],
}

impl Batch {
    pub(crate) fn new(head: BatchHead, payload: AlignedBuf, worker: String) -> Self {
        Batch {
            epoch: head.request.epoch,
            global_batch: head.request.global_batch,
            rank: head.request.rank,
            world_size: head.request.world_size,
            sample_ids: head.sample_ids,
            skipped: head.skipped,
            tensors: head.tensors,
            payload: Arc::new(payload),
            worker,
        }
    }

    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .map(|t| self.view(t))
    }

    pub fn views(&self) -> impl Iterator<Item = TensorView<'_>> {
        self.tensors.iter().map(|t| self.view(t))
    }

    fn view<'a>(&'a self, t: &'a TensorMeta) -> TensorView<'a> {
        // The head decoder checked that every tensor lies inside the payload.
        let start = t.offset as usize;
        TensorView {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.shape,
            bytes: &self.payload.as_slice()[start..start + t.nbytes as usize],
        }
    }

    /// Bytes of the frame payload (head and tensors).
    pub fn payload_bytes(&self) -> u64 {
        self.payload.len() as u64
    }
}
