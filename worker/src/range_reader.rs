//! An object read by ranges as a demuxer asks for it, not whole: a clip's container index
//! (MP4's `moov`, often at the end) and its packets come in blocks, one block held at a time,
//! so a clip costs a block of memory instead of its size, and measuring it reads only what its
//! header needs.
//!
//! The demuxer runs on the blocking pool and reads synchronously; each block is one range read
//! through the given fetch (the pipeline's, bounded and counted like any read). A store failure
//! is kept for the caller, which names it as the store's (transient), not the clip's.

use crate::source::FetchError;
use bytes::Bytes;
use std::io::{Read, Seek, SeekFrom};
use std::sync::{Arc, Mutex};

/// Bytes read from the store at once.
pub(crate) const BLOCK_BYTES: u64 = 1 << 20;

/// Reads a range `(start, len)` of the object.
pub(crate) type FetchRange = Box<dyn FnMut(u64, u64) -> Result<Bytes, FetchError> + Send>;

pub(crate) struct RangeReader {
    size: u64,
    pos: u64,
    /// The block last read and where it starts.
    block: (u64, Bytes),
    fetch: FetchRange,
    /// Bytes read so far, and the most a demuxer may make this reader read (a container that
    /// seeks back and forth pays for every re-read).
    read: u64,
    max_read: u64,
    /// The store's failure, if one ended a read.
    failure: Arc<Mutex<Option<FetchError>>>,
}

impl RangeReader {
    /// A reader of an object of `size` bytes; its store failures land in `failure`.
    pub(crate) fn new(
        size: u64,
        fetch: FetchRange,
        failure: Arc<Mutex<Option<FetchError>>>,
    ) -> Self {
        RangeReader {
            size,
            pos: 0,
            block: (0, Bytes::new()),
            fetch,
            read: 0,
            max_read: 4 * size + 4 * BLOCK_BYTES,
            failure,
        }
    }

    fn in_block(&self) -> bool {
        let (start, ref b) = self.block;
        self.pos >= start && self.pos < start + b.len() as u64
    }
}

impl Read for RangeReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.pos >= self.size || buf.is_empty() {
            return Ok(0);
        }
        if !self.in_block() {
            let len = BLOCK_BYTES.min(self.size - self.pos);
            if self.read + len > self.max_read {
                return Err(std::io::Error::other(format!(
                    "the container made the reader read {} bytes of a {}-byte object",
                    self.read + len,
                    self.size
                )));
            }
            let bytes = (self.fetch)(self.pos, len).map_err(|e| {
                let message = e.to_string();
                *self.failure.lock().expect("not poisoned") = Some(e);
                std::io::Error::other(message)
            })?;
            if bytes.is_empty() {
                return Ok(0);
            }
            self.read += bytes.len() as u64;
            self.block = (self.pos, bytes);
        }
        let (start, ref b) = self.block;
        let from = (self.pos - start) as usize;
        let n = buf.len().min(b.len() - from);
        buf[..n].copy_from_slice(&b[from..from + n]);
        self.pos += n as u64;
        Ok(n)
    }
}

impl Seek for RangeReader {
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        let target = match to {
            SeekFrom::Start(n) => Some(n),
            SeekFrom::End(d) => self.size.checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        self.pos = target.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "seek before the start")
        })?;
        Ok(self.pos)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reader(
        data: &'static [u8],
        failure: Arc<Mutex<Option<FetchError>>>,
    ) -> (RangeReader, Arc<Mutex<u32>>) {
        let calls = Arc::new(Mutex::new(0));
        let counted = calls.clone();
        let fetch: FetchRange = Box::new(move |start, len| {
            *counted.lock().unwrap() += 1;
            let (s, e) = (start as usize, (start + len) as usize);
            Ok(Bytes::from_static(&data[s..e.min(data.len())]))
        });
        (RangeReader::new(data.len() as u64, fetch, failure), calls)
    }

    #[test]
    fn reads_and_seeks_like_the_whole_object_one_block_at_a_time() {
        let data: &'static [u8] = Box::leak(
            (0..3usize << 20)
                .map(|i| (i % 251) as u8)
                .collect::<Vec<_>>()
                .into_boxed_slice(),
        );
        let (mut r, calls) = reader(data, Arc::default());
        let mut tail = [0u8; 100];
        r.seek(SeekFrom::End(-100)).unwrap();
        r.read_exact(&mut tail).unwrap();
        assert_eq!(&tail[..], &data[data.len() - 100..]);
        r.seek(SeekFrom::Start(0)).unwrap();
        let mut all = Vec::new();
        r.read_to_end(&mut all).unwrap();
        assert_eq!(all, data);
        // The tail's block, then three blocks from the start.
        assert_eq!(*calls.lock().unwrap(), 4);
        assert!(r.seek(SeekFrom::Current(-(4 << 20))).is_err());
    }

    #[test]
    fn a_store_failure_is_kept_for_the_caller() {
        let failure: Arc<Mutex<Option<FetchError>>> = Arc::default();
        let fetch: FetchRange =
            Box::new(|_, _| Err(FetchError::Io("s3://b/clip.mp4".into(), "timed out".into())));
        let mut r = RangeReader::new(10, fetch, failure.clone());
        let e = r.read(&mut [0u8; 4]).unwrap_err();
        assert!(e.to_string().contains("timed out"), "{e}");
        assert!(matches!(*failure.lock().unwrap(), Some(FetchError::Io(..))));
    }
}
