//! VFIO plumbing: open a PCI function bound to vfio-pci (container, group, device), enable bus
//! mastering through config space, and map BAR0. This is the only module that touches MMIO;
//! [`Bar`] reaches registers through volatile accesses only.
//!
//! Before opening anything the host set-up is checked, so a missing IOMMU, an unloaded
//! vfio-pci, a device still bound to the kernel, a non-viable group or a permission problem
//! each becomes an [`Error::Setup`] that says how to fix it.

use std::fs::File;
use std::io::ErrorKind;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::ptr::NonNull;
use std::sync::Arc;

use vfio_ioctls::{VfioContainer, VfioDevice, VfioError};

use super::sysfs::{self, PciFunction};
use crate::error::{Error, Result};

/// VFIO region index of PCI config space (`VFIO_PCI_CONFIG_REGION_INDEX`).
const CONFIG_REGION: u32 = 7;
/// PCI Command register offset in config space, and its bits (PCI Local Bus 3.0 §6.2.2).
const PCI_COMMAND: u64 = 0x04;
const PCI_COMMAND_MEMORY: u16 = 1 << 1;
const PCI_COMMAND_MASTER: u16 = 1 << 2;
/// `VFIO_REGION_INFO_FLAG_MMAP`.
const REGION_FLAG_MMAP: u32 = 1 << 2;

/// A memory-mapped PCI BAR. Registers are read and written with volatile 32-bit accesses.
pub struct Bar {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is owned by this value and only reached through volatile accesses, which
// are valid from any thread (the device serialises register accesses itself).
unsafe impl Send for Bar {}
// SAFETY: as above: &Bar allows volatile reads and writes of device registers only.
unsafe impl Sync for Bar {}

impl Bar {
    fn check(&self, offset: usize) {
        assert!(
            offset.is_multiple_of(4) && offset + 4 <= self.len,
            "register offset {offset:#x} outside the {}-byte BAR or unaligned",
            self.len
        );
    }

    /// Read the 32-bit register at `offset`.
    pub fn read32(&self, offset: usize) -> u32 {
        self.check(offset);
        // SAFETY: offset is in bounds and 4-byte aligned (checked); the mapping lives as long as
        // self; MMIO is only ever accessed volatile.
        unsafe { std::ptr::read_volatile(self.ptr.as_ptr().add(offset) as *const u32) }
    }

    /// Write the 32-bit register at `offset`.
    pub fn write32(&self, offset: usize, value: u32) {
        self.check(offset);
        // SAFETY: as in read32.
        unsafe { std::ptr::write_volatile(self.ptr.as_ptr().add(offset) as *mut u32, value) }
    }

    /// Read a 64-bit register as two 32-bit reads, low half first (Base 1.4 §3.1 allows 32-bit
    /// accesses to 64-bit registers; not every platform supports 64-bit MMIO).
    pub fn read64(&self, offset: usize) -> u64 {
        self.read32(offset) as u64 | (self.read32(offset + 4) as u64) << 32
    }

    /// Write a 64-bit register as two 32-bit writes, low half first.
    pub fn write64(&self, offset: usize, value: u64) {
        self.write32(offset, value as u32);
        self.write32(offset + 4, (value >> 32) as u32);
    }

    /// A raw pointer to the 32-bit register at `offset`, for doorbells written on the hot path.
    /// The pointer is valid while this `Bar` lives; write it only with `write_volatile`.
    pub fn register_ptr(&self, offset: usize) -> *mut u32 {
        self.check(offset);
        // SAFETY: in bounds (checked).
        unsafe { self.ptr.as_ptr().add(offset) as *mut u32 }
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly what mmap returned; nothing uses the mapping after drop
        // (doorbell pointers are only used by queues, which hold the controller, which owns this).
        unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len) };
    }
}

/// An open VFIO PCI function: its container (the IOMMU domain DMA maps go into), the device, and
/// BAR0 mapped.
pub struct VfioPci {
    name: Arc<str>,
    function: PciFunction,
    // Field order is drop order: BAR unmapped, then the device fd closed, then the container.
    bar0: Bar,
    device: VfioDevice,
    container: Arc<VfioContainer>,
}

