//! No CPU dies with SIGILL: under QEMU's user-mode emulation of older CPUs the codec picks a
//! backend the emulated CPU can run and still produces the pinned parity.
//!
//! reed-solomon-erasure's C kernel, called directly on an emulated Nehalem (no AVX), is killed
//! by SIGILL; the codec must pick the portable backend there, and the C kernel on an emulated
//! Haswell. The outer test re-runs the inner one under `qemu-x86_64 -cpu <model>` (installed by
//! scripts/deps as qemu-user); QEMU 7.2's TCG emulates up to AVX2, not AVX-512.

mod common;

use common::{encode_all, profile, random_shards, rebuild, rng, subsets};
use nvstore_ec::Codec;

/// Runs natively as a plain round trip, and under emulation as the payload of the test below.
#[test]
fn codec_round_trip_on_this_cpu() {
    let codec = Codec::new(profile(6, 2));
    println!("backend={}", codec.backend());
    let data = random_shards(&mut rng(77), 6, 3000);
    let stripe = encode_all(&codec, &data);
    let portable = Codec::with_backend(profile(6, 2), nvstore_ec::Backend::Portable).unwrap();
    assert!(
        encode_all(&portable, &data) == stripe,
        "backend parity differs from portable"
    );
    for lost in subsets(8, 2) {
        let got = rebuild(&codec, &stripe, &lost);
        assert!(
            got[0] == stripe[lost[0]] && got[1] == stripe[lost[1]],
            "{lost:?}"
        );
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn emulated_old_cpus_fall_back_without_sigill() {
    let Some(qemu) = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join("qemu-x86_64"))
            .find(|p| p.is_file())
    }) else {
        eprintln!("skipped: qemu-x86_64 is not installed (scripts/deps installs qemu-user)");
        return;
    };
    let exe = std::env::current_exe().unwrap();
    for (cpu, want) in [
        ("Nehalem", "portable"),
        ("Haswell", "reed-solomon-erasure-simd"),
    ] {
        let out = std::process::Command::new(&qemu)
            .args(["-cpu", cpu])
            .arg(&exe)
            .args(["--exact", "codec_round_trip_on_this_cpu", "--nocapture"])
            .output()
            .expect("run qemu-x86_64");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "under -cpu {cpu}: {:?}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains(&format!("backend={want}")),
            "-cpu {cpu}: {stdout}"
        );
        assert!(stdout.contains("1 passed"), "-cpu {cpu}: {stdout}");
    }
}
