//! PCI functions as sysfs shows them: the facts the driver checks before opening a device and
//! that `nvstore device list|bind|unbind` prints and changes.

use std::fs;
use std::path::{Path, PathBuf};

/// PCI class code of an NVMe controller: mass storage (01h), non-volatile memory (08h),
/// NVM Express programming interface (02h).
pub const NVME_CLASS: u32 = 0x01_08_02;

/// Where sysfs lists PCI devices.
pub const PCI_DEVICES: &str = "/sys/bus/pci/devices";

/// One PCI function.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciFunction {
    /// Domain:bus:device.function, e.g. `0000:00:03.0`.
    pub bdf: String,
    pub vendor: u16,
    pub device: u16,
    pub class: u32,
    /// The kernel driver bound now (`nvme`, `vfio-pci`), if any.
    pub driver: Option<String>,
    /// IOMMU group number; `None` when the kernel runs without an IOMMU.
    pub iommu_group: Option<u32>,
    /// NUMA node (-1 when the platform does not say).
    pub numa_node: i32,
}

impl PciFunction {
    /// Read one function by address. Accepts the short form `00:03.0` too.
    pub fn read(bdf: &str) -> std::io::Result<Self> {
        let bdf = full_bdf(bdf);
        let dir = pci_path(&bdf);
        if !dir.exists() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("no PCI function {bdf} ({} does not exist)", dir.display()),
            ));
        }
        Ok(PciFunction {
            vendor: read_hex(&dir.join("vendor"))? as u16,
            device: read_hex(&dir.join("device"))? as u16,
            class: read_hex(&dir.join("class"))? as u32,
            driver: link_name(&dir.join("driver")),
            iommu_group: link_name(&dir.join("iommu_group")).and_then(|g| g.parse().ok()),
            numa_node: fs::read_to_string(dir.join("numa_node"))
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(-1),
            bdf,
        })
    }

    pub fn path(&self) -> PathBuf {
        pci_path(&self.bdf)
    }

    pub fn is_nvme(&self) -> bool {
        self.class == NVME_CLASS
    }

    /// The other PCI functions in this function's IOMMU group.
    pub fn group_peers(&self) -> Vec<String> {
        let Some(g) = self.iommu_group else {
            return Vec::new();
        };
        let dir = PathBuf::from(format!("/sys/kernel/iommu_groups/{g}/devices"));
        let mut peers: Vec<String> = fs::read_dir(dir)
            .map(|it| {
                it.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|b| *b != self.bdf)
                    .collect()
            })
            .unwrap_or_default();
        peers.sort();
        peers
    }
}

/// Every PCI function whose class is NVMe, sorted by address.
pub fn nvme_functions() -> std::io::Result<Vec<PciFunction>> {
    let mut out = Vec::new();
    for e in fs::read_dir(PCI_DEVICES)? {
        let bdf = e?.file_name().to_string_lossy().into_owned();
        if let Ok(f) = PciFunction::read(&bdf) {
            if f.is_nvme() {
                out.push(f);
            }
        }
    }
    out.sort_by(|a, b| a.bdf.cmp(&b.bdf));
    Ok(out)
}

/// `00:03.0` → `0000:00:03.0`; a full address is returned as is.
pub fn full_bdf(bdf: &str) -> String {
    if bdf.matches(':').count() == 1 {
        format!("0000:{bdf}")
    } else {
        bdf.to_string()
    }
}

pub fn pci_path(bdf: &str) -> PathBuf {
    Path::new(PCI_DEVICES).join(bdf)
}

/// True when the kernel has an IOMMU enabled (any IOMMU group exists).
pub fn iommu_enabled() -> bool {
    fs::read_dir("/sys/kernel/iommu_groups")
        .map(|mut it| it.next().is_some())
        .unwrap_or(false)
}

/// True when the vfio-pci driver is loaded (built in or as a module).
pub fn vfio_pci_loaded() -> bool {
    Path::new("/sys/bus/pci/drivers/vfio-pci").exists()
}

fn read_hex(path: &Path) -> std::io::Result<u64> {
    let s = fs::read_to_string(path)?;
    u64::from_str_radix(s.trim().trim_start_matches("0x"), 16).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{}: {e}", path.display()),
        )
    })
}

fn link_name(path: &Path) -> Option<String> {
    fs::read_link(path)
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_addresses_get_a_domain() {
        assert_eq!(full_bdf("00:03.0"), "0000:00:03.0");
        assert_eq!(full_bdf("0000:5e:00.1"), "0000:5e:00.1");
    }

    #[test]
    fn missing_function_is_a_clear_error() {
        let e = PciFunction::read("ffff:ff:1f.7").unwrap_err();
        assert!(
            e.to_string().contains("no PCI function ffff:ff:1f.7"),
            "{e}"
        );
    }
}
