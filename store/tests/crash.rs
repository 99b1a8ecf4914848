//! Crash suite on SimDevice: seeded random workloads over every operation, power failure at a
//! random write IO (unflushed writes kept, dropped or torn at 512-byte sectors, completions
//! reordered), reopen, verify against a model:
//! * every acknowledged transaction is visible;
//! * the transaction in flight at the crash is fully applied or not at all;
//! * nothing else exists; no read fails its crc (scrub is clean).
//!
//! Each seed runs several crash cycles on the same device. `deterministic_crash_points`
//! is single-client with explicit checkpoints, so its IO sequence — and a failure — replays
//! exactly: `NVSTORE_CRASH_SEED=<seed> cargo test -p nvstore-store --test crash`.
//! `concurrent_crash_points` adds four clients, automatic checkpoints and the cleaner (it
//! replays with high probability). By default 1 000 and 40 seeds run (3 120 crash points);
//! `NVSTORE_CRASH_SEEDS=<n>` sets seeds per test (long mode: 3500 → over 10 000 crash points
//! per test); `NVSTORE_CRASH_SEED_FROM=<s>` starts the seeds at `s` instead of 0.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::*;
use driver::{SimConfig, SimDevice};
use nvstore_store::{mkfs, ObjectKey, Store, StoreConfig, StoreError, Transaction};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Debug, Clone, PartialEq, Eq)]
struct Obj {
    data: Vec<u8>,
    xattrs: BTreeMap<String, Vec<u8>>,
}

type Model = BTreeMap<String, Obj>;

#[derive(Clone)]
enum TOp {
    WriteFull(String, Vec<u8>),
    /// Given as parts cut at these offsets (`replace_parts`) when there are any; with the
    /// chunks' CRCs (`replace_parts_with_crcs`) when the flag is set.
    Replace(String, Vec<u8>, Vec<usize>, bool),
    Write(String, u64, Vec<u8>),
    Append(String, Vec<u8>),
    Remove(String),
    /// Rename to the partner key ([`partner`]).
    Rename(String),
    SetX(String, String, Vec<u8>),
    RmX(String, String),
}

impl std::fmt::Debug for TOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TOp::WriteFull(k, d) => write!(f, "write_full({k}, {} bytes)", d.len()),
            TOp::Replace(k, d, c, _) if c.is_empty() => {
                write!(f, "replace({k}, {} bytes)", d.len())
            }
            TOp::Replace(k, d, c, crcs) => write!(
                f,
                "replace_parts({k}, {} bytes, cut at {c:?}, with crcs: {crcs})",
                d.len()
            ),
            TOp::Write(k, o, d) => write!(f, "write({k}, @{o}, {} bytes)", d.len()),
            TOp::Append(k, d) => write!(f, "append({k}, {} bytes)", d.len()),
            TOp::Remove(k) => write!(f, "remove({k})"),
            TOp::Rename(k) => write!(f, "rename({k} to {})", partner_name(k)),
            TOp::SetX(k, n, v) => write!(f, "set_xattr({k}, {n}, {} bytes)", v.len()),
            TOp::RmX(k, n) => write!(f, "rm_xattr({k}, {n})"),
        }
    }
}