impl VfioPci {
    /// Open `bdf`, which must be bound to vfio-pci. Every host-side problem is reported with
    /// its fix.
    pub fn open(bdf: &str) -> Result<Self> {
        let bdf = sysfs::full_bdf(bdf);
        let name: Arc<str> = bdf.as_str().into();
        let function = check_host(&name)?;
        let container = Arc::new(
            VfioContainer::new(None).map_err(|e| vfio_error(&name, &function, "open", e))?,
        );
        let device = VfioDevice::new(&function.path(), container.clone(), false)
            .map_err(|e| vfio_error(&name, &function, "open device", e))?;
        let bar0 = map_bar0(&name, &device)?;
        let pci = VfioPci {
            name,
            function,
            bar0,
            device,
            container,
        };
        pci.enable_bus_master()?;
        Ok(pci)
    }

    pub fn name(&self) -> &Arc<str> {
        &self.name
    }

    /// The PCI function as sysfs described it at open.
    pub fn function(&self) -> &PciFunction {
        &self.function
    }

    pub fn bar0(&self) -> &Bar {
        &self.bar0
    }

    pub fn container(&self) -> &Arc<VfioContainer> {
        &self.container
    }

    /// Read a 16-bit config-space register (pread on the device fd; errors are reported, unlike
    /// vfio-ioctls' `region_read`).
    pub fn config_read16(&self, offset: u64) -> Result<u16> {
        let mut b = [0u8; 2];
        self.config_file()
            .read_exact_at(&mut b, self.config_offset() + offset)
            .map_err(|source| Error::Io {
                device: self.name.clone(),
                what: "read PCI config space",
                source,
            })?;
        Ok(u16::from_le_bytes(b))
    }

    /// Write a 16-bit config-space register.
    pub fn config_write16(&self, offset: u64, value: u16) -> Result<()> {
        self.config_file()
            .write_all_at(&value.to_le_bytes(), self.config_offset() + offset)
            .map_err(|source| Error::Io {
                device: self.name.clone(),
                what: "write PCI config space",
                source,
            })
    }

    fn config_offset(&self) -> u64 {
        self.device.get_region_offset(CONFIG_REGION)
    }

    /// The device fd as a `File` for positioned reads and writes, without taking ownership.
    fn config_file(&self) -> std::mem::ManuallyDrop<File> {
        use std::os::unix::io::FromRawFd;
        // SAFETY: the fd is owned by self.device and outlives the returned value, which is
        // ManuallyDrop so it never closes the fd.
        std::mem::ManuallyDrop::new(unsafe { File::from_raw_fd(self.device.as_raw_fd()) })
    }

    /// Set Memory Space Enable and Bus Master Enable, and read the register back to prove it.
    fn enable_bus_master(&self) -> Result<()> {
        let cmd = self.config_read16(PCI_COMMAND)?;
        let want = cmd | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER;
        if cmd != want {
            self.config_write16(PCI_COMMAND, want)?;
        }
        let got = self.config_read16(PCI_COMMAND)?;
        if got & want != want {
            return Err(Error::Controller {
                device: self.name.clone(),
                state: "enabling bus mastering",
                detail: format!(
                    "PCI command register reads {got:#06x} after writing {want:#06x}: \
                     memory space / bus master enable did not stick"
                ),
            });
        }
        Ok(())
    }
}

fn setup(device: &Arc<str>, problem: String, fix: String) -> Error {
    Error::Setup {
        device: device.clone(),
        problem,
        fix,
    }
}

