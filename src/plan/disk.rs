//! The disk beside the plan: how much a file system has free, what is already under a
//! directory, the NVMe paths' room, and the check that a node's swap files
//! (`report::nvme_bytes`) fit `train.nvme_space`.

use super::report::nvme_bytes;
use super::Plan;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// The nearest existing directory at or above `path` (a relative path's last ancestor,
/// "", is the working directory).
pub fn existing(path: &Path) -> Option<&Path> {
    path.ancestors()
        .map(|p| {
            if p.as_os_str().is_empty() {
                Path::new(".")
            } else {
                p
            }
        })
        .find(|p| p.exists())
}

/// Bytes the files under `dir` occupy on disk, recursively (allocated blocks: a
/// checkpoint's holes take none; 0 when it does not exist).
pub fn bytes_under(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => bytes_under(&e.path()),
            _ => e.metadata().map_or(0, |m| m.blocks() * 512),
        })
        .sum()
}

/// (device id, bytes available to this user) of the file system holding `path`.
pub fn file_system(path: &Path) -> Option<(u64, u64)> {
    let dir = existing(path)?;
    let device = std::fs::metadata(dir).ok()?.dev();
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: a NUL-terminated path and a zeroed statvfs the call fills
    let stat = unsafe {
        let mut stat: libc::statvfs = std::mem::zeroed();
        (libc::statvfs(c.as_ptr(), &mut stat) == 0).then_some(stat)
    }?;
    Some((device, stat.f_bavail * stat.f_frsize))
}

/// The swap stores' directories under an NVMe path (`run/stores.rs` names them).
const STORES: [&str; 2] = ["tierzero-optimizer", "tierzero-params"];

/// Room for swap files on the NVMe paths: each distinct file system's free space, with
/// the swap files an earlier run left there counted as free (a new run replaces them).
pub fn nvme_room(paths: &[&Path]) -> Option<u64> {
    let mut seen = Vec::new();
    let mut room = 0;
    for path in paths {
        let (device, free) = file_system(path)?;
        let left: u64 = STORES.iter().map(|s| bytes_under(&path.join(s))).sum();
        if !seen.contains(&device) {
            seen.push(device);
            room += free;
        }
        room += left;
    }
    (!seen.is_empty()).then_some(room)
}

/// When this node's swap files exceed `train.nvme_space`: what `plan` says, with what
/// would make them fit.
pub fn nvme_fit_warning(plan: &Plan) -> Option<String> {
    let room = plan.train.nvme_space?;
    let needed = nvme_bytes(plan);
    (needed > room).then(|| {
        let gib = |b: u64| format!("{:.2} GiB", b as f64 / f64::from(1u32 << 30));
        format!(
            "the NVMe swap files take {} on this node, over train.nvme_space {} (the NVMe path's free space unless set): \
             the run would fail writing them; free {} on the NVMe path, or keep more state in host memory \
             (train.optimizer_max_in_cpu, offload_param.max_in_cpu) or on the device (offload_optimizer.ratio)",
            gib(needed),
            gib(room),
            gib(needed - room)
        )
    })
}