/// Apply to the model; `Err` when the store must refuse it too.
fn apply(model: &mut Model, ops: &[TOp]) -> Result<(), ()> {
    let mut m = model.clone();
    // Keys an op changed so far: the store renames only an object unchanged in the
    // transaction.
    let mut touched = std::collections::BTreeSet::new();
    for op in ops {
        let k = match op {
            TOp::WriteFull(k, _)
            | TOp::Replace(k, ..)
            | TOp::Write(k, ..)
            | TOp::Append(k, _)
            | TOp::Remove(k)
            | TOp::Rename(k)
            | TOp::SetX(k, ..)
            | TOp::RmX(k, _) => k,
        };
        if matches!(op, TOp::Rename(_)) && touched.contains(k) {
            return Err(());
        }
        touched.insert(k.clone());
        match op {
            TOp::WriteFull(k, d) => {
                let o = m.entry(k.clone()).or_insert_with(|| Obj {
                    data: vec![],
                    xattrs: BTreeMap::new(),
                });
                o.data = d.clone();
            }
            TOp::Replace(k, d, ..) => {
                m.insert(
                    k.clone(),
                    Obj {
                        data: d.clone(),
                        xattrs: BTreeMap::new(),
                    },
                );
            }
            TOp::Write(k, _, d) | TOp::Append(k, d) => {
                let o = m.entry(k.clone()).or_insert_with(|| Obj {
                    data: vec![],
                    xattrs: BTreeMap::new(),
                });
                let off = match op {
                    TOp::Write(_, off, _) => *off as usize,
                    _ => o.data.len(),
                };
                if o.data.len() < off + d.len() {
                    o.data.resize(off + d.len(), 0);
                }
                o.data[off..off + d.len()].copy_from_slice(d);
            }
            TOp::Remove(k) => {
                m.remove(k).ok_or(())?;
            }
            TOp::Rename(k) => {
                let o = m.remove(k).ok_or(())?;
                m.insert(partner_name(k), o);
                touched.insert(partner_name(k));
            }
            TOp::SetX(k, n, v) => {
                m.get_mut(k).ok_or(())?.xattrs.insert(n.clone(), v.clone());
            }
            TOp::RmX(k, n) => {
                m.get_mut(k).ok_or(())?.xattrs.remove(n).ok_or(())?;
            }
        }
    }
    *model = m;
    Ok(())
}

fn skey(k: &str) -> ObjectKey {
    ObjectKey::new(1, k.as_bytes(), 0)
}

/// Rename partners: the key names that differ in the lowest bit of their last digit
/// (k0 ↔ k1, c2-k4 ↔ c2-k5).
fn partner_name(k: &str) -> String {
    let mut b = k.as_bytes().to_vec();
    let last = b.last_mut().expect("a key name");
    assert!(last.is_ascii_digit(), "key names end in a digit");
    *last = ((*last - b'0') ^ 1) + b'0';
    String::from_utf8(b).expect("ascii")
}

/// [`partner_name`] as the store's alias.
fn partner(k: &ObjectKey) -> Option<ObjectKey> {
    let name = std::str::from_utf8(&k.name).ok()?;
    name.ends_with(|c: char| c.is_ascii_digit())
        .then(|| ObjectKey::new(k.pool, partner_name(name).as_bytes(), k.shard))
}

fn size(rng: &mut ChaCha8Rng, big: bool) -> usize {
    match rng.gen_range(0..100) {
        0..=59 => rng.gen_range(0..8192),
        60..=89 => rng.gen_range(8192..256 << 10),
        90..=98 => rng.gen_range(256 << 10..4 << 20),
        _ if big => rng.gen_range(4 << 20..=64 << 20),
        _ => rng.gen_range(256 << 10..1 << 20),
    }
}

fn gen_txn(rng: &mut ChaCha8Rng, keys: &[String], model: &Model, big: bool) -> Vec<TOp> {
    let n = if rng.gen_bool(0.2) {
        rng.gen_range(2..4)
    } else {
        1
    };
    (0..n)
        .map(|_| {
            let k = keys[rng.gen_range(0..keys.len())].clone();
            let exists = model.contains_key(&k);
            let seed = rng.gen::<u64>();
            match rng.gen_range(0..100) {
                0..=29 => TOp::WriteFull(k, data(seed, size(rng, big))),
                30..=39 => {
                    let d = data(seed, size(rng, big));
                    // Half as parts: cut at stripe units (whole chunks, as a node's own data
                    // shard) or at random points.
                    let cuts = match rng.gen_range(0..4) {
                        0 => (1..=d.len() / (64 << 10)).map(|i| i * (64 << 10)).collect(),
                        1 => {
                            let mut c: Vec<usize> = (0..rng.gen_range(1..5))
                                .map(|_| rng.gen_range(0..=d.len()))
                                .collect();
                            c.sort_unstable();
                            c
                        }
                        _ => Vec::new(),
                    };
                    let crcs = !cuts.is_empty() && rng.gen_bool(0.5);
                    TOp::Replace(k, d, cuts, crcs)
                }
                40..=59 => {
                    let cur = model.get(&k).map_or(0, |o| o.data.len() as u64);
                    let off = rng.gen_range(0..=cur + 70_000);
                    TOp::Write(k, off, data(seed, rng.gen_range(1..140_000)))
                }
                60..=69 => TOp::Append(k, data(seed, rng.gen_range(0..100_000))),
                70..=74 if exists => TOp::Remove(k),
                75..=79 if exists => TOp::Rename(k),
                80..=91 if exists => TOp::SetX(
                    k,
                    format!("x{}", rng.gen_range(0..4)),
                    data(seed, rng.gen_range(0..3000)),
                ),
                92..=99 if exists => {
                    let names: Vec<_> = model[&k].xattrs.keys().cloned().collect();
                    match names.is_empty() {
                        true => TOp::SetX(k, "x0".into(), vec![1]),
                        false => TOp::RmX(k, names[rng.gen_range(0..names.len())].clone()),
                    }
                }
                _ => TOp::WriteFull(k, data(seed, rng.gen_range(0..5000))),
            }
        })
        .collect()
}

