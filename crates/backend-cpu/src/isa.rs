//! The kernel set: which instruction-set path every kernel of this crate runs.
//!
//! Chosen once per process from the runtime CPU features (never from the shape of the
//! work), so a row is always computed by the same code. Every path is bit-identical to
//! the scalar reference; the choice only changes speed. AMX is never used.

use std::sync::OnceLock;

/// One instruction-set path for the kernels of this crate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Plain Rust: the reference every other path is tested against.
    Scalar,
    /// AVX2 + FMA + F16C (the 16-lane canonical order as two 8-lane registers).
    Avx2,
    /// AVX-512 F/BW/VL (+ FMA, F16C).
    Avx512,
}

impl Isa {
    /// Every path, fastest last.
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512];

    /// Whether this CPU can run the path.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every path this CPU supports (always includes [`Isa::Scalar`]).
    pub fn supported() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_supported()).collect()
    }

    /// The name used by `LOCKSTEP_CPU_ISA` and in logs.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Parses a name from [`Isa::name`].
    pub fn from_name(name: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|i| i.name() == name)
    }

    /// The path this process uses, chosen once: the best supported one, or a lower one
    /// named by the environment variable `LOCKSTEP_CPU_ISA` (`scalar`, `avx2`, `avx512`;
    /// an unsupported or unknown name falls back to the best supported path).
    pub fn selected() -> Isa {
        static SELECTED: OnceLock<Isa> = OnceLock::new();
        *SELECTED.get_or_init(|| {
            let best = Isa::ALL
                .into_iter()
                .rev()
                .find(|i| i.is_supported())
                .unwrap_or(Isa::Scalar);
            match std::env::var("LOCKSTEP_CPU_ISA")
                .ok()
                .as_deref()
                .and_then(Isa::from_name)
            {
                Some(forced) if forced.is_supported() => forced,
                _ => best,
            }
        })
    }

    /// Returns `self` when supported, else [`Isa::Scalar`]; kernels call this so that an
    /// unsupported path can never execute unsupported instructions.
    pub(crate) fn checked(self) -> Isa {
        if self == Isa::Scalar || self.is_supported() {
            self
        } else {
            Isa::Scalar
        }
    }
}
