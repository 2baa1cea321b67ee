//! Start-up probe of the kernel and the target directory: can we use io_uring, and does
//! the filesystem take O_DIRECT (`statx` DIOALIGN, then a real aligned O_DIRECT write).
//!
//! tmpfs accepts O_DIRECT without enforcing alignment on new kernels and refuses it on
//! old ones; some container filesystems refuse it outright. The probe writes one page
//! to a temporary file of its own name and removes it.

use super::{IoError, DIRECT_ALIGN};
use crate::pool::IoBuf;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// What the probe found. `Err` strings say why a feature is unavailable.
#[derive(Clone, Debug)]
pub struct ProbeReport {
    pub uring: Result<(), String>,
    pub direct: Result<(), String>,
    /// `statx` DIOALIGN: (memory alignment, offset alignment), when the kernel reports it.
    pub dio_align: Option<(u32, u32)>,
}

impl ProbeReport {
    /// Why the pread engine is used, in one line.
    pub fn fallback_reason(&self) -> String {
        match (&self.uring, &self.direct) {
            (Err(u), _) => format!("io_uring unavailable: {u}"),
            (_, Err(d)) => format!("O_DIRECT unavailable: {d}"),
            _ => "pread engine requested".into(),
        }
    }
}

/// Probes io_uring and O_DIRECT for files under `dir` (created if missing).
pub fn probe(dir: &Path) -> Result<ProbeReport, IoError> {
    std::fs::create_dir_all(dir).map_err(|source| IoError::Open {
        path: dir.to_path_buf(),
        source,
    })?;
    let uring = io_uring::IoUring::new(2).map(drop).map_err(|e| e.to_string());
    let dio_align = statx_dio_align(dir);
    if let Some((memory, offset)) = dio_align {
        if u64::from(memory.max(offset)) > DIRECT_ALIGN {
            let reason = format!(
                "the filesystem needs {memory}/{offset}-byte O_DIRECT alignment, more than {DIRECT_ALIGN}"
            );
            return Ok(ProbeReport {
                uring,
                direct: Err(reason),
                dio_align,
            });
        }
    }
    let direct = try_direct_write(dir);
    Ok(ProbeReport {
        uring,
        direct,
        dio_align,
    })
}

fn statx_dio_align(dir: &Path) -> Option<(u32, u32)> {
    let path = CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statx is plain data; all zeros is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: path is NUL-terminated and stx is a valid out-pointer.
    let rc = unsafe { libc::statx(libc::AT_FDCWD, path.as_ptr(), 0, libc::STATX_DIOALIGN, &mut stx) };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return None;
    }
    Some((stx.stx_dio_mem_align, stx.stx_dio_offset_align))
}

fn try_direct_write(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(format!(".tierzero-probe-{}", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .map_err(|e| format!("open with O_DIRECT: {e}"))?;
    let buf = IoBuf::new(DIRECT_ALIGN as usize).map_err(|e| e.to_string())?;
    let written = file.write_at(&buf.as_bytes()[..DIRECT_ALIGN as usize], 0);
    drop(file);
    let _ = std::fs::remove_file(&path);
    match written {
        Ok(n) if n == DIRECT_ALIGN as usize => Ok(()),
        Ok(n) => Err(format!("short O_DIRECT write of {n} bytes")),
        Err(e) => Err(format!("O_DIRECT write: {e}")),
    }
}
