//! Cluster secret, identities and the mutual HMAC-SHA256 challenge–response handshake.
//!
//! ```text
//! connecting side (C)                                  accepting side (S)
//!   Hello     { C identity, expected S identity, Nc } ─▶
//!                                                    ◀─ Challenge { S identity, Ns, proof_S }
//!   Response  { proof_C }                           ─▶
//!                                                    ◀─ Accept {}
//! proof_S = HMAC(K, "nvstore-msgr-v1 S" ‖ Nc ‖ Ns ‖ C id ‖ S id)
//! proof_C = HMAC(K, "nvstore-msgr-v1 C" ‖ Nc ‖ Ns ‖ C id ‖ S id)
//! ```
//!
//! Both nonces are fresh 32-byte random values, so a recorded exchange cannot be replayed; the
//! direction labels differ, so one side's proof cannot be reflected back as the other's; both
//! identities are inside the MAC, so a proof cannot be reused for another identity. The
//! handshake is a pure state machine (no sockets) so tests and the fuzz target drive it directly.

use std::fmt;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::str::FromStr;

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use zerocopy::byteorder::little_endian::U32;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::error::{AuthFailure, Error, Result, Violation};
use crate::frame::{FrameKind, Header};

/// Bytes of the cluster secret.
pub const SECRET_BYTES: usize = 32;
pub const NONCE_BYTES: usize = 32;
pub const PROOF_BYTES: usize = 32;
const LABEL_SERVER: &[u8] = b"nvstore-msgr-v1 S";
const LABEL_CLIENT: &[u8] = b"nvstore-msgr-v1 C";

/// The shared cluster key. The key file holds it as 64 hex digits (one line, `#` comments
/// allowed) and must not be readable by group or others, like an ssh key or a Ceph keyring.
#[derive(Clone)]
pub struct Secret([u8; SECRET_BYTES]);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    pub fn from_bytes(bytes: [u8; SECRET_BYTES]) -> Secret {
        Secret(bytes)
    }

    pub fn generate() -> Secret {
        let mut b = [0u8; SECRET_BYTES];
        rand::rngs::OsRng.fill_bytes(&mut b);
        Secret(b)
    }

    /// Write the key file (mode 0600, created new: an existing file is not overwritten).
    pub fn save(&self, path: &Path) -> Result<()> {
        let err = |detail: String| Error::KeyFile {
            path: path.to_owned(),
            detail,
        };
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| err(format!("cannot create: {e}")))?;
        let hex: String = self.0.iter().map(|b| format!("{b:02x}")).collect();
        writeln!(f, "# nvstore cluster secret\n{hex}").map_err(|e| err(format!("write: {e}")))
    }

    /// Read a key file written by [`Secret::save`] (or by hand in the same format).
    pub fn load(path: &Path) -> Result<Secret> {
        let err = |detail: String| Error::KeyFile {
            path: path.to_owned(),
            detail,
        };
        let meta = std::fs::metadata(path).map_err(|e| err(format!("cannot stat: {e}")))?;
        let mode = meta.permissions().mode();
        if mode & 0o077 != 0 {
            return Err(err(format!(
                "mode {:o} lets group or others read it; chmod 600",
                mode & 0o777
            )));
        }
        let text = std::fs::read_to_string(path).map_err(|e| err(format!("cannot read: {e}")))?;
        let line = text
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty() && !l.starts_with('#'))
            .ok_or_else(|| err("no key line".into()))?;
        if line.len() != SECRET_BYTES * 2 {
            return Err(err(format!(
                "key must be {} hex digits, found {}",
                SECRET_BYTES * 2,
                line.len()
            )));
        }
        let mut b = [0u8; SECRET_BYTES];
        for (i, out) in b.iter_mut().enumerate() {
            *out = u8::from_str_radix(&line[2 * i..2 * i + 2], 16)
                .map_err(|_| err(format!("non-hex character near digit {}", 2 * i)))?;
        }
        Ok(Secret(b))
    }

    fn mac(
        &self,
        label: &[u8],
        nc: &[u8; NONCE_BYTES],
        ns: &[u8; NONCE_BYTES],
        c: Identity,
        s: Identity,
    ) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(label);
        mac.update(nc);
        mac.update(ns);
        mac.update(WireIdentity::from(c).as_bytes());
        mac.update(WireIdentity::from(s).as_bytes());
        mac
    }

    fn proof(
        &self,
        label: &[u8],
        nc: &[u8; NONCE_BYTES],
        ns: &[u8; NONCE_BYTES],
        c: Identity,
        s: Identity,
    ) -> [u8; PROOF_BYTES] {
        self.mac(label, nc, ns, c, s).finalize().into_bytes().into()
    }

    /// Constant-time check of a peer's proof.
    fn verify(
        &self,
        label: &[u8],
        nc: &[u8; NONCE_BYTES],
        ns: &[u8; NONCE_BYTES],
        c: Identity,
        s: Identity,
        proof: &[u8; PROOF_BYTES],
    ) -> bool {
        self.mac(label, nc, ns, c, s).verify_slice(proof).is_ok()
    }
}

