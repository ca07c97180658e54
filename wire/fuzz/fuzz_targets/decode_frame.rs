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
    let _ = Welcome::decode(payload);
    let _ = BatchRequest::decode(payload);
    let _ = ErrorFrame::decode(payload);
    let _ = Cancel::decode(payload);
    if let Ok(head) = BatchHead::decode(payload, payload.len() as u64) {
        // A decoded head must describe bytes inside the payload.
        for t in &head.tensors {
            assert!(t.offset + t.nbytes <= payload.len() as u64);
        }
    }
});
