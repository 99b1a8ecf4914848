//! The hardware suite's guest program: runs inside the throwaway QEMU guest that
//! `hw-tests/run` boots (q35, emulated Intel IOMMU, emulated NVMe controllers bound to vfio-pci
//! by the real `nvstore device bind`). Built as a static binary; not useful on a host with real
//! data on its NVMe devices (it overwrites them).
//!
//! Modes (first argument), options as `key=value`:
//! * `suite a=BDF b=BDF serial_a=S serial_b=S` — every case, one PASS/FAIL line each.
//! * `bench bdf=BDF nvstore=PATH` — our driver vs the kernel nvme driver (FileDevice, io_uring,
//!   O_DIRECT) on the same controller, rebinding between phases.
//! * `crash-write bdf=BDF` — write records and flush until killed, printing the durable count.
//! * `crash-verify bdf=BDF flushed=N` — every record below N reads back intact.
//! * `as-user uid=N bdf=BDF expect=permission|memlock` — the set-up error an unprivileged
//!   user gets names the problem and the fix.
//!
//! Every result line starts on a fresh line with `HWTEST ` so the host can parse the console.

mod bench;
mod cases;
mod crash;
mod setup_errors;

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::time::Instant;

/// Print a marker line the host parses (a newline first: console output may be glued).
pub fn marker(s: &str) {
    println!("\nHWTEST {s}");
}

/// `key=value` arguments after the mode.
pub struct Args(HashMap<String, String>);

impl Args {
    pub fn get(&self, key: &str) -> String {
        self.0
            .get(key)
            .cloned()
            .unwrap_or_else(|| panic!("missing argument {key}=…"))
    }
}

/// Run one named case, catching panics (the conformance suite reports by panicking).
pub fn case(results: &mut Vec<(String, bool)>, name: &str, f: impl FnOnce() -> Result<(), String>) {
    let t = Instant::now();
    let r = std::panic::catch_unwind(AssertUnwindSafe(f));
    let secs = t.elapsed().as_secs_f64();
    let outcome = match r {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e),
        Err(p) => Err(p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panic".into())),
    };
    let ok = outcome.is_ok();
    match outcome {
        Ok(()) => marker(&format!("PASS {name} ({secs:.1} s)")),
        Err(e) => marker(&format!(
            "FAIL {name} ({secs:.1} s): {}",
            e.replace('\n', " | ")
        )),
    }
    results.push((name.to_string(), ok));
}

fn main() {
    let mut argv = std::env::args().skip(1);
    let mode = argv.next().unwrap_or_default();
    let args = Args(
        argv.filter_map(|a| {
            a.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect(),
    );
    // Panics are reported by `case`; keep the default hook's message short on the console.
    std::panic::set_hook(Box::new(|info| {
        eprintln!("panic: {info}");
    }));
    let ok = match mode.as_str() {
        "suite" => cases::suite(&args),
        "bench" => bench::run(&args),
        "crash-write" => crash::write(&args),
        "crash-verify" => crash::verify(&args),
        "as-user" => setup_errors::as_user(&args),
        _ => {
            eprintln!("usage: nvme_hw suite|bench|crash-write|crash-verify|as-user key=value…");
            false
        }
    };
    std::process::exit(if ok { 0 } else { 1 });
}
