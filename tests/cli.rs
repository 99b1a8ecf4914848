//! The command line end to end: `nvstore demo`, and a cluster driven only through the CLI
//! (`cluster up`, `pool create`, `put/get/stat/ls/rm`, `status`, `bench`, `cluster down`).

use std::path::Path;
use std::process::{Command, Output};
use std::sync::Mutex;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn nvstore(args: &[&str], conf: Option<&Path>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_nvstore"));
    c.args(args);
    match conf {
        Some(p) => c.env("NVSTORE_CONF", p),
        None => c.env_remove("NVSTORE_CONF"),
    };
    c.output().expect("run nvstore")
}

fn ok(o: &Output, what: &str) -> String {
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "{what}: {}\nstdout:\n{out}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

#[test]
fn demo_runs_and_every_read_matches() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let o = nvstore(&["demo"], None);
    let out = ok(&o, "nvstore demo");
    assert!(
        out.contains("OK: every read returned the bytes written"),
        "{out}"
    );
    assert!(
        out.contains("rebuilt from parity"),
        "the demo shows degraded decodes:\n{out}"
    );
    assert!(out.contains("HEALTH_OK"), "{out}");
    assert!(!out.contains("BAD"), "{out}");
}

#[test]
fn a_cluster_through_the_cli() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::Builder::new()
        .prefix("nvstore-cli-")
        .tempdir()
        .unwrap();
    let d = dir.path().to_str().unwrap();
    let up = nvstore(
        &[
            "cluster",
            "up",
            "--nodes",
            "8",
            "--dir",
            d,
            "--device-size",
            "1G",
        ],
        None,
    );
    let out = ok(&up, "cluster up");
    assert!(out.contains("created pool \"data\" (EC 6+2)"), "{out}");
    let conf = dir.path().join("client.toml");
    let c = Some(conf.as_path());
    let run = || {
        ok(
            &nvstore(
                &[
                    "pool", "create", "p2", "--k", "4", "--m", "2", "--pg-num", "16",
                ],
                c,
            ),
            "pool create",
        );
        let file = dir.path().join("in.bin");
        let data: Vec<u8> = (0..300_001u32).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::write(&file, &data).unwrap();
        ok(
            &nvstore(&["put", "p2", "obj", file.to_str().unwrap()], c),
            "put",
        );
        let back = dir.path().join("out.bin");
        ok(
            &nvstore(&["get", "p2", "obj", back.to_str().unwrap()], c),
            "get",
        );
        assert!(std::fs::read(&back).unwrap() == data);
        let st = ok(&nvstore(&["stat", "p2", "obj"], c), "stat");
        assert!(st.contains("size 300001"), "{st}");
        let ls = ok(&nvstore(&["ls", "p2"], c), "ls");
        assert!(ls.starts_with("obj\t300001\t"), "{ls}");
        // The new pool's PGs each get a first recovery pass (planning, nothing to move);
        // until those finish, health says "recovering … pg(s) pending". On a busy host that
        // takes a moment: wait for it rather than catch it mid-way.
        let t = std::time::Instant::now();
        let status = loop {
            let s = ok(&nvstore(&["status"], c), "status");
            if s.contains("HEALTH_OK") || t.elapsed() > std::time::Duration::from_secs(30) {
                break s;
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        };
        assert!(
            status.contains("HEALTH_OK") && status.contains("8 up, 8 in"),
            "{status}"
        );
        let js = ok(&nvstore(&["status", "--json"], c), "status --json");
        let v: serde_json::Value = serde_json::from_str(&js).unwrap();
        assert_eq!(v["nodes_up"], 8);
        for mode in ["write", "seq", "rand"] {
            let b = ok(
                &nvstore(
                    &[
                        "bench",
                        mode,
                        "--pool",
                        "data",
                        "--size",
                        "4K",
                        "--seconds",
                        "1",
                        "--concurrency",
                        "4",
                        "--json",
                    ],
                    c,
                ),
                mode,
            );
            let r: serde_json::Value = serde_json::from_str(&b).unwrap();
            assert!(r["ops"].as_u64().unwrap() > 0, "{mode}: {b}");
            assert_eq!(r["errors"], 0, "{mode}: {b}");
            assert!(r["lat_p99_ms"].as_f64().unwrap() >= r["lat_p50_ms"].as_f64().unwrap());
        }
        ok(&nvstore(&["rm", "p2", "obj"], c), "rm");
        let gone = nvstore(&["stat", "p2", "obj"], c);
        assert!(!gone.status.success());
        assert!(String::from_utf8_lossy(&gone.stderr).contains("not found"));
        let nopool = nvstore(&["put", "nosuch", "x", file.to_str().unwrap()], c);
        assert!(String::from_utf8_lossy(&nopool.stderr).contains("no such pool"));
        // Deleting a pool asks for the flag that says its objects may go for good.
        let refused = nvstore(&["pool", "delete", "p2"], c);
        assert!(!refused.status.success());
        let err = String::from_utf8_lossy(&refused.stderr);
        assert!(err.contains("--yes-i-really-mean-it"), "{err}");
        assert!(ok(&nvstore(&["pool", "ls"], c), "pool ls").contains("\tp2\t"));
        let del = nvstore(&["pool", "delete", "p2", "--yes-i-really-mean-it"], c);
        assert!(ok(&del, "pool delete").contains("pool \"p2\" deleted"));
        assert!(!ok(&nvstore(&["pool", "ls"], c), "pool ls").contains("\tp2\t"));
        let ls = nvstore(&["ls", "p2"], c);
        assert!(String::from_utf8_lossy(&ls.stderr).contains("no such pool"));
        let again = nvstore(&["pool", "delete", "p2", "--yes-i-really-mean-it"], c);
        assert!(String::from_utf8_lossy(&again.stderr).contains("no pool \"p2\""));
    };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run));
    let down = nvstore(&["cluster", "down", "--dir", d], None);
    r.unwrap();
    assert!(ok(&down, "cluster down").contains("stopped 9 process(es)"));
}