fn run_txn(s: &Store<SimDevice>, ops: &[TOp]) -> Result<u64, StoreError> {
    let mut t = Transaction::new();
    for op in ops {
        match op {
            TOp::WriteFull(k, d) => t.write_full(skey(k), d),
            TOp::Replace(k, d, c, _) if c.is_empty() => t.replace(skey(k), d),
            TOp::Replace(k, d, c, crcs) => {
                let bounds: Vec<usize> = std::iter::once(0)
                    .chain(c.iter().copied())
                    .chain(std::iter::once(d.len()))
                    .collect();
                let parts: Vec<&[u8]> = bounds.windows(2).map(|w| &d[w[0]..w[1]]).collect();
                if *crcs {
                    let chunk_crcs: Vec<u32> = d
                        .chunks(s.chunk_bytes() as usize)
                        .map(crc32c::crc32c)
                        .collect();
                    t.replace_parts_with_crcs(skey(k), &parts, &chunk_crcs)
                } else {
                    t.replace_parts(skey(k), &parts)
                }
            }
            TOp::Write(k, off, d) => t.write(skey(k), *off, d),
            TOp::Append(k, d) => t.append(skey(k), d),
            TOp::Remove(k) => t.remove(skey(k)),
            TOp::Rename(k) => t.rename(skey(k), skey(&partner_name(k))),
            TOp::SetX(k, n, v) => t.set_xattr(skey(k), n, v),
            TOp::RmX(k, n) => t.rm_xattr(skey(k), n),
        };
    }
    s.commit(t)
}

/// The store's content for `keys`.
fn observe(s: &Store<SimDevice>, keys: &[String], ctx: &str) -> Model {
    let mut m = Model::new();
    for k in keys {
        match s.read_vec(&skey(k), 0, u64::MAX) {
            Ok(d) => {
                let xattrs = s
                    .xattrs(&skey(k))
                    .unwrap_or_else(|e| panic!("{ctx}: xattrs of {k}: {e}"));
                m.insert(k.clone(), Obj { data: d, xattrs });
            }
            Err(StoreError::NotFound(_)) => {}
            Err(e) => panic!("{ctx}: reading {k} after reopen: {e}"),
        }
    }
    m
}

/// Compare the observed state with the acknowledged model, or the model plus the pending
/// transaction. Returns the model that matched.
fn check(obs: &Model, acked: &Model, pending: Option<&Vec<TOp>>, ctx: &str) -> Model {
    if obs == acked {
        return acked.clone();
    }
    if let Some(p) = pending {
        let mut after = acked.clone();
        if apply(&mut after, p).is_ok() && obs == &after {
            return after;
        }
    }
    let diff: Vec<_> = acked
        .keys()
        .chain(obs.keys())
        .filter(|k| acked.get(*k) != obs.get(*k))
        .map(|k| {
            let d = |o: Option<&Obj>| {
                o.map(|o| {
                    format!(
                        "{} bytes, {} xattrs, crc {:#x}",
                        o.data.len(),
                        o.xattrs.len(),
                        crc32c::crc32c(&o.data)
                    )
                })
            };
            format!(
                "{k}: acked {:?} vs found {:?}",
                d(acked.get(k)),
                d(obs.get(k))
            )
        })
        .collect();
    panic!("{ctx}: state after crash is neither the acknowledged state nor it plus the pending transaction {pending:?}:\n{}", diff.join("\n"));
}

