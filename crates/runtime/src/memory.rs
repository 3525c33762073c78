//! The memory check, split by where memory lives: a CPU load needs its weights, KV cache
//! and scratch in host RAM; a CUDA load needs them in the device's free memory and only
//! what stays on the host (the embedding table, read a row per token, and the logits
//! copied back) in host RAM.
//!
//! [`MemoryNeeds::split`] and [`MemoryNeeds::check`] are pure functions of the numbers,
//! so the decision is tested without a GPU; [`MemoryNeeds::for_model`] reads them from a
//! model file.

use gguf::GgufFile;
use model::{KvType, MemoryEstimate};

use crate::LoadError;

const MIB: u64 = 1 << 20;

/// Where a model's forward runs, for the memory check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// The CPU backend: everything in host RAM.
    Cpu,
    /// CUDA device N: weights, KV cache and scratch in its memory.
    Cuda(usize),
}

/// Which memory a need is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryKind {
    /// Host RAM for a CPU load (`MemAvailable`).
    HostRam,
    /// Host RAM for what a load on CUDA device N keeps on the host.
    HostRamBeside(usize),
    /// The free memory of CUDA device N.
    Device(usize),
}

impl std::fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemoryKind::HostRam => f.write_str("host RAM"),
            MemoryKind::HostRamBeside(n) => write!(
                f,
                "host RAM (for what a load on CUDA device {n} keeps on the host: the \
                 embedding table and the logits)"
            ),
            MemoryKind::Device(n) => write!(f, "memory on CUDA device {n}"),
        }
    }
}

/// The memory there is: host RAM (`MemAvailable`) and, for a CUDA load, the device's free
/// memory. `None` is unknown, which bounds nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryBudget {
    /// Host RAM available, in bytes.
    pub host_available: Option<u64>,
    /// Free memory of the CUDA device the load goes to, in bytes.
    pub device_free: Option<u64>,
}

impl MemoryBudget {
    /// Host RAM as `/proc/meminfo` gives it, and no device.
    pub fn host() -> MemoryBudget {
        MemoryBudget {
            host_available: model::available_memory(),
            device_free: None,
        }
    }
}

/// What a load needs from each memory, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryNeeds {
    /// Where the forward runs.
    pub placement: Placement,
    /// What lives in host RAM.
    pub host: MemoryEstimate,
    /// What lives in device memory (`None` on the CPU).
    pub device: Option<MemoryEstimate>,
}

fn estimate(weights_bytes: u64, kv_bytes: u64, scratch_bytes: u64) -> MemoryEstimate {
    MemoryEstimate {
        weights_bytes,
        kv_bytes,
        scratch_bytes,
        total: weights_bytes + kv_bytes + scratch_bytes,
    }
}

impl MemoryNeeds {
    /// Splits a whole-model estimate by `placement`. On the CPU all of it is host RAM. On
    /// CUDA the device holds the weights less `host_only_weights` (tensors that stay on
    /// the host: the embedding table when the output head is a tensor of its own), the
    /// KV cache and the scratch; the host holds `host_resident_weights` (the embedding
    /// table, read a row per token) and `host_scratch` (logits copied back).
    pub fn split(
        whole: &MemoryEstimate,
        placement: Placement,
        host_only_weights: u64,
        host_resident_weights: u64,
        host_scratch: u64,
    ) -> MemoryNeeds {
        match placement {
            Placement::Cpu => MemoryNeeds {
                placement,
                host: *whole,
                device: None,
            },
            Placement::Cuda(_) => MemoryNeeds {
                placement,
                host: estimate(host_resident_weights, 0, host_scratch),
                device: Some(estimate(
                    whole.weights_bytes.saturating_sub(host_only_weights),
                    whole.kv_bytes,
                    whole.scratch_bytes,
                )),
            },
        }
    }

    /// The needs of the model in `gguf` with a KV cache of `ctx_tokens` token slots of
    /// `kv_type`, run on `placement`.
    pub fn for_model(
        gguf: &GgufFile,
        ctx_tokens: usize,
        kv_type: KvType,
        placement: Placement,
    ) -> Result<MemoryNeeds, LoadError> {
        let whole = MemoryEstimate::for_model(gguf, ctx_tokens, kv_type)?;
        let bytes = |name: &str| gguf.tensor(name).map_or(0, |t| t.n_bytes);
        let embedding = bytes("token_embd.weight");
        // With a separate output head the embedding table is never uploaded; with tied
        // embeddings it is the head, uploaded, and still read on the host for each token.
        let host_only = if gguf.tensor("output.weight").is_some() {
            embedding
        } else {
            0
        };
        let n_vocab = gguf
            .tensor("token_embd.weight")
            .and_then(|t| t.dims.get(1).copied())
            .unwrap_or(0);
        // Two rows of f32 logits on the host (a row and its staging), as on the CPU.
        let host_scratch = 2 * n_vocab * 4;
        Ok(MemoryNeeds::split(
            &whole,
            placement,
            host_only,
            embedding,
            host_scratch,
        ))
    }