/// Who is at the other end of a connection: `client.N` or `node.N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Identity {
    Client(u32),
    Node(u32),
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Identity::Client(n) => write!(f, "client.{n}"),
            Identity::Node(n) => write!(f, "node.{n}"),
        }
    }
}

impl FromStr for Identity {
    type Err = Error;
    fn from_str(s: &str) -> Result<Identity> {
        let bad = || Error::Config(format!("identity {s:?} is not client.N or node.N"));
        let (kind, n) = s.split_once('.').ok_or_else(bad)?;
        let n: u32 = n.parse().map_err(|_| bad())?;
        match kind {
            "client" => Ok(Identity::Client(n)),
            "node" => Ok(Identity::Node(n)),
            _ => Err(bad()),
        }
    }
}

const IDENTITY_CLIENT: u8 = 1;
const IDENTITY_NODE: u8 = 2;

/// An identity on the wire (docs/format.md, "Identity").
#[repr(C)]
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
pub struct WireIdentity {
    pub kind: u8,
    pub reserved: [u8; 3],
    pub id: U32,
}

const _: () = assert!(size_of::<WireIdentity>() == 8);

impl From<Identity> for WireIdentity {
    fn from(i: Identity) -> WireIdentity {
        let (kind, id) = match i {
            Identity::Client(n) => (IDENTITY_CLIENT, n),
            Identity::Node(n) => (IDENTITY_NODE, n),
        };
        WireIdentity {
            kind,
            reserved: [0; 3],
            id: U32::new(id),
        }
    }
}

impl WireIdentity {
    fn decode(&self) -> Result<Identity, Violation> {
        if self.reserved != [0; 3] {
            return Err(Violation::BadHandshake {
                detail: "identity reserved bytes not zero",
            });
        }
        match self.kind {
            IDENTITY_CLIENT => Ok(Identity::Client(self.id.get())),
            IDENTITY_NODE => Ok(Identity::Node(self.id.get())),
            _ => Err(Violation::BadHandshake {
                detail: "unknown identity kind",
            }),
        }
    }
}

/// Hello payload (docs/format.md, "Handshake").
#[repr(C)]
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
pub struct HelloMsg {
    pub client: WireIdentity,
    pub expected_server: WireIdentity,
    pub nonce: [u8; NONCE_BYTES],
}

/// Challenge payload.
#[repr(C)]
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
pub struct ChallengeMsg {
    pub server: WireIdentity,
    pub nonce: [u8; NONCE_BYTES],
    pub proof: [u8; PROOF_BYTES],
}

/// Response payload.
#[repr(C)]
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
pub struct ResponseMsg {
    pub proof: [u8; PROOF_BYTES],
}

