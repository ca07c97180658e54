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
        assert!(w.batches_per_epoch > 0);
    }
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
