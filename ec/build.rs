//! Records the `-march` that reed-solomon-erasure's build script compiles its C kernel with, so
//! the runtime CPU check (`src/kernel/rse.rs`) knows what that kernel requires.
//!
//! reed-solomon-erasure's build.rs passes `-march=haswell` on x86_64 unless the environment
//! variable `RUST_REED_SOLOMON_ERASURE_ARCH` names another architecture. Its build script does
//! not declare that variable as a rerun trigger: after changing it, `cargo clean -p
//! reed-solomon-erasure` so that both build scripts see the same value.

fn main() {
    println!("cargo:rerun-if-env-changed=RUST_REED_SOLOMON_ERASURE_ARCH");
    let arch = std::env::var("RUST_REED_SOLOMON_ERASURE_ARCH").unwrap_or_default();
    println!("cargo:rustc-env=NVSTORE_EC_RSE_MARCH={arch}");
}