fn seeds(default: u64) -> Vec<u64> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    if let Ok(s) = std::env::var("NVSTORE_CRASH_SEED") {
        return vec![s.parse().expect("NVSTORE_CRASH_SEED is a number")];
    }
    let var = |name: &str| {
        std::env::var(name).ok().map(|v| {
            v.parse::<u64>()
                .unwrap_or_else(|_| panic!("{name} is a number"))
        })
    };
    // NVSTORE_CRASH_SEED_FROM moves the range, so a long run can explore seeds the default
    // runs never reach.
    let from = var("NVSTORE_CRASH_SEED_FROM").unwrap_or(0);
    (from..from + var("NVSTORE_CRASH_SEEDS").unwrap_or(default)).collect()
}

fn config(auto: bool, cleaner: bool) -> StoreConfig {
    StoreConfig {
        checkpoint_interval_bytes: if auto { 3 << 20 } else { u64::MAX },
        cleaner,
        staging_bytes: 4 << 20,
        alias: Some(partner),
        ..StoreConfig::default()
    }
}

/// Odd seeds open after each crash as a node does (`salvage`): the same guarantees must hold,
/// and a crash is not damage, so the salvage report must be empty (a torn segment header,
/// for one, is rebuilt quietly).
fn open_after_crash(dev: &SimDevice, cfg: StoreConfig, seed: u64, ctx: &str) -> Store<SimDevice> {
    let salvage = seed % 2 == 1;
    let (s, r) = Store::open(dev.clone(), Some(FSID), StoreConfig { salvage, ..cfg })
        .unwrap_or_else(|e| panic!("{ctx}: open after crash failed (salvage {salvage}): {e}"));
    assert!(
        r.salvaged.is_empty(),
        "{ctx}: a crash reported as damage: {:?}",
        r.salvaged
    );
    s
}

fn sim_device(seed: u64, mb: u64) -> SimDevice {
    SimDevice::new(
        SimConfig {
            capacity_blocks: mb * 256,
            atomic_write_bytes: 512,
            reorder: true,
            ..SimConfig::default()
        },
        seed,
    )
}

const CYCLES: usize = 3;

/// One seed of the deterministic suite: CYCLES crash cycles; returns (crash points, outcome
/// counts: in-flight lost, in-flight applied, crashed after the workload finished).
fn deterministic_seed(seed: u64) -> (u64, [u64; 3]) {
    let mut points = 0;
    let mut outcomes = [0u64; 3];
    eprintln!("crash seed {seed} (replay: NVSTORE_CRASH_SEED={seed})");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let big = rng.gen_bool(0.05);
    let keys: Vec<String> = (0..10).map(|i| format!("k{i}")).collect();
    let mut dev = sim_device(seed, 256);
    mkfs(&dev, &mkfs_opts()).unwrap();
    let mut acked = Model::new();
    for cycle in 0..CYCLES {
        let ctx = format!("seed {seed} cycle {cycle}");
        let (s, _) = Store::open(dev.clone(), Some(FSID), config(false, false))
            .unwrap_or_else(|e| panic!("{ctx}: reopen failed: {e}"));
        let obs = observe(&s, &keys, &ctx);
        assert_eq!(obs, acked, "{ctx}: state at open differs from the model");
        let ops = rng.gen_range(3..30);
        dev.power_fail_after(rng.gen_range(1..=ops * 2));
        let mut pending = None;
        for _ in 0..ops {
            if rng.gen_bool(0.1) {
                if s.checkpoint().is_err() {
                    break;
                }
                continue;
            }
            let txn = gen_txn(&mut rng, &keys, &acked, big);
            tracing::debug!("{ctx}: txn {txn:?}");
            let mut next = acked.clone();
            let valid = apply(&mut next, &txn).is_ok();
            match run_txn(&s, &txn) {
                Ok(_) => {
                    assert!(
                        valid,
                        "{ctx}: store accepted {txn:?}, which the model refuses"
                    );
                    acked = next;
                }
                Err(
                    StoreError::NotFound(_) | StoreError::NoXattr { .. } | StoreError::Invalid(_),
                ) if !valid => {}
                Err(StoreError::OutOfSpace { .. }) => break,
                Err(e) => {
                    assert!(dev.is_gone(), "{ctx}: {txn:?} failed before the crash: {e}");
                    pending = Some(txn);
                    break;
                }
            }
        }
        let finished_first = !dev.is_gone();
        drop(s);
        let crashed = dev.crash(seed ^ ((cycle as u64 + 1) * 0x51ed));
        points += 1;
        let s = open_after_crash(&crashed, config(false, false), seed, &ctx);
        let obs = observe(&s, &keys, &ctx);
        let matched = check(&obs, &acked, pending.as_ref(), &ctx);
        outcomes[if finished_first {
            2
        } else if matched == acked {
            0
        } else {
            1
        }] += 1;
        acked = matched;
        let scrub = s.scrub();
        assert!(
            scrub.corrupt.is_empty() && scrub.errors.is_empty(),
            "{ctx}: scrub after crash: {scrub:?}"
        );
        drop(s);
        dev = crashed;
    }
    (points, outcomes)
}