/// `nvstore demo | head -3`: the demo's output pipe closes while its cluster runs, its next
/// print fails (a panic: Rust ignores SIGPIPE), and on the way out it takes the cluster down.
/// No monitor or node process is left running from its directory.
#[test]
fn a_demo_whose_output_closes_leaves_no_processes() {
    use std::io::BufRead;
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::Builder::new()
        .prefix("nvstore-unwind-")
        .tempdir()
        .unwrap();
    let d = dir.path().join("cluster");
    let mut child = Command::new(env!("CARGO_BIN_EXE_nvstore"))
        .args(["demo", "--dir", d.to_str().unwrap()])
        .env_remove("NVSTORE_CONF")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("run nvstore demo");
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    // Read until the cluster is up (step 2 starts), then close the pipe.
    while !line.contains("== 2.") {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the demo ended before its cluster was up"
        );
    }
    drop(out);
    let status = child.wait().unwrap();
    assert!(
        !status.success(),
        "the demo cannot succeed without its output"
    );
    let needle = d.to_str().unwrap().as_bytes().to_vec();
    let left: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.parse::<u32>().is_ok())
        })
        .filter_map(|e| {
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            let zombie = stat.rsplit(')').next()?.trim_start().starts_with('Z');
            let ours = cmd.windows(needle.len()).any(|w| w == needle.as_slice());
            (ours && !zombie).then(|| String::from_utf8_lossy(&cmd).replace('\0', " "))
        })
        .collect();
    assert!(left.is_empty(), "processes left running: {left:?}");
}

/// `cluster down` on a directory that holds no cluster says so and fails, rather than report
/// "stopped 0 processes" as if a cluster had been there and stopped.
#[test]
fn cluster_down_names_a_directory_without_a_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let o = nvstore(&["cluster", "down", "--dir", d], None);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "an empty directory is not a cluster");
    assert!(
        err.contains(d) && err.contains("holds no cluster made by `nvstore cluster up`"),
        "{err}"
    );
    let gone = dir.path().join("nothing-here");
    let o = nvstore(&["cluster", "down", "--dir", gone.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("nothing-here"), "{err}");
}

/// Cutting a member's network needs a cluster made with `--netns`; on a loopback cluster the
/// command says so (and changes nothing).
#[test]
fn cluster_cut_on_a_loopback_cluster_says_it_needs_netns() {
    let dir = tempfile::tempdir().unwrap();
    let lc = nvstore::cluster_cmd::LocalCluster::new(
        dir.path(),
        std::path::Path::new(env!("CARGO_BIN_EXE_nvstore")),
    );
    lc.create(&nvstore::cluster_cmd::LocalOptions {
        nodes: 2,
        ..Default::default()
    })
    .unwrap();
    let d = dir.path().to_str().unwrap();
    for verb in ["cut", "heal"] {
        let o = nvstore(&["cluster", verb, "--dir", d, "node.1"], None);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{verb} on loopback");
        assert!(
            err.contains("runs on loopback") && err.contains("--netns"),
            "{err}"
        );
    }
    let o = nvstore(&["cluster", "up", "--dir", d, "--netns"], None);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "--netns on an existing loopback cluster"
    );
    assert!(err.contains("--netns applies to a new cluster"), "{err}");
}