/// Check the host before touching VFIO, so each failure says what to do: the function exists,
/// an IOMMU is on, vfio-pci is loaded and owns the device, and `/dev/vfio` nodes can be opened.
/// `name` is the full PCI address.
pub fn check_host(name: &Arc<str>) -> Result<PciFunction> {
    let bdf: &str = name;
    let function = PciFunction::read(bdf).map_err(|e| {
        setup(
            name,
            e.to_string(),
            "pass an address from `nvstore device list`".into(),
        )
    })?;
    if function.iommu_group.is_none() || !sysfs::iommu_enabled() {
        return Err(setup(
            name,
            "the kernel runs without an IOMMU (no IOMMU group for the device)".into(),
            "enable VT-d/AMD-Vi in the firmware and add `intel_iommu=on iommu=pt` (Intel) or \
             `amd_iommu=on iommu=pt` (AMD) to the kernel command line, then reboot"
                .into(),
        ));
    }
    if !sysfs::vfio_pci_loaded() {
        return Err(setup(
            name,
            "the vfio-pci driver is not loaded".into(),
            "`modprobe vfio-pci` (and `nvstore device bind` the device)".into(),
        ));
    }
    if function.driver.as_deref() != Some("vfio-pci") {
        return Err(setup(
            name,
            format!(
                "the device is bound to {}, not vfio-pci",
                function.driver.as_deref().unwrap_or("no driver")
            ),
            format!("`nvstore device bind {bdf}`"),
        ));
    }
    let group = function.iommu_group.expect("checked above");
    for path in ["/dev/vfio/vfio".to_string(), format!("/dev/vfio/{group}")] {
        match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
        {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::PermissionDenied => {
                return Err(setup(
                    name,
                    format!("not permitted to open {path}"),
                    format!(
                        "run as root, or give your user the device: `chown $USER {path}` \
                         (and raise RLIMIT_MEMLOCK, see `ulimit -l`)"
                    ),
                ))
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {
                return Err(setup(
                    name,
                    format!("{path} does not exist"),
                    format!("`nvstore device bind {bdf}` (it creates the VFIO group node)"),
                ))
            }
            // EBUSY: another process holds the group. Reported with its own text below.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                return Err(setup(
                    name,
                    format!("{path} is busy: another process has the device open"),
                    "stop the other nvstore process (or whatever holds the group) first".into(),
                ))
            }
            Err(e) => {
                return Err(Error::Io {
                    device: name.clone(),
                    what: "open VFIO node",
                    source: e,
                })
            }
        }
    }
    Ok(function)
}

/// Translate vfio-ioctls' errors, naming the blocker when the group is not viable.
fn vfio_error(name: &Arc<str>, function: &PciFunction, what: &str, e: VfioError) -> Error {
    if matches!(e, VfioError::GroupViable) {
        let blockers: Vec<String> = function
            .group_peers()
            .into_iter()
            .filter_map(|peer| {
                let f = PciFunction::read(&peer).ok()?;
                match f.driver.as_deref() {
                    None | Some("vfio-pci") | Some("pcieport") => None,
                    Some(d) => Some(format!("{peer} (bound to {d})")),
                }
            })
            .collect();
        return setup(
            name,
            format!(
                "IOMMU group {} is not viable: other devices in it are bound to kernel \
                 drivers: {}",
                function.iommu_group.unwrap_or(0),
                if blockers.is_empty() {
                    "unknown".to_string()
                } else {
                    blockers.join(", ")
                }
            ),
            "bind every device of the group to vfio-pci (`nvstore device bind ADDR…`) or \
             unbind them from their drivers"
                .into(),
        );
    }
    Error::Setup {
        device: name.clone(),
        problem: format!("VFIO {what} failed: {e}"),
        fix: "check `dmesg` for vfio messages; the device must be bound to vfio-pci and the \
              kernel must support the Type1v2 IOMMU"
            .into(),
    }
}

fn map_bar0(name: &Arc<str>, device: &VfioDevice) -> Result<Bar> {
    let len = device.get_region_size(0) as usize;
    let offset = device.get_region_offset(0);
    if len < 0x2000 {
        return Err(Error::Controller {
            device: name.clone(),
            state: "mapping BAR0",
            detail: format!("BAR0 is {len} bytes; an NVMe controller needs at least 8 KiB"),
        });
    }
    if device.get_region_flags(0) & REGION_FLAG_MMAP == 0 {
        return Err(Error::Controller {
            device: name.clone(),
            state: "mapping BAR0",
            detail: "vfio-pci does not allow mmap of BAR0".into(),
        });
    }
    // SAFETY: mapping a device region of a VFIO fd at the offset VFIO reported; no existing
    // memory is affected. The result is checked below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            device.as_raw_fd(),
            offset as libc::off_t,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(Error::Io {
            device: name.clone(),
            what: "mmap BAR0",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(Bar {
        ptr: NonNull::new(ptr as *mut u8).expect("mmap returned null"),
        len,
    })
}