#[test]
fn deterministic_crash_points() {
    let mut points = 0;
    let mut outcomes = [0u64; 3];
    // 1 000 seeds × 3 cycles by default (~20 s in a debug build): the long mode found a bug
    // at seed 966 that 130 seeds never reached.
    for seed in seeds(1000) {
        let (p, o) = deterministic_seed(seed);
        points += p;
        for i in 0..3 {
            outcomes[i] += o[i];
        }
    }
    eprintln!(
        "{points} crash points: {} with the in-flight txn lost, {} with it applied, {} after the workload finished",
        outcomes[0], outcomes[1], outcomes[2]
    );
}

/// Regression (seed 59): an update that kept some of an object's chunks (set_xattr) subtracted
/// the old state's live bytes before adding the new state's, so a segment holding only those
/// chunks hit zero live bytes for an instant and was freed while still referenced; the log
/// later overwrote it and reads after a restart found corrupt chunks.
#[test]
fn regression_live_bytes_never_dip_to_zero_mid_update() {
    deterministic_seed(59);
}

/// Regression (seed 129): a crash tore the first batch of a freshly opened segment. At the next
/// open that head segment held no valid batch, was left marked free, and the next checkpoint
/// took it; the log then wrote over the checkpoint, and the open after the following crash
/// found the checkpoint incomplete.
#[test]
fn regression_torn_head_segment_stays_allocated() {
    deterministic_seed(129);
}

/// Regression (seed 966, found by the long mode): the first open's only batch was written
/// but its segment header was lost in the crash, so the next open found no log and started
/// over in that segment. The second open's crash kept its rewritten segment header but not
/// its batch, and the open after it replayed the first open's never-acknowledged batch, still
/// there behind the new header: removed objects came back. A segment's batches are now never
/// older than its header's generation.
#[test]
fn regression_stale_batch_behind_a_rewritten_segment_header() {
    deterministic_seed(966);
}

/// Regression (seed 59663, found by the long mode with `NVSTORE_CRASH_SEED_FROM`): a 4 MiB
/// write spanning three segments was lost in a crash; the next open ended its replay at the
/// start of the second of them (whose header, from the lost write, was valid and chained the
/// log on to the third) and appended there. That open checkpointed and crashed before its next
/// batch: the open after it started replay mid-segment behind the old header, found no batch,
/// followed the old chain to the third segment (its header torn, rebuilt from its batches) and
/// replayed the lost write's last batch, whose sequence number matched: the object pointed at
/// chunks since overwritten (`Corrupted` on read). The superblock now records the generation
/// that set the replay start, and replay accepts nothing older.
#[test]
fn regression_stale_batch_in_a_chained_segment_behind_the_replay_start() {
    deterministic_seed(59663);
}

