//! Host set-up errors seen by an unprivileged user: `as-user uid=N expect=permission|memlock`
//! drops to `uid`, optionally lowers RLIMIT_MEMLOCK, opens the controller, and checks that the
//! error names the problem and its fix.

use nvstore_driver::{Controller, Error, NvmeOptions};

use crate::{marker, Args};

pub fn as_user(args: &Args) -> bool {
    let uid: u32 = args.get("uid").parse().expect("uid");
    let expect = args.get("expect");
    let name = format!("unprivileged open reports {expect} with its fix");
    if expect == "memlock" {
        let lim = libc::rlimit {
            rlim_cur: 1 << 20,
            rlim_max: 1 << 20,
        };
        // SAFETY: setrlimit reads one rlimit from a live local.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) }, 0);
    }
    // SAFETY: plain syscalls changing this process's credentials; no memory is involved.
    let dropped = unsafe { libc::setgid(uid) == 0 && libc::setuid(uid) == 0 };
    assert!(dropped, "cannot drop to uid {uid}");
    let r = Controller::open(&args.get("bdf"), NvmeOptions::default());
    let verdict = match (&r, expect.as_str()) {
        (Err(e @ Error::Setup { problem, fix, .. }), "permission")
            if problem.contains("not permitted to open /dev/vfio/") && fix.contains("root") =>
        {
            Ok(e.to_string())
        }
        (Err(e @ Error::Setup { problem, fix, .. }), "memlock")
            if problem.contains("RLIMIT_MEMLOCK is 1024 KiB")
                && problem.contains("needs 65536 KiB")
                && fix.contains("ulimit -l") =>
        {
            Ok(e.to_string())
        }
        (Err(e), _) => Err(format!("wrong error: {e}")),
        (Ok(_), _) => Err("opened the controller".to_string()),
    };
    match verdict {
        Ok(msg) => {
            println!("{msg}");
            marker(&format!("PASS {name}"));
            true
        }
        Err(why) => {
            marker(&format!("FAIL {name}: {why}"));
            false
        }
    }
}