pub const HELLO_SIZE: usize = 48;
pub const CHALLENGE_SIZE: usize = 72;
pub const RESPONSE_SIZE: usize = 32;
pub const ACCEPT_SIZE: usize = 0;
const _: () = assert!(size_of::<HelloMsg>() == HELLO_SIZE);
const _: () = assert!(std::mem::offset_of!(HelloMsg, expected_server) == 8);
const _: () = assert!(std::mem::offset_of!(HelloMsg, nonce) == 16);
const _: () = assert!(size_of::<ChallengeMsg>() == CHALLENGE_SIZE);
const _: () = assert!(std::mem::offset_of!(ChallengeMsg, nonce) == 8);
const _: () = assert!(std::mem::offset_of!(ChallengeMsg, proof) == 40);
const _: () = assert!(size_of::<ResponseMsg>() == RESPONSE_SIZE);

/// Why a handshake stopped: the peer broke the protocol, or failed authentication.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    Protocol(Violation),
    Auth(AuthFailure),
}

impl From<Violation> for Rejection {
    fn from(v: Violation) -> Rejection {
        Rejection::Protocol(v)
    }
}

/// What the connection does after feeding a handshake frame.
#[derive(Debug, PartialEq, Eq)]
pub enum HsStep {
    /// Send this frame and wait for the next one.
    Send(FrameKind, Vec<u8>),
    /// Authenticated: bind `peer` to the connection; send `reply` first when present.
    Done {
        peer: Identity,
        reply: Option<(FrameKind, Vec<u8>)>,
    },
}

fn expect_frame<'a, T: FromBytes + KnownLayout + Immutable>(
    header: &Header,
    kind: FrameKind,
    payload: &'a [u8],
    phase: &'static str,
) -> Result<&'a T, Rejection> {
    if header.kind != kind {
        return Err(Violation::UnexpectedKind {
            kind: header.kind as u8,
            phase,
        }
        .into());
    }
    if header.txn != 0 || header.msg_type != 0 {
        return Err(Violation::BadHandshake {
            detail: "txn and msg_type must be 0",
        }
        .into());
    }
    T::ref_from_bytes(payload).map_err(|_| {
        Violation::BadHandshake {
            detail: "payload has the wrong size",
        }
        .into()
    })
}

/// The accepting side.
pub struct ServerHandshake {
    me: Identity,
    nonce: [u8; NONCE_BYTES],
    state: ServerState,
}

enum ServerState {
    AwaitHello,
    AwaitResponse {
        client: Identity,
        client_nonce: [u8; NONCE_BYTES],
    },
    Done,
}

impl ServerHandshake {
    /// `nonce` must be fresh randomness ([`fresh_nonce`]); tests pass fixed values.
    pub fn new(me: Identity, nonce: [u8; NONCE_BYTES]) -> ServerHandshake {
        ServerHandshake {
            me,
            nonce,
            state: ServerState::AwaitHello,
        }
    }

    pub fn on_frame(
        &mut self,
        secret: &Secret,
        header: &Header,
        payload: &[u8],
    ) -> Result<HsStep, Rejection> {
        match std::mem::replace(&mut self.state, ServerState::Done) {
            ServerState::AwaitHello => {
                let hello: &HelloMsg =
                    expect_frame(header, FrameKind::Hello, payload, "before Hello")?;
                let client = hello.client.decode()?;
                let expected = hello.expected_server.decode()?;
                if expected != self.me {
                    return Err(Rejection::Auth(AuthFailure::WrongPeer {
                        expected,
                        found: self.me,
                    }));
                }
                let proof = secret.proof(LABEL_SERVER, &hello.nonce, &self.nonce, client, self.me);
                let msg = ChallengeMsg {
                    server: self.me.into(),
                    nonce: self.nonce,
                    proof,
                };
                self.state = ServerState::AwaitResponse {
                    client,
                    client_nonce: hello.nonce,
                };
                Ok(HsStep::Send(FrameKind::Challenge, msg.as_bytes().to_vec()))
            }
            ServerState::AwaitResponse {
                client,
                client_nonce,
            } => {
                let resp: &ResponseMsg =
                    expect_frame(header, FrameKind::Response, payload, "before Response")?;
                if !secret.verify(
                    LABEL_CLIENT,
                    &client_nonce,
                    &self.nonce,
                    client,
                    self.me,
                    &resp.proof,
                ) {
                    return Err(Rejection::Auth(AuthFailure::BadProof));
                }
                Ok(HsStep::Done {
                    peer: client,
                    reply: Some((FrameKind::Accept, Vec::new())),
                })
            }
            ServerState::Done => Err(Violation::UnexpectedKind {
                kind: header.kind as u8,
                phase: "after handshake",
            }
            .into()),
        }
    }
}