#[test]
fn concurrent_crash_points() {
    const CLIENTS: usize = 4;
    let mut points = 0;
    for seed in seeds(40) {
        let seed = seed + 1_000_000;
        eprintln!("concurrent crash seed {seed} (NVSTORE_CRASH_SEED={seed})");
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut dev = sim_device(seed, 96);
        mkfs(&dev, &mkfs_opts()).unwrap();
        let mut acked: Vec<Model> = vec![Model::new(); CLIENTS];
        let keys: Vec<Vec<String>> = (0..CLIENTS)
            .map(|c| (0..6).map(|i| format!("c{c}-k{i}")).collect())
            .collect();
        for cycle in 0..CYCLES {
            let ctx = format!("seed {seed} cycle {cycle}");
            let (s, _) = Store::open(dev.clone(), Some(FSID), config(true, true))
                .unwrap_or_else(|e| panic!("{ctx}: reopen failed: {e}"));
            let s = Arc::new(s);
            dev.power_fail_after(rng.gen_range(1..400));
            let stop = Arc::new(AtomicBool::new(false));
            let results: Vec<(Model, Option<Vec<TOp>>)> = std::thread::scope(|sc| {
                let handles: Vec<_> = (0..CLIENTS)
                    .map(|c| {
                        let (s, stop, dev) = (s.clone(), stop.clone(), dev.clone());
                        let mut model = acked[c].clone();
                        let keys = keys[c].clone();
                        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (c as u64 + 7) << 20 ^ cycle as u64);
                        let ctx = ctx.clone();
                        sc.spawn(move || {
                            for _ in 0..200 {
                                if stop.load(Ordering::Relaxed) {
                                    break;
                                }
                                let txn = gen_txn(&mut rng, &keys, &model, false);
                                let mut next = model.clone();
                                let valid = apply(&mut next, &txn).is_ok();
                                match run_txn(&s, &txn) {
                                    Ok(_) => {
                                        assert!(valid, "{ctx}: store accepted {txn:?}, the model refuses it");
                                        model = next;
                                    }
                                    Err(StoreError::NotFound(_) | StoreError::NoXattr { .. } | StoreError::Invalid(_))
                    if !valid => {}
                                    Err(StoreError::OutOfSpace { .. }) => break,
                                    Err(e) => {
                                        assert!(dev.is_gone(), "{ctx}: client {c}: {txn:?} failed before the crash: {e}");
                                        stop.store(true, Ordering::Relaxed);
                                        return (model, Some(txn));
                                    }
                                }
                            }
                            (model, None)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            drop(Arc::try_unwrap(s).ok().expect("clients are done"));
            let crashed = dev.crash(seed ^ ((cycle as u64 + 1) * 0x7a3));
            points += 1;
            let s = open_after_crash(&crashed, config(true, true), seed, &ctx);
            for (c, (model, pending)) in results.into_iter().enumerate() {
                let obs = observe(&s, &keys[c], &ctx);
                acked[c] = check(&obs, &model, pending.as_ref(), &format!("{ctx} client {c}"));
            }
            let scrub = s.scrub();
            assert!(
                scrub.corrupt.is_empty() && scrub.errors.is_empty(),
                "{ctx}: scrub: {scrub:?}"
            );
            drop(s);
            dev = crashed;
        }
    }
    eprintln!("{points} concurrent crash points");
}

/// Regression (found by stress on `concurrent_crash_points`): a checkpoint that starts when
/// the log head segment has no room for the next batch makes replay start at the end of that
/// segment, which then holds only batches older than the replay start. Once its data died it
/// was freed and reused, and the next open could not follow the log from the replay start:
/// every acknowledged write after the checkpoint was lost, and removed objects came back.
#[test]
fn regression_replay_start_segment_is_not_reused() {
    const SMALL: usize = 4096;
    const OBJ: usize = 256 << 10;
    let dev = sim(48, 7);
    mkfs(&dev, &mkfs_opts()).unwrap();
    let cfg = StoreConfig {
        checkpoint_interval_bytes: u64::MAX,
        cleaner: false,
        ..StoreConfig::default()
    };
    let seg_of = |s: &Store<SimDevice>, k: &ObjectKey| {
        (s.locate(k).unwrap()[0].0 - nvstore_store::format::SEGMENTS_START_BYTES) >> 21
    };
    // On a scratch store: how many objects fill the head segment before one spills over.
    let n = {
        let scratch = sim(48, 8);
        mkfs(&scratch, &mkfs_opts()).unwrap();
        let (s, _) = Store::open(scratch, Some(FSID), cfg.clone()).unwrap();
        s.write_full(&key("a0"), &data(0, SMALL)).unwrap();
        let first = seg_of(&s, &key("a0"));
        let mut n = 1;
        loop {
            let k = key(&format!("a{n}"));
            s.write_full(&k, &data(n, SMALL)).unwrap();
            if seg_of(&s, &k) != first {
                break n;
            }
            n += 1;
        }
    };
    // Fill to the same point and checkpoint there: the replay starts at the segment's end.
    let (s, _) = Store::open(dev.clone(), Some(FSID), cfg.clone()).unwrap();
    for i in 0..n {
        s.write_full(&key(&format!("a{i}")), &data(i, SMALL))
            .unwrap();
    }
    let replay_seg = seg_of(&s, &key(&format!("a{}", n - 1)));
    s.checkpoint().unwrap();
    // The next object opens a new segment; then every object in the old one dies.
    s.write_full(&key("b"), &data(1000, OBJ)).unwrap();
    for i in 0..n {
        s.remove(&key(&format!("a{i}"))).unwrap();
    }
    // Enough writes that the log opens several segments: before the fix the first of them
    // was the replay start segment, freed when the last object in it was removed.
    assert_ne!(seg_of(&s, &key("b")), replay_seg);
    let mut written = Vec::new();
    for i in 0..24u64 {
        let k = format!("c{i}");
        s.write_full(&key(&k), &data(2000 + i, OBJ)).unwrap();
        assert_ne!(
            seg_of(&s, &key(&k)),
            replay_seg,
            "{k} reused the replay start segment"
        );
        written.push((k, 2000 + i));
    }
    drop(s);
    let after = dev.crash(1);
    let (s, report) = Store::open(after, Some(FSID), cfg)
        .unwrap_or_else(|e| panic!("open after the crash failed: {e}"));
    eprintln!("{report:?}");
    for i in 0..n {
        assert!(
            !s.exists(&key(&format!("a{i}"))),
            "a{i} was removed (acknowledged) but came back"
        );
    }
    assert_eq!(
        s.read_vec(&key("b"), 0, OBJ as u64).unwrap(),
        data(1000, OBJ)
    );
    for (k, seed) in written {
        assert_eq!(
            s.read_vec(&key(&k), 0, OBJ as u64)
                .unwrap_or_else(|e| panic!("{k}: {e}")),
            data(seed, OBJ),
            "{k}"
        );
    }
}

/// A checkpoint is encoded on its own thread and written beside the rounds, so writers keep
/// committing while it walks the index, and it sees each object as whatever round last
/// changed it had left it (a fuzzy snapshot). After a power failure, every acknowledged write
/// and remove — before, during and after the checkpoints — is what the store holds: the
/// replay from the checkpoint's start settles every object the walk saw mid-change.
#[test]
fn checkpoints_written_beside_rounds_lose_nothing_across_a_crash() {
    use std::sync::atomic::AtomicU64;
    const OBJECTS: u64 = 100_000;
    const WRITERS: u64 = 4;
    let dev = sim_device(0xc4e7, 256);
    mkfs(&dev, &mkfs_opts()).unwrap();
    let cfg = StoreConfig {
        checkpoint_interval_bytes: u64::MAX,
        cleaner: false,
        ..StoreConfig::default()
    };
    let (s, _) = Store::open(dev.clone(), Some(FSID), cfg.clone()).unwrap();
    let name = |i: u64| format!("o{i:06}");
    // Enough objects that one checkpoint is many batches (about 110 bytes each, 1 MiB batches).
    for first in (0..OBJECTS).step_by(1000) {
        let mut t = Transaction::new();
        for i in first..first + 1000 {
            t.write_full(key(&name(i)), &[]);
        }
        s.commit(t).unwrap();
    }
    let stop = AtomicBool::new(false);
    // Writes acknowledged so far, and how many began after a checkpoint call and were
    // acknowledged before it returned.
    let acked = AtomicU64::new(0);
    let inside = AtomicU64::new(0);
    let in_ckpt = AtomicU64::new(0);
    let (models, ckpt_report) = std::thread::scope(|sc| {
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let (s, stop, acked, inside, in_ckpt, name) =
                    (&s, &stop, &acked, &inside, &in_ckpt, &name);
                sc.spawn(move || {
                    let mut rng = ChaCha8Rng::seed_from_u64(w);
                    // Every object this writer changed: Some(content) or None (removed).
                    let mut model = BTreeMap::new();
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        // Writer w owns the objects i with i % WRITERS == w.
                        let i = rng.gen_range(0..OBJECTS / WRITERS) * WRITERS + w;
                        let k = key(&name(i));
                        let epoch = in_ckpt.load(Ordering::SeqCst);
                        let removed = matches!(model.get(&i), Some(None));
                        let value = if rng.gen_bool(0.2) && !removed {
                            s.remove(&k).unwrap();
                            None
                        } else {
                            let d = data(w << 40 | n, rng.gen_range(0..300));
                            s.write_full(&k, &d).unwrap();
                            Some(d)
                        };
                        // Began and ended inside the same checkpoint call (odd epochs).
                        if epoch % 2 == 1 && in_ckpt.load(Ordering::SeqCst) == epoch {
                            inside.fetch_add(1, Ordering::Relaxed);
                        }
                        model.insert(i, value);
                        acked.fetch_add(1, Ordering::Relaxed);
                        n += 1;
                    }
                    model
                })
            })
            .collect();
        while acked.load(Ordering::Relaxed) < 200 {
            std::thread::yield_now();
        }
        for _ in 0..2 {
            in_ckpt.fetch_add(1, Ordering::SeqCst);
            s.checkpoint().unwrap();
            in_ckpt.fetch_add(1, Ordering::SeqCst);
            let before = acked.load(Ordering::Relaxed);
            while acked.load(Ordering::Relaxed) < before + 200 {
                std::thread::yield_now();
            }
        }
        stop.store(true, Ordering::Relaxed);
        let models: Vec<BTreeMap<u64, Option<Vec<u8>>>> =
            writers.into_iter().map(|h| h.join().unwrap()).collect();
        (models, s.stats())
    });
    eprintln!(
        "{} writes acknowledged, {} of them begun and acknowledged inside a checkpoint call; {} checkpoints",
        acked.load(Ordering::Relaxed),
        inside.load(Ordering::Relaxed),
        ckpt_report.checkpoints
    );
    // A checkpoint that held up the rounds for its whole walk would let through only the
    // few writes already in a round when it began.
    assert!(
        inside.load(Ordering::Relaxed) >= 4 * WRITERS,
        "writers waited out the checkpoints: only {} writes inside them",
        inside.load(Ordering::Relaxed)
    );
    // Power fails with no clean shutdown: only what was flushed survives.
    let crashed = dev.crash(0xc4e7);
    drop(s);
    let (s, report) = Store::open(crashed, Some(FSID), cfg).unwrap();
    eprintln!("{report:?}");
    assert!(
        report.checkpoint_objects >= OBJECTS * 3 / 4,
        "the open did not load the checkpoint: {report:?}"
    );
    for i in 0..OBJECTS {
        let k = key(&name(i));
        let want = match models[(i % WRITERS) as usize].get(&i) {
            Some(v) => v.clone(),
            None => Some(Vec::new()),
        };
        let got = if s.exists(&k) {
            Some(s.read_vec(&k, 0, 1 << 20).unwrap())
        } else {
            None
        };
        assert_eq!(got, want, "{} after the crash", name(i));
    }
    let scrub = s.scrub();
    assert!(
        scrub.corrupt.is_empty() && scrub.errors.is_empty(),
        "{scrub:?}"
    );
}
