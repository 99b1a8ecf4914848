//! A node's identity travels with its disks: every device label names the cluster, the device
//! and the node. `node.toml` may omit `id` (it is taken from the labels, which must agree); a
//! configured `id` that disagrees with a label is refused, naming both. The host, address and
//! data dir come from the config, so a disk moved to another host rejoins as the same node on
//! its new host (one process serves one node identity).

use std::path::Path;

use driver::{FileDevice, FileOptions};

use crate::config::NodeConfig;
use crate::error::{Error, Result};

/// The node id to run as: the labels' (all devices must agree) or the config's.
pub fn node_identity(cfg: &NodeConfig) -> Result<u32> {
    let mut labelled: Vec<(&str, u32)> = Vec::new();
    for spec in &cfg.devices {
        if crate::storecli::is_pci_address(spec) || !Path::new(spec).exists() {
            continue;
        }
        let dev = FileDevice::open(Path::new(spec), FileOptions::default())?;
        // An unlabelled device is reported when the store opens it.
        if let Ok(sb) = store::read_label(&dev) {
            labelled.push((spec, sb.node_id.get()));
        }
    }
    decide(cfg.id, &labelled)
}

/// `configured` 0 means "not configured".
fn decide(configured: u32, labelled: &[(&str, u32)]) -> Result<u32> {
    if let Some(&(a, ida)) = labelled.first() {
        if let Some(&(b, idb)) = labelled.iter().find(|d| d.1 != ida) {
            return Err(Error::Config(format!(
                "{a} is labelled for node {ida} but {b} for node {idb}: all of a node's \
                 devices must carry its id"
            )));
        }
    }
    match (configured, labelled.first()) {
        (0, None) => Err(Error::Config(
            "node.toml has no id and no device carries a label to take it from (set id, or \
             label the devices with `nvstore mkfs --node`)"
                .into(),
        )),
        (0, Some(&(_, id))) => Ok(id),
        (c, Some(&(d, id))) if c != id => Err(Error::Config(format!(
            "node.toml says id {c}, but device {d} is labelled for node {id}; a device moved \
             from another node keeps that node's identity: drop id from node.toml or set it \
             to {id}"
        ))),
        (c, _) => Ok(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_comes_from_agreeing_labels_or_a_matching_config() {
        assert_eq!(decide(0, &[("a", 3), ("b", 3)]).unwrap(), 3);
        assert_eq!(decide(3, &[("a", 3)]).unwrap(), 3);
        assert_eq!(
            decide(5, &[]).unwrap(),
            5,
            "new devices take the config's id"
        );
        let e = decide(4, &[("a", 3)]).unwrap_err().to_string();
        assert!(e.contains("id 4") && e.contains("node 3"), "{e}");
        let e = decide(0, &[("a", 3), ("b", 7)]).unwrap_err().to_string();
        assert!(e.contains("node 3") && e.contains("node 7"), "{e}");
        assert!(decide(0, &[]).is_err());
    }
}
