//! Free-space check before large writes, so a pull fails up front with a clear message
//! instead of half-way with ENOSPC.

use std::path::Path;

use crate::HubError;

/// Bytes of head-room required on top of what a write needs: 5 % of it, at least 64 MiB.
pub fn space_margin(bytes: u64) -> u64 {
    (bytes / 20).max(64 << 20)
}

/// The decision: writing `bytes` into a file system with `available` free bytes is allowed
/// when `bytes` plus the margin fit. `Err` carries the number of bytes needed.
pub fn check_space(bytes: u64, available: u64) -> Result<(), u64> {
    let needed = bytes.saturating_add(space_margin(bytes));
    if needed <= available {
        Ok(())
    } else {
        Err(needed)
    }
}

/// Bytes available to an unprivileged user on the file system holding `dir`.
#[cfg(unix)]
pub fn available_space(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;

    let c_path = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c_path` is a valid NUL-terminated string and `stat` points to writable
    // memory large enough for one `statvfs`, which is all statvfs(3) writes.
    let rc = unsafe { libc::statvfs(c_path.as_ptr(), stat.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it filled in the whole struct.
    let stat = unsafe { stat.assume_init() };
    #[allow(clippy::unnecessary_cast)] // the field types differ between platforms
    Ok((stat.f_bavail as u64).saturating_mul(stat.f_frsize as u64))
}

/// Bytes available on the file system holding `dir` (not measured on this platform).
#[cfg(not(unix))]
pub fn available_space(_dir: &Path) -> std::io::Result<u64> {
    Ok(u64::MAX)
}

/// Fails with [`HubError::InsufficientSpace`] when `bytes` (plus margin) do not fit in `dir`.
pub(crate) fn ensure_space(dir: &Path, bytes: u64) -> Result<(), HubError> {
    let available =
        available_space(dir).map_err(|e| HubError::io("measure free space in", dir, e))?;
    check_space(bytes, available).map_err(|needed| HubError::InsufficientSpace {
        dir: dir.to_path_buf(),
        needed,
        available,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn space_check_requires_size_plus_margin() {
        let gib = 1u64 << 30;
        // 1 GiB needs 1 GiB + 5 % (51.2 MiB, raised to the 64 MiB floor).
        assert_eq!(space_margin(gib), 64 << 20);
        assert_eq!(check_space(gib, gib + (64 << 20)), Ok(()));
        assert_eq!(
            check_space(gib, gib + (64 << 20) - 1),
            Err(gib + (64 << 20))
        );
        assert_eq!(check_space(gib, gib), Err(gib + (64 << 20)));
        // Large files get 5 %.
        assert_eq!(space_margin(10 * gib), gib / 2);
        assert!(check_space(10 * gib, 10 * gib + gib / 2).is_ok());
        assert!(check_space(10 * gib, 10 * gib + gib / 4).is_err());
        // Nothing to write still needs the floor; no overflow at the top.
        assert_eq!(check_space(0, 0), Err(64 << 20));
        assert_eq!(check_space(u64::MAX, u64::MAX - 1), Err(u64::MAX));
    }

    #[test]
    fn available_space_is_measured_for_an_existing_dir() {
        let dir = std::env::temp_dir();
        let free = available_space(&dir);
        assert!(matches!(free, Ok(n) if n > 0), "{free:?}");
        assert!(available_space(Path::new("/no/such/dir/for/lockstep")).is_err());
    }

    #[test]
    fn insufficient_space_error_names_needed_and_free() {
        let err = HubError::InsufficientSpace {
            dir: "/cache".into(),
            needed: 3 << 30,
            available: 1 << 30,
        };
        let msg = err.to_string();
        assert!(msg.contains("/cache"), "{msg}");
        assert!(msg.contains("3.00 GiB"), "{msg}");
        assert!(msg.contains("1.00 GiB free"), "{msg}");
        assert!(msg.contains("LOCKSTEP_HOME"), "{msg}");
    }
}
