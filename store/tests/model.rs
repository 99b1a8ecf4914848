//! Property test: random operation sequences (with reopens and checkpoints between them) give
//! the same results from the store as from an in-memory model of the same API.

mod common;

use std::collections::BTreeMap;

use common::*;
use nvstore_store::{mkfs, ObjectKey, Store, StoreConfig, StoreError};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    WriteFull(u8, usize, u64),
    /// A replace, then this many xattrs set in the same transaction. With cuts, the data is
    /// given as parts cut at these points (each taken modulo the length + 1; repeats make
    /// empty parts): `replace_parts`.
    Replace(u8, usize, u64, u8, Vec<u32>),
    Write(u8, u32, usize, u64),
    Append(u8, usize, u64),
    Remove(u8),
    /// Rename to the partner key (m0 ↔ m1, m2 ↔ m3).
    Rename(u8),
    SetX(u8, u8, usize),
    RmX(u8, u8),
    Reopen,
    Checkpoint,
}

fn op() -> impl Strategy<Value = Op> {
    let k = 0u8..4;
    let len = prop_oneof![0usize..100, 0usize..70_000, 60_000usize..300_000];
    prop_oneof![
        3 => (k.clone(), len.clone(), any::<u64>()).prop_map(|(k, l, s)| Op::WriteFull(k, l, s)),
        3 => (k.clone(), len.clone(), any::<u64>(), 0u8..3, proptest::collection::vec(any::<u32>(), 0..5)).prop_map(|(k, l, s, x, c)| Op::Replace(k, l, s, x, c)),
        3 => (k.clone(), 0u32..400_000, len.clone(), any::<u64>()).prop_map(|(k, o, l, s)| Op::Write(k, o, l, s)),
        2 => (k.clone(), len, any::<u64>()).prop_map(|(k, l, s)| Op::Append(k, l, s)),
        1 => k.clone().prop_map(Op::Remove),
        2 => k.clone().prop_map(Op::Rename),
        2 => (k.clone(), 0u8..3, 0usize..2000).prop_map(|(k, n, l)| Op::SetX(k, n, l)),
        1 => (k, 0u8..3).prop_map(|(k, n)| Op::RmX(k, n)),
        1 => Just(Op::Reopen),
        1 => Just(Op::Checkpoint),
    ]
}