    /// Refuses, naming the memory that is short and by how much, when a need exceeds what
    /// `budget` has (device memory first). Unknown amounts bound nothing.
    pub fn check(&self, budget: &MemoryBudget) -> Result<(), LoadError> {
        if let (Placement::Cuda(n), Some(device)) = (self.placement, &self.device) {
            fits(device, budget.device_free, MemoryKind::Device(n))?;
            return fits(
                &self.host,
                budget.host_available,
                MemoryKind::HostRamBeside(n),
            );
        }
        fits(&self.host, budget.host_available, MemoryKind::HostRam)
    }
}

fn fits(
    need: &MemoryEstimate,
    available: Option<u64>,
    memory: MemoryKind,
) -> Result<(), LoadError> {
    match available {
        Some(available) if need.total > available => Err(LoadError::InsufficientMemory {
            memory,
            needed_mib: need.total.div_ceil(MIB),
            weights_mib: need.weights_bytes.div_ceil(MIB),
            kv_mib: need.kv_bytes.div_ceil(MIB),
            scratch_mib: need.scratch_bytes.div_ceil(MIB),
            available_mib: available / MIB,
            short_mib: (need.total - available).div_ceil(MIB),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole() -> MemoryEstimate {
        // 1000 MiB of weights (100 of them the embedding table), 300 KV, 50 scratch.
        estimate(1000 * MIB, 300 * MIB, 50 * MIB)
    }

    fn budget(host: u64, device: Option<u64>) -> MemoryBudget {
        MemoryBudget {
            host_available: Some(host * MIB),
            device_free: device.map(|d| d * MIB),
        }
    }

    #[test]
    fn a_cpu_load_is_checked_against_host_ram_only() {
        let needs = MemoryNeeds::split(&whole(), Placement::Cpu, 100 * MIB, 100 * MIB, MIB);
        assert_eq!(needs.device, None);
        assert_eq!(needs.host, whole());
        assert!(needs.check(&budget(1350, None)).is_ok());
        // A GPU's memory does not help a CPU load.
        let e = needs.check(&budget(1349, Some(1 << 20))).unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with("not enough host RAM:"), "{msg}");
        assert!(msg.contains("about 1350 MiB"), "{msg}");
        assert!(msg.contains("only 1349 MiB"), "{msg}");
        assert!(msg.contains("1 MiB short"), "{msg}");
        assert!(
            matches!(
                e,
                LoadError::InsufficientMemory {
                    memory: MemoryKind::HostRam,
                    short_mib: 1,
                    ..
                }
            ),
            "{e:?}"
        );
    }

    #[test]
    fn a_cuda_load_puts_weights_and_kv_on_the_device_and_little_on_the_host() {
        let needs = MemoryNeeds::split(&whole(), Placement::Cuda(1), 100 * MIB, 100 * MIB, MIB);
        let device = needs.device.unwrap();
        assert_eq!(
            (device.weights_bytes, device.kv_bytes, device.scratch_bytes),
            (900 * MIB, 300 * MIB, 50 * MIB)
        );
        assert_eq!(device.total, 1250 * MIB);
        assert_eq!(needs.host.total, 101 * MIB);
        // Little host RAM, enough device memory: the load fits (host RAM no longer gates
        // a CUDA load).
        assert!(needs.check(&budget(200, Some(1250))).is_ok());
        // The device is short: its memory is named, with the shortfall.
        let msg = needs
            .check(&budget(1 << 20, Some(1000)))
            .unwrap_err()
            .to_string();
        assert!(
            msg.starts_with("not enough memory on CUDA device 1:"),
            "{msg}"
        );
        assert!(msg.contains("about 1250 MiB"), "{msg}");
        assert!(msg.contains("KV cache 300 MiB"), "{msg}");
        assert!(msg.contains("250 MiB short"), "{msg}");
        assert!(msg.contains("--device cpu"), "{msg}");
        // The device fits, the host side does not.
        let e = needs.check(&budget(100, Some(1 << 20))).unwrap_err();
        assert!(
            matches!(
                e,
                LoadError::InsufficientMemory {
                    memory: MemoryKind::HostRamBeside(1),
                    needed_mib: 101,
                    short_mib: 1,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .contains("not enough host RAM (for what a load on CUDA device 1")
        );
    }

    #[test]
    fn tied_embeddings_stay_on_the_device_too() {
        // Tied: nothing is host-only, the embedding table is still read on the host.
        let needs = MemoryNeeds::split(&whole(), Placement::Cuda(0), 0, 100 * MIB, 0);
        assert_eq!(needs.device.unwrap().weights_bytes, 1000 * MIB);
        assert_eq!(needs.host.weights_bytes, 100 * MIB);
    }

    #[test]
    fn unknown_amounts_bound_nothing() {
        let needs = MemoryNeeds::split(&whole(), Placement::Cuda(0), 0, 0, 0);
        assert!(needs.check(&MemoryBudget::default()).is_ok());
        assert!(needs.check(&budget(0, None)).is_ok());
        let cpu = MemoryNeeds::split(&whole(), Placement::Cpu, 0, 0, 0);
        assert!(cpu.check(&MemoryBudget::default()).is_ok());
        assert!(cpu.check(&budget(0, None)).is_err());
    }
}