/// The connecting side.
pub struct ClientHandshake {
    me: Identity,
    expected: Identity,
    nonce: [u8; NONCE_BYTES],
    state: ClientState,
}

enum ClientState {
    AwaitChallenge,
    AwaitAccept,
    Done,
}

impl ClientHandshake {
    pub fn new(me: Identity, expected: Identity, nonce: [u8; NONCE_BYTES]) -> ClientHandshake {
        ClientHandshake {
            me,
            expected,
            nonce,
            state: ClientState::AwaitChallenge,
        }
    }

    /// The Hello frame payload to send first.
    pub fn hello(&self) -> (FrameKind, Vec<u8>) {
        let msg = HelloMsg {
            client: self.me.into(),
            expected_server: self.expected.into(),
            nonce: self.nonce,
        };
        (FrameKind::Hello, msg.as_bytes().to_vec())
    }

    pub fn on_frame(
        &mut self,
        secret: &Secret,
        header: &Header,
        payload: &[u8],
    ) -> Result<HsStep, Rejection> {
        match std::mem::replace(&mut self.state, ClientState::Done) {
            ClientState::AwaitChallenge => {
                let ch: &ChallengeMsg =
                    expect_frame(header, FrameKind::Challenge, payload, "before Challenge")?;
                let server = ch.server.decode()?;
                if server != self.expected {
                    return Err(Rejection::Auth(AuthFailure::WrongPeer {
                        expected: self.expected,
                        found: server,
                    }));
                }
                if !secret.verify(
                    LABEL_SERVER,
                    &self.nonce,
                    &ch.nonce,
                    self.me,
                    server,
                    &ch.proof,
                ) {
                    return Err(Rejection::Auth(AuthFailure::BadProof));
                }
                let proof = secret.proof(LABEL_CLIENT, &self.nonce, &ch.nonce, self.me, server);
                self.state = ClientState::AwaitAccept;
                Ok(HsStep::Send(
                    FrameKind::Response,
                    ResponseMsg { proof }.as_bytes().to_vec(),
                ))
            }
            ClientState::AwaitAccept => {
                let _: &[u8; ACCEPT_SIZE] =
                    expect_frame(header, FrameKind::Accept, payload, "before Accept")?;
                Ok(HsStep::Done {
                    peer: self.expected,
                    reply: None,
                })
            }
            ClientState::Done => Err(Violation::UnexpectedKind {
                kind: header.kind as u8,
                phase: "after handshake",
            }
            .into()),
        }
    }
}

pub fn fresh_nonce() -> [u8; NONCE_BYTES] {
    let mut n = [0u8; NONCE_BYTES];
    rand::rngs::OsRng.fill_bytes(&mut n);
    n
}

