//! The floating-point environment this crate relies on: IEEE denormals everywhere.
//!
//! Decision: no thread flushes denormals. Rust threads start with the default MXCSR
//! (FTZ and DAZ clear) and nothing in lockstep changes it, so the main thread and every
//! pool worker compute denormals identically. [`denormal_flags`] lets tests and start-up
//! checks verify that no foreign code changed it.

/// The FTZ (bit 15) and DAZ (bit 6) bits of this thread's MXCSR; 0 means IEEE denormals.
/// Always 0 on targets without MXCSR.
pub fn denormal_flags() -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        let mut csr: u32 = 0;
        // SAFETY: `stmxcsr` only stores the 32-bit MXCSR register into `csr`, a valid,
        // writable u32 on this stack frame.
        unsafe {
            std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack, preserves_flags));
        }
        csr & ((1 << 15) | (1 << 6))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        0
    }
}
