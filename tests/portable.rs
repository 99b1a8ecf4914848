//! Portable disks with real node processes: a node's device file moved to "another host" (a
//! node config with a different `host`, data dir and port, and no `id`) rejoins as the same
//! node; the map records the new host, no PG changes members (nothing must move) and every
//! object reads back exactly. Devices labelled for another node or cluster are refused.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{bytes, Harness};
use nvstore::cluster_cmd::{LocalCluster, LocalOptions};
use nvstore::config::{write_toml, NodeConfig};
use nvstore::map::ClusterMap;
use nvstore::placement::Acting;

const NODES: u32 = 8;

fn cluster() -> Harness {
    common::cluster(
        "nvstore-portable-",
        &LocalOptions {
            nodes: NODES,
            monitors: 1,
            device_bytes: 256 << 20,
            down_grace_ms: 1500,
            heartbeat_ms: 300,
            ..LocalOptions::default()
        },
    )
}

/// Members of every PG of every pool.
fn placement(map: &ClusterMap) -> Vec<Vec<Option<u32>>> {
    map.pools
        .values()
        .flat_map(|p| (0..p.pg_num).map(move |pg| Acting::compute(map, p, pg).members))
        .collect()
}

/// A member dir `name` whose node.toml is node 3's with `edit` applied, written without an
/// `id` line when `id` is 0.
fn member_config(lc: &LocalCluster, name: &str, edit: impl FnOnce(&mut NodeConfig)) -> PathBuf {
    let base = NodeConfig::load(&lc.dir.join("node.3/node.toml")).unwrap();
    let mut cfg = base.clone();
    let d = lc.dir.join(name);
    std::fs::create_dir_all(&d).unwrap();
    cfg.data_dir = d.clone();
    edit(&mut cfg);
    let path = d.join("node.toml");
    write_toml(&path, &cfg).unwrap();
    if cfg.id == 0 {
        let text = std::fs::read_to_string(&path).unwrap();
        let text: String = text
            .lines()
            .filter(|l| !l.starts_with("id ="))
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(&path, text).unwrap();
    }
    path
}

/// Run `nvstore node run` on a config that must be refused; its error output.
fn refused(config: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_nvstore"))
        .args(["node", "run", "--config"])
        .arg(config)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success(), "{} was accepted", config.display());
    String::from_utf8_lossy(&out.stderr).to_string()
}

#[test]
fn a_disk_moved_to_another_host_rejoins_as_its_node_and_nothing_moves() {
    let h = cluster();
    let c = &h.client;
    let pool = c.create_pool("p", 4, 2, 4096, 32, None).unwrap();
    let objects: Vec<(String, Vec<u8>)> = (0..24)
        .map(|i| (format!("o{i}"), bytes(i, 1000 + 7919 * i as usize)))
        .collect();
    for (n, d) in &objects {
        c.put(pool, n.as_bytes(), d).unwrap();
    }
    let before = placement(&c.map());
    assert_eq!(c.map().nodes[&3].host, "host3");

    // Stop node 3; start "the same disk in another machine": new host, data dir and port,
    // no id in the config.
    h.lc.stop_member("node.3", false).unwrap();
    member_config(&h.lc, "node.3moved", |cfg| {
        cfg.id = 0;
        cfg.host = "rack2-host9".into();
    });
    h.lc.start_member("node.3moved").unwrap();
    let t = Instant::now();
    loop {
        let _ = c.refresh_map();
        let m = c.map();
        if m.nodes[&3].host == "rack2-host9" && m.nodes[&3].up {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "node 3 did not rejoin on its new host: {:?}",
            m.nodes[&3]
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let map = c.map();
    assert_eq!(map.nodes.len(), NODES as usize, "same node, not a new one");
    let after = placement(&map);
    let changed = before.iter().zip(&after).filter(|(a, b)| a != b).count();
    println!(
        "disk moved host3 -> rack2-host9: {changed} of {} PGs changed members; bytes to move: 0",
        before.len()
    );
    assert_eq!(changed, 0);
    for (n, d) in &objects {
        assert!(c.get(pool, n.as_bytes()).unwrap() == *d, "{n}");
    }

    // The device labelled for node 3 is refused by a config that says node 4: while node 3
    // runs on it, because it is in use; once node 3 stopped, because of the label.
    let cfg = member_config(&h.lc, "node.wrongid", |cfg| {
        cfg.id = 4;
        cfg.host = "h-elsewhere".into();
    });
    let e = refused(&cfg);
    assert!(
        e.contains("dev0.img: in use: another opener holds it"),
        "{e}"
    );
    h.lc.stop_member("node.3moved", false).unwrap();
    let e = refused(&cfg);
    assert!(e.contains("id 4") && e.contains("node 3"), "{e}");

    // A device labelled for another cluster is refused, naming both clusters.
    let foreign = h.lc.dir.join("foreign.img");
    let other = "0badc0de-0000-4000-8000-000000000001";
    let st = Command::new(env!("CARGO_BIN_EXE_nvstore"))
        .args(["mkfs", "--device"])
        .arg(&foreign)
        .args(["--cluster", other, "--node", "9", "--size", "128M"])
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    let cfg = member_config(&h.lc, "node.foreign", |cfg| {
        cfg.id = 0;
        cfg.host = "h-foreign".into();
        cfg.devices = vec![foreign.display().to_string()];
    });
    let e = refused(&cfg);
    assert!(
        e.contains(other) && e.contains(&map.fsid),
        "names both clusters: {e}"
    );
}