/// A handshake frame's header (txn and msg_type are always 0).
pub fn handshake_header(kind: FrameKind, payload_len: usize) -> Header {
    Header {
        kind,
        flags: 0,
        txn: 0,
        payload_len: payload_len as u32,
        msg_type: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(
        cs: &Secret,
        ss: &Secret,
        me: Identity,
        want: Identity,
        server_is: Identity,
    ) -> Result<(Identity, Identity), Rejection> {
        let mut c = ClientHandshake::new(me, want, [1; 32]);
        let mut s = ServerHandshake::new(server_is, [2; 32]);
        let (k, p) = c.hello();
        let HsStep::Send(k, p) = s.on_frame(ss, &handshake_header(k, p.len()), &p)? else {
            panic!("server done early")
        };
        let HsStep::Send(k, p) = c.on_frame(cs, &handshake_header(k, p.len()), &p)? else {
            panic!("client done early")
        };
        let HsStep::Done {
            peer: sp,
            reply: Some((k, p)),
        } = s.on_frame(ss, &handshake_header(k, p.len()), &p)?
        else {
            panic!("server not done")
        };
        let HsStep::Done {
            peer: cp,
            reply: None,
        } = c.on_frame(cs, &handshake_header(k, p.len()), &p)?
        else {
            panic!("client not done")
        };
        Ok((sp, cp))
    }

    #[test]
    fn same_secret_authenticates_both_ways_and_binds_identities() {
        let k = Secret::generate();
        assert_eq!(
            run(
                &k,
                &k,
                Identity::Client(4),
                Identity::Node(2),
                Identity::Node(2)
            ),
            Ok((Identity::Client(4), Identity::Node(2)))
        );
    }

    #[test]
    fn wrong_secret_is_refused_by_the_client_when_the_server_is_wrong() {
        let r = run(
            &Secret::generate(),
            &Secret::generate(),
            Identity::Client(1),
            Identity::Node(1),
            Identity::Node(1),
        );
        assert_eq!(r, Err(Rejection::Auth(AuthFailure::BadProof)));
    }

    #[test]
    fn wrong_secret_on_the_client_is_refused_by_the_server() {
        // Client checks the server proof first, so forge a client that skips that check: feed
        // the server a Response made with another key.
        let ks = Secret::generate();
        let kc = Secret::generate();
        let mut s = ServerHandshake::new(Identity::Node(1), [2; 32]);
        let hello = HelloMsg {
            client: Identity::Client(9).into(),
            expected_server: Identity::Node(1).into(),
            nonce: [1; 32],
        };
        let HsStep::Send(_, ch) = s
            .on_frame(
                &ks,
                &handshake_header(FrameKind::Hello, HELLO_SIZE),
                hello.as_bytes(),
            )
            .unwrap()
        else {
            panic!()
        };
        let ch = ChallengeMsg::read_from_bytes(&ch).unwrap();
        let proof = kc.proof(
            LABEL_CLIENT,
            &[1; 32],
            &ch.nonce,
            Identity::Client(9),
            Identity::Node(1),
        );
        let r = s.on_frame(
            &ks,
            &handshake_header(FrameKind::Response, RESPONSE_SIZE),
            ResponseMsg { proof }.as_bytes(),
        );
        assert_eq!(r, Err(Rejection::Auth(AuthFailure::BadProof)));
    }

    #[test]
    fn reflected_server_proof_is_not_a_client_proof() {
        let k = Secret::generate();
        let mut s = ServerHandshake::new(Identity::Node(1), [2; 32]);
        let hello = HelloMsg {
            client: Identity::Client(9).into(),
            expected_server: Identity::Node(1).into(),
            nonce: [1; 32],
        };
        let HsStep::Send(_, ch) = s
            .on_frame(
                &k,
                &handshake_header(FrameKind::Hello, HELLO_SIZE),
                hello.as_bytes(),
            )
            .unwrap()
        else {
            panic!()
        };
        let ch = ChallengeMsg::read_from_bytes(&ch).unwrap();
        let r = s.on_frame(
            &k,
            &handshake_header(FrameKind::Response, RESPONSE_SIZE),
            ResponseMsg { proof: ch.proof }.as_bytes(),
        );
        assert_eq!(r, Err(Rejection::Auth(AuthFailure::BadProof)));
    }

    #[test]
    fn connecting_to_the_wrong_node_is_refused() {
        let k = Secret::generate();
        let r = run(
            &k,
            &k,
            Identity::Client(1),
            Identity::Node(1),
            Identity::Node(2),
        );
        assert!(matches!(
            r,
            Err(Rejection::Auth(AuthFailure::WrongPeer { .. }))
        ));
    }

    #[test]
    fn key_file_round_trips_and_open_permissions_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster.key");
        let k = Secret::generate();
        k.save(&path).unwrap();
        assert_eq!(Secret::load(&path).unwrap().0, k.0);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(Secret::load(&path), Err(Error::KeyFile { .. })));
    }

    #[test]
    fn identities_parse_and_print() {
        assert_eq!(
            "client.12".parse::<Identity>().unwrap(),
            Identity::Client(12)
        );
        assert_eq!(Identity::Node(3).to_string(), "node.3");
        assert!("osd.1".parse::<Identity>().is_err());
    }
}