/// A device another opener holds (here this test, standing in for a running node) is refused
/// by `store-tool` and by `mkfs` with a message saying it is in use, and nothing in it
/// changes: `mkfs --size` over it neither truncates nor relabels it. Once let go, the same
/// commands work.
#[test]
fn a_device_in_use_is_refused_by_store_tool_and_mkfs_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let dev_path = dir.path().join("dev.img");
    let d = dev_path.to_str().unwrap();
    let fsid = "6b1c2a9e-0d3f-4e21-9a57-3c8e1f2d4b60";
    let other = "0f0e0d0c-0b0a-4908-8706-050403020100";
    ok(
        &nvstore(
            &[
                "mkfs",
                "--device",
                d,
                "--cluster",
                fsid,
                "--node",
                "3",
                "--size",
                "128M",
            ],
            None,
        ),
        "mkfs",
    );
    let src = dir.path().join("k1.bin");
    std::fs::write(&src, b"kept through a refused mkfs").unwrap();
    let src = src.to_str().unwrap();
    ok(
        &nvstore(&["store-tool", "--device", d, "put", "1", "k1", src], None),
        "put",
    );
    let held = driver::FileDevice::open(&dev_path, driver::FileOptions::default()).unwrap();
    for (args, what) in [
        (
            vec!["store-tool", "--device", d, "ls", "--pool", "1"],
            "store-tool ls",
        ),
        (
            vec![
                "mkfs",
                "--device",
                d,
                "--cluster",
                other,
                "--node",
                "4",
                "--size",
                "256M",
            ],
            "mkfs over it",
        ),
    ] {
        let o = nvstore(&args, None);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{what} must be refused");
        assert!(
            err.contains(d) && err.contains("in use: another opener holds it"),
            "{what}: {err}"
        );
    }
    assert_eq!(
        std::fs::metadata(&dev_path).unwrap().len(),
        128 << 20,
        "not truncated"
    );
    drop(held);
    let out = ok(
        &nvstore(&["store-tool", "--device", d, "info"], None),
        "info",
    );
    assert!(
        out.contains(fsid) && out.contains("node            3"),
        "{out}"
    );
    let out = ok(
        &nvstore(&["store-tool", "--device", d, "get", "1", "k1"], None),
        "get",
    );
    assert_eq!(out, "kept through a refused mkfs");
}

/// `mkfs --allocate` writes every block of a new device file once (no holes are left, the
/// file occupies its whole size) and labels it; a store on it works; an NVMe address is
/// refused with a message saying the option applies to files.
#[test]
fn mkfs_allocate_leaves_a_file_without_holes() {
    let dir = tempfile::tempdir().unwrap();
    let dev_path = dir.path().join("dev.img");
    let d = dev_path.to_str().unwrap();
    let fsid = "6b1c2a9e-0d3f-4e21-9a57-3c8e1f2d4b60";
    let mkfs = |device: &str| {
        nvstore(
            &[
                "mkfs",
                "--device",
                device,
                "--cluster",
                fsid,
                "--node",
                "2",
                "--size",
                "96M",
                "--allocate",
            ],
            None,
        )
    };
    let out = ok(&mkfs(d), "mkfs --allocate");
    assert!(out.contains("allocated 96 MiB"), "{out}");
    let meta = std::fs::metadata(&dev_path).unwrap();
    assert_eq!(meta.len(), 96 << 20);
    assert!(
        std::os::unix::fs::MetadataExt::blocks(&meta) * 512 >= 96 << 20,
        "every block allocated: {} of {} bytes",
        std::os::unix::fs::MetadataExt::blocks(&meta) * 512,
        96 << 20
    );
    let f = std::fs::File::open(&dev_path).unwrap();
    // SAFETY: lseek on an open fd; no memory is passed.
    let hole = unsafe { libc::lseek(std::os::fd::AsRawFd::as_raw_fd(&f), 0, libc::SEEK_HOLE) };
    assert_eq!(hole, 96 << 20, "the first hole is the end of the file");
    let src = dir.path().join("o.bin");
    std::fs::write(&src, b"on an allocated file").unwrap();
    let src = src.to_str().unwrap();
    ok(
        &nvstore(&["store-tool", "--device", d, "put", "1", "o", src], None),
        "put",
    );
    let out = ok(
        &nvstore(&["store-tool", "--device", d, "get", "1", "o"], None),
        "get",
    );
    assert_eq!(out, "on an allocated file");
    let o = mkfs("0000:00:04.0");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("--allocate apply to files only"),
        "{err}"
    );
}
