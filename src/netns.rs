//! Network namespaces for a local cluster: each monitor and node in a namespace of its own,
//! cabled (a veth pair) to one bridge that lives in a namespace of its own too, and this host
//! cabled to the same bridge so clients here reach every member. Cutting a member's cable at
//! the bridge is a network partition that leaves the process running with its connections
//! open and its state in memory, which killing it cannot show (`tests/partition.rs`).
//!
//! Layout for fabric tag T (4 hex digits, random per cluster), subnet `10.(200 + T / 256).(T %
//! 256).0/24`:
//! * namespace `nvsT-sw` holds bridge `br0`; a member's cable ends there as `v<member>` (dots
//!   dropped: `vnode3`), this host's as `vhost`;
//! * namespace `nvsT-<member>` (`nvsT-node.3`) holds the member's end, `eth0`, at `.N` for
//!   `mon.N` and `.(10 + N)` for `node.N`, and `lo` up;
//! * this host's end is the interface `nvsT` at `.254`.
//!
//! Needs root and `ip` (iproute2). The tag is kept in `DIR/netns`; [`Fabric::destroy`] deletes
//! the namespaces, which takes their cables and this host's end with them, and
//! [`Fabric::ensure`] builds them again at the same addresses.

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::{Command, Stdio};

use crate::error::{Error, Result};

/// The file in a cluster's directory that records its fabric's tag.
pub const FILE: &str = "netns";
/// Tags span 50 × 256 subnets: 10.200.0.0/24 … 10.249.255.0/24.
const TAGS: u16 = 50 * 256;
/// This host's address on the fabric (last octet).
const HOST_OCTET: u8 = 254;
/// Addresses of `node.N`: `.(NODE_OCTET_BASE + N)`.
const NODE_OCTET_BASE: u32 = 10;

/// One cluster's namespaces and bridge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fabric {
    tag: u16,
}

/// Run `ip ARGS`; a failure names the command and what `ip` said.
fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| Error::io("run `ip` (iproute2; network namespaces need it)", e))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// The namespaces `ip netns list` shows.
fn namespaces() -> Result<Vec<String>> {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .map_err(|e| Error::io("run `ip netns list`", e))?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect())
}

impl Fabric {
    /// Build the fabric for `members` ("mon.N", "node.N") and record its tag in `dir`. A
    /// failure part way removes what was built.
    pub fn create(dir: &Path, members: &[String]) -> Result<Fabric> {
        let taken = namespaces()?;
        let f = loop {
            let f = Fabric {
                tag: rand::random::<u16>() % TAGS,
            };
            if !taken.iter().any(|n| n.starts_with(&f.prefix())) {
                break f;
            }
        };
        let built = f.build(members).and_then(|()| {
            std::fs::write(dir.join(FILE), format!("{:04x}\n", f.tag))
                .map_err(|e| Error::io(format!("write {}", dir.join(FILE).display()), e))
        });
        match built {
            Ok(()) => Ok(f),
            Err(e) => {
                f.destroy();
                Err(e)
            }
        }
    }

    /// Build the fabric again if its namespaces are gone (`LocalCluster::down` removes them),
    /// with the same tag: the members' configs name their addresses.
    pub fn ensure(&self, members: &[String]) -> Result<()> {
        if namespaces()?.contains(&self.switch()) {
            return Ok(());
        }
        self.build(members).inspect_err(|_| self.destroy())
    }

