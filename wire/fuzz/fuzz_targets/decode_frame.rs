//! Feeds arbitrary bytes to every decoder of the protocol: header, then the payload of the
//! kind it names. Decoding must return an error or a value, never panic or over-allocate.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stoker_wire::*;

fuzz_target!(|data: &[u8]| {
    if data.len() < HEADER_LEN {
        return;
    }
    let header: [u8; HEADER_LEN] = data[..HEADER_LEN].try_into().unwrap();
    let payload = &data[HEADER_LEN..];
    // Decode the payload as the header's kind, and, to reach deeper code, as every kind.
    let _ = FrameHeader::decode(&header);
    let _ = Hello::decode(payload);
    if let Ok(w) = Welcome::decode(payload) {
        assert!(w.batches_per_epoch > 0 && w.media.merge_size > 0);
    }
    // The media check answers whatever a batch's ids, grids and counts say, never panics.
    let ints: Vec<i64> = (payload.chunks_exact(8))
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let (ids, rest) = ints.split_at(ints.len() / 2);
    let (images, videos) = rest.split_at(rest.len() / 2);
    let rows = usize::from(header[6] % 5);
    let media = MediaTokens {
        image_token: 7,
        video_token: 8,
        merge_size: u32::from(header[7] % 4),
    };
    let _ = media.check(&BatchMedia {
        input_ids: Ids::Values(ids),
        rows,
        images: MediaGrids {
            grid: images,
            pixel_rows: u64::from(header[8]),
            per_row: None,
        },
        videos: MediaGrids {
            grid: videos,
            pixel_rows: u64::from(header[9]),
            per_row: ids.get(..rows),
        },
        second_per_grid_ts: Some(u64::from(header[10])),
    });
    let _ = BatchRequest::decode(payload);
    let _ = ErrorFrame::decode(payload);
    let _ = Cancel::decode(payload);
    if let Ok(head) = BatchHead::decode(payload, payload.len() as u64) {
        // A decoded head must describe bytes inside the payload, name each tensor once and
        // hold no more tensors than the limit.
        assert!(head.tensors.len() <= MAX_TENSORS);
        for (i, t) in head.tensors.iter().enumerate() {
            assert!(t.offset + t.nbytes <= payload.len() as u64);
            assert!(head.tensors[..i].iter().all(|u| u.name != t.name));
        }
    }
});
