//! The frame decoder on arbitrary bytes: never panics, never reads past its input, and
//! whatever it accepts re-encodes to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nvstore_messenger::frame::{encode_frame, parse_frame, Header, Parsed, HEADER_SIZE};

const MAX: u32 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    loop {
        match parse_frame(rest, MAX) {
            Ok(Parsed::Frame(h)) => {
                let total = h.frame_len();
                assert!(total <= rest.len(), "frame longer than its input");
                let payload = &rest[HEADER_SIZE..HEADER_SIZE + h.payload_len as usize];
                assert_eq!(
                    encode_frame(&h, payload),
                    &rest[..total],
                    "accepted bytes do not re-encode"
                );
                rest = &rest[total..];
            }
            Ok(Parsed::NeedMore(n)) => {
                assert!(n > 0);
                break;
            }
            Err(_) => break,
        }
    }
    for w in data.windows(HEADER_SIZE).take(64) {
        let w: &[u8; HEADER_SIZE] = w.try_into().unwrap();
        if let Ok(h) = Header::decode(w, MAX) {
            assert!(h.payload_len <= MAX);
            assert_eq!(&h.encode(), w, "accepted header does not re-encode");
        }
    }
});