    /// The fabric recorded in `dir`, if any.
    pub fn load(dir: &Path) -> Result<Option<Fabric>> {
        let path = dir.join(FILE);
        match std::fs::read_to_string(&path) {
            Ok(s) => u16::from_str_radix(s.trim(), 16)
                .map(|tag| Some(Fabric { tag }))
                .map_err(|e| Error::Config(format!("{}: bad tag: {e}", path.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io(format!("read {}", path.display()), e)),
        }
    }

    fn prefix(&self) -> String {
        format!("nvs{:04x}", self.tag)
    }

    fn switch(&self) -> String {
        format!("{}-sw", self.prefix())
    }

    /// The namespace `member` runs in.
    pub fn namespace(&self, member: &str) -> String {
        format!("{}-{member}", self.prefix())
    }

    fn cable(member: &str) -> String {
        format!("v{}", member.replace('.', ""))
    }

    fn octet(member: &str) -> Result<u8> {
        let bad = || Error::Config(format!("{member}: not mon.N or node.N"));
        let (kind, n) = member.split_once('.').ok_or_else(bad)?;
        let n: u32 = n.parse().map_err(|_| bad())?;
        let octet = match kind {
            "mon" if (1..NODE_OCTET_BASE).contains(&n) => n,
            "node" if n >= 1 && NODE_OCTET_BASE + n < u32::from(HOST_OCTET) => NODE_OCTET_BASE + n,
            _ => return Err(bad()),
        };
        Ok(octet as u8)
    }

    fn addr_with(&self, octet: u8) -> Ipv4Addr {
        Ipv4Addr::new(
            10,
            200 + (self.tag / 256) as u8,
            (self.tag % 256) as u8,
            octet,
        )
    }

    /// `member`'s address on the fabric.
    pub fn addr(&self, member: &str) -> Result<Ipv4Addr> {
        Ok(self.addr_with(Self::octet(member)?))
    }

    fn build(&self, members: &[String]) -> Result<()> {
        let sw = self.switch();
        ip(&["netns", "add", &sw])?;
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &sw, "link", "set", "br0", "up"])?;
        let host = self.prefix();
        let host_cidr = format!("{}/24", self.addr_with(HOST_OCTET));
        ip(&[
            "link", "add", &host, "type", "veth", "peer", "name", "vhost", "netns", &sw,
        ])?;
        ip(&["addr", "add", &host_cidr, "dev", &host])?;
        ip(&["link", "set", &host, "up"])?;
        ip(&["-n", &sw, "link", "set", "vhost", "master", "br0", "up"])?;
        for m in members {
            let ns = self.namespace(m);
            let cable = Self::cable(m);
            let cidr = format!("{}/24", self.addr(m)?);
            ip(&["netns", "add", &ns])?;
            ip(&[
                "link", "add", &cable, "netns", &sw, "type", "veth", "peer", "name", "eth0",
                "netns", &ns,
            ])?;
            ip(&["-n", &sw, "link", "set", &cable, "master", "br0", "up"])?;
            ip(&["-n", &ns, "addr", "add", &cidr, "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(())
    }

    /// Cut (`connected = false`) or restore `member`'s cable at the bridge. Cut, its packets go
    /// nowhere and nothing reaches it: connections hang (no reset), new ones time out.
    pub fn set_connected(&self, member: &str, connected: bool) -> Result<()> {
        Self::octet(member)?;
        let state = if connected { "up" } else { "down" };
        ip(&[
            "-n",
            &self.switch(),
            "link",
            "set",
            &Self::cable(member),
            state,
        ])
    }

    /// Cut (or restore) the path between two members only, both keeping their cables to the
    /// rest: each drops whatever it would send to the other (a blackhole route in its
    /// namespace), so neither reaches the other — an asymmetric partition.
    pub fn set_link(&self, a: &str, b: &str, connected: bool) -> Result<()> {
        let (addr_a, addr_b) = (self.addr(a)?, self.addr(b)?);
        for (member, peer) in [(a, addr_b), (b, addr_a)] {
            let verb = if connected { "del" } else { "replace" };
            ip(&[
                "-n",
                &self.namespace(member),
                "route",
                verb,
                "blackhole",
                &format!("{peer}/32"),
            ])?;
        }
        Ok(())
    }

    /// The command that runs `exe` inside `member`'s namespace.
    pub fn command(&self, member: &str, exe: &Path) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.namespace(member)])
            .arg(exe);
        cmd
    }

    /// Delete every namespace of this fabric (best effort: what is gone already is fine).
    pub fn destroy(&self) {
        let prefix = format!("{}-", self.prefix());
        for ns in namespaces().unwrap_or_default() {
            if ns.starts_with(&prefix) {
                let _ = ip(&["netns", "del", &ns]);
            }
        }
        // Deleting the switch's namespace took this host's end of its cable; an early failure
        // may have left it without one.
        let _ = Command::new("ip")
            .args(["link", "del", &self.prefix()])
            .stderr(Stdio::null())
            .status();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_names_follow_the_layout() {
        let f = Fabric { tag: 0x0312 };
        assert_eq!(f.addr("mon.1").unwrap(), Ipv4Addr::new(10, 203, 18, 1));
        assert_eq!(f.addr("node.3").unwrap(), Ipv4Addr::new(10, 203, 18, 13));
        assert_eq!(f.addr_with(HOST_OCTET), Ipv4Addr::new(10, 203, 18, 254));
        assert_eq!(f.namespace("node.12"), "nvs0312-node.12");
        assert_eq!(Fabric::cable("node.12"), "vnode12");
        for bad in ["node.0", "mon.10", "node.244", "client", "node.x"] {
            assert!(f.addr(bad).is_err(), "{bad}");
        }
        let last = Fabric { tag: TAGS - 1 };
        assert_eq!(last.addr("mon.1").unwrap(), Ipv4Addr::new(10, 249, 255, 1));
    }
}
