//! Every sample's sequence length for one set of preprocessing settings, stored beside the
//! index (`stoker dataset stats --write-lengths`), so a worker knows each sample's cost without
//! decoding a pixel: the token-aware plan assigns ranks and buckets lengths by it.

use super::le_u32s::LeU32s;
use crate::source::{ReadCap, Store};
use bytes::Bytes;
use std::cmp::Reverse;

/// Where `stoker dataset stats --write-lengths` writes the lengths, at the dataset root.
pub const LENGTHS_KEY: &str = "stoker-lengths.bin";
/// The largest lengths file a worker reads: 4 bytes a sample, so a billion samples.
pub const LENGTHS_CAP: ReadCap = ReadCap {
    bytes: 4 << 30,
    name: "a lengths file's 4 GiB cap",
};

/// The file: this magic, the index version and preprocessing id (u64 LE each), the sample
/// count (u64 LE), then one u32 LE per sample. 4 bytes a sample, read without parsing (the
/// JSON it replaces was ~10 bytes a sample and a parse of them all at every worker start).
const MAGIC: &[u8; 8] = b"STKLEN\0\x01";
const HEADER: usize = 8 + 3 * 8;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampleLengths {
    /// The index they were measured on ([`DatasetIndex::version`](super::index::DatasetIndex)).
    pub index_version: u64,
    /// The preprocessing they were measured with (preset, limits, tokenizer and template).
    pub preprocessing: u64,
    /// Tokens per sample id (0 for a sample that could not be loaded), held where the file's
    /// bytes are.
    pub tokens: LeU32s,
}

impl SampleLengths {
    /// The stored lengths, if they describe this index and these preprocessing settings.
    pub async fn load(
        store: &Store,
        index_version: u64,
        preprocessing: u64,
        num_samples: u64,
    ) -> anyhow::Result<SampleLengths> {
        let fix =
            "run `stoker dataset stats DATA --write-lengths` with the worker's preprocessing flags";
        let data = store
            .get_at_most(LENGTHS_KEY, LENGTHS_CAP)
            .await
            .map_err(|e| {
                anyhow::anyhow!(
                    "--balance-ranks, --bucket-by-length and --pack-max-tokens need {}: {e}; {fix}",
                    store.describe(LENGTHS_KEY)
                )
            })?;
        let lengths = SampleLengths::from_bytes(data)
            .map_err(|e| anyhow::anyhow!("{}: {e}; {fix}", store.describe(LENGTHS_KEY)))?;
        anyhow::ensure!(
            lengths.index_version == index_version && lengths.tokens.len() as u64 == num_samples,
            "{} was measured on another index (the shards changed); {fix}",
            store.describe(LENGTHS_KEY)
        );
        anyhow::ensure!(
            lengths.preprocessing == preprocessing,
            "{} was measured with other preprocessing settings (preset, limits, tokenizer or template); {fix}",
            store.describe(LENGTHS_KEY)
        );
        Ok(lengths)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + 4 * self.tokens.len());
        out.extend_from_slice(MAGIC);
        for v in [
            self.index_version,
            self.preprocessing,
            self.tokens.len() as u64,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for t in self.tokens.iter() {
            out.extend_from_slice(&t.to_le_bytes());
        }
        out
    }

    /// Lengths from [`to_bytes`](Self::to_bytes)' output; a cut, padded or foreign file is an
    /// error (the count must be what the bytes hold: nothing is allocated that they do not back).
    /// The lengths stay in `data`.
    pub fn from_bytes(data: impl Into<Bytes>) -> anyhow::Result<SampleLengths> {
        let data: Bytes = data.into();
        anyhow::ensure!(
            data.len() >= HEADER && data[..8] == MAGIC[..],
            "not a lengths file of this version (rewrite it with this stoker)"
        );
        let word = |i: usize| u64::from_le_bytes(data[8 + 8 * i..16 + 8 * i].try_into().unwrap());
        let count = word(2);
        anyhow::ensure!(
            (data.len() - HEADER) as u64 == count.saturating_mul(4),
            "{count} samples announced, {} bytes of lengths held",
            data.len() - HEADER
        );
        Ok(SampleLengths {
            index_version: word(0),
            preprocessing: word(1),
            tokens: LeU32s::from_bytes(data.slice(HEADER..)),
        })
    }

    /// Every sample fits a pack of `max_tokens`, or an error naming the longest.
    pub fn check_fit(&self, max_tokens: u32) -> anyhow::Result<()> {
        let longest = self
            .tokens
            .iter()
            .enumerate()
            .max_by_key(|&(i, t)| (t, Reverse(i)));
        match longest {
            Some((id, tokens)) if tokens > max_tokens => anyhow::bail!(
                "sample {id} is {tokens} tokens, longer than --pack-max-tokens {max_tokens}: \
                 raise it to at least {tokens}, or truncate samples with --max-length"
            ),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_round_trip_and_a_cut_or_foreign_file_is_refused() {
        let l = SampleLengths {
            index_version: 7,
            preprocessing: u64::MAX - 3,
            tokens: vec![0, 17, 4096, u32::MAX].into(),
        };
        let bytes = l.to_bytes();
        assert_eq!(bytes.len(), 32 + 4 * 4);
        assert_eq!(SampleLengths::from_bytes(bytes.clone()).unwrap(), l);
        for bad in [
            &bytes[..bytes.len() - 1],
            &bytes[..20],
            b"{\"tokens\": []}".as_slice(),
        ] {
            assert!(SampleLengths::from_bytes(bad.to_vec()).is_err());
        }
        // A count the bytes do not back (a hostile 2^62) is refused before any allocation.
        let mut huge = bytes[..32].to_vec();
        huge[24..32].copy_from_slice(&(1u64 << 62).to_le_bytes());
        let e = SampleLengths::from_bytes(huge).unwrap_err().to_string();
        assert!(
            e.contains("4611686018427387904 samples announced, 0 bytes"),
            "{e}"
        );
    }
}
