//! Both handshake state machines fed arbitrary frames (kinds, ids, sizes and payloads from the
//! input; the crc layer is fuzzed by frame_decoder). They must never panic, and never
//! authenticate a peer that does not hold the key.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nvstore_messenger::auth::{ClientHandshake, HsStep, ServerHandshake};
use nvstore_messenger::frame::{FrameKind, Header};
use nvstore_messenger::{Identity, Secret};

const KINDS: [FrameKind; 7] = [
    FrameKind::Hello,
    FrameKind::Challenge,
    FrameKind::Response,
    FrameKind::Accept,
    FrameKind::Request,
    FrameKind::Reply,
    FrameKind::OneWay,
];

fuzz_target!(|data: &[u8]| {
    let secret = Secret::from_bytes([7; 32]);
    let mut server = Some(ServerHandshake::new(Identity::Node(1), [1; 32]));
    let mut client = Some(ClientHandshake::new(
        Identity::Client(2),
        Identity::Node(1),
        [2; 32],
    ));
    let mut rest = data;
    while rest.len() >= 3 {
        let kind = KINDS[rest[0] as usize % KINDS.len()];
        let len = (rest[1] as usize % 96).min(rest.len() - 3);
        let odd = rest[2];
        let payload = &rest[3..3 + len];
        rest = &rest[3 + len..];
        let header = Header {
            kind,
            flags: 0,
            txn: u64::from(odd & 1),
            payload_len: len as u32,
            msg_type: u16::from(odd & 2),
        };
        let to_server = odd & 4 == 0;
        if to_server {
            if let Some(s) = server.as_mut() {
                match s.on_frame(&secret, &header, payload) {
                    Ok(HsStep::Done { peer, .. }) => {
                        panic!("server authenticated {peer} without the key")
                    }
                    Ok(HsStep::Send(..)) => {}
                    Err(_) => server = None,
                }
            }
        } else if let Some(c) = client.as_mut() {
            match c.on_frame(&secret, &header, payload) {
                Ok(HsStep::Done { peer, .. }) => {
                    panic!("client authenticated {peer} without the key")
                }
                Ok(HsStep::Send(..)) => {}
                Err(_) => client = None,
            }
        }
    }
});