/// The model's pairing for renames: m0 ↔ m1, m2 ↔ m3.
fn partner(k: &ObjectKey) -> Option<ObjectKey> {
    match &k.name[..] {
        [b'm', d @ b'0'..=b'3'] => Some(ObjectKey::new(
            k.pool,
            [b'm', ((d - b'0') ^ 1) + b'0'],
            k.shard,
        )),
        _ => None,
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Obj {
    data: Vec<u8>,
    xattrs: BTreeMap<String, Vec<u8>>,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn store_matches_model(ops in proptest::collection::vec(op(), 1..40)) {
        let dev = sim(128, 77);
        mkfs(&dev, &mkfs_opts()).unwrap();
        let config = StoreConfig { alias: Some(partner), ..StoreConfig::default() };
        let open = || Store::open(dev.clone(), Some(FSID), config.clone()).unwrap().0;
        let mut s = open();
        let mut model: BTreeMap<u8, Obj> = BTreeMap::new();
        let name = |k: u8| key(&format!("m{k}"));
        for op in &ops {
            match op {
                Op::WriteFull(k, l, seed) => {
                    let d = data(*seed, *l);
                    s.write_full(&name(*k), &d).unwrap();
                    model.entry(*k).or_insert(Obj { data: vec![], xattrs: BTreeMap::new() }).data = d;
                }
                Op::Replace(k, l, seed, x, cuts) => {
                    let d = data(*seed, *l);
                    let xs: Vec<(String, Vec<u8>)> = (0..*x).map(|n| (format!("x{n}"), data(n as u64, 10))).collect();
                    let mut at: Vec<usize> = cuts.iter().map(|c| *c as usize % (d.len() + 1)).collect();
                    at.sort_unstable();
                    let parts: Vec<&[u8]> = std::iter::once(0).chain(at.iter().copied())
                        .zip(at.iter().copied().chain(std::iter::once(d.len())))
                        .map(|(a, b)| &d[a..b])
                        .collect();
                    let mut t = nvstore_store::Transaction::new();
                    if cuts.is_empty() { t.replace(name(*k), &d); } else { t.replace_parts(name(*k), &parts); }
                    for (n, v) in &xs { t.set_xattr(name(*k), n, v); }
                    s.commit(t).unwrap();
                    model.insert(*k, Obj { data: d, xattrs: xs.into_iter().collect() });
                }
                Op::Write(k, off, l, seed) => {
                    let d = data(*seed, *l);
                    s.write(&name(*k), *off as u64, &d).unwrap();
                    let o = model.entry(*k).or_insert(Obj { data: vec![], xattrs: BTreeMap::new() });
                    let end = *off as usize + d.len();
                    if o.data.len() < end { o.data.resize(end, 0); }
                    o.data[*off as usize..end].copy_from_slice(&d);
                }
                Op::Append(k, l, seed) => {
                    let d = data(*seed, *l);
                    s.append(&name(*k), &d).unwrap();
                    model.entry(*k).or_insert(Obj { data: vec![], xattrs: BTreeMap::new() }).data.extend_from_slice(&d);
                }
                Op::Remove(k) => match (s.remove(&name(*k)), model.remove(k)) {
                    (Ok(_), Some(_)) => {}
                    (Err(StoreError::NotFound(_)), None) => {}
                    (r, m) => prop_assert!(false, "remove: store {r:?}, model {m:?}"),
                },
                Op::Rename(k) => {
                    let mut t = nvstore_store::Transaction::new();
                    t.rename(name(*k), name(*k ^ 1));
                    match (s.commit(t), model.remove(k)) {
                        (Ok(_), Some(o)) => { model.insert(*k ^ 1, o); }
                        (Err(StoreError::NotFound(_)), None) => {}
                        (r, m) => prop_assert!(false, "rename: store {r:?}, model {m:?}"),
                    }
                }
                Op::SetX(k, n, l) => {
                    let v = data(*l as u64, *l);
                    let r = s.set_xattr(&name(*k), &format!("x{n}"), &v);
                    match model.get_mut(k) {
                        Some(o) => { r.unwrap(); o.xattrs.insert(format!("x{n}"), v); }
                        None => prop_assert!(matches!(r, Err(StoreError::NotFound(_))), "set_xattr on a missing object"),
                    }
                }
                Op::RmX(k, n) => {
                    let r = s.rm_xattr(&name(*k), &format!("x{n}"));
                    match model.get_mut(k).map(|o| o.xattrs.remove(&format!("x{n}"))) {
                        Some(Some(_)) => { r.unwrap(); }
                        Some(None) => prop_assert!(matches!(r, Err(StoreError::NoXattr { .. })), "rm_xattr of a missing name"),
                        None => prop_assert!(matches!(r, Err(StoreError::NotFound(_))), "rm_xattr on a missing object"),
                    }
                }
                Op::Reopen => { drop(s); s = open(); }
                Op::Checkpoint => s.checkpoint().unwrap(),
            }
            for k in 0..4u8 {
                match model.get(&k) {
                    Some(o) => {
                        prop_assert_eq!(&s.read_vec(&name(k), 0, u64::MAX).unwrap(), &o.data, "object {} after {:?}", k, op);
                        prop_assert_eq!(s.stat(&name(k)).unwrap().checksum, nvstore_store::content_checksum(&o.data, 64 << 10));
                        prop_assert_eq!(&s.xattrs(&name(k)).unwrap(), &o.xattrs);
                    }
                    None => prop_assert!(!s.exists(&name(k))),
                }
            }
            let listed: Vec<_> = s.list(1, None, 100).into_iter().map(|(k, st)| (k, st.size)).collect();
            let want: Vec<_> = model.iter().map(|(k, o)| (name(*k), o.data.len() as u64)).collect();
            prop_assert_eq!(listed, want);
        }
    }
}
