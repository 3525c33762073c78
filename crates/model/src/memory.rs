//! Memory honesty: estimate what a model needs before loading it, and refuse (with the
//! numbers) rather than thrash when the machine does not have it.

use crate::ModelError;
use crate::config::Config;
use crate::deepseek4::Deepseek4Config;
use backend_cpu::{DEFAULT_BLOCK_SIZE, KvType};
use gguf::GgufFile;

/// Batch rows the scratch estimate assumes (the largest prefill chunk callers should
/// submit in one forward).
pub const ESTIMATE_BATCH_ROWS: usize = 512;

/// What a model needs in memory, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// Tensor data of the file (mapped; resident once touched).
    pub weights_bytes: u64,
    /// KV cache for the context.
    pub kv_bytes: u64,
    /// Forward scratch for [`ESTIMATE_BATCH_ROWS`] rows, one row of logits and the RoPE
    /// table.
    pub scratch_bytes: u64,
    /// The sum.
    pub total: u64,
}

impl MemoryEstimate {
    /// The estimate for the model in `gguf` with a KV cache of `ctx_tokens` token slots
    /// (DeepSeek V4: one sequence's state over `ctx_tokens` positions, see
    /// [`Deepseek4Config::state_bytes`]).
    pub fn for_model(
        gguf: &GgufFile,
        ctx_tokens: usize,
        kv_type: KvType,
    ) -> Result<MemoryEstimate, ModelError> {
        let weights_bytes: u64 = gguf.tensors().iter().map(|t| t.n_bytes).sum();
        if gguf.architecture().ok() == Some("deepseek4") {
            // One sequence's state (f32 window rows, compressor logs, compressed rows and
            // indexer keys) over `ctx_tokens` positions, and the forward's scratch.
            let cfg = Deepseek4Config::from_gguf(gguf)?;
            let kv_bytes = cfg.state_bytes(ctx_tokens, ESTIMATE_BATCH_ROWS);
            let scratch_bytes = cfg.scratch_bytes(ESTIMATE_BATCH_ROWS);
            return Ok(MemoryEstimate {
                weights_bytes,
                kv_bytes,
                scratch_bytes,
                total: weights_bytes + kv_bytes + scratch_bytes,
            });
        }
        let cfg = Config::from_gguf(gguf)?;
        let slots = ctx_tokens.div_ceil(DEFAULT_BLOCK_SIZE) as u64 * DEFAULT_BLOCK_SIZE as u64;
        let elem = match kv_type {
            KvType::F16 => 2,
            KvType::F32 => 4,
        };
        let kv_bytes = cfg.n_layer as u64 * 2 * cfg.kv_dim() as u64 * slots * elem;
        let m = ESTIMATE_BATCH_ROWS as u64;
        let (e, qd, kvd, f) = (
            cfg.n_embd as u64,
            cfg.q_dim() as u64,
            cfg.kv_dim() as u64,
            cfg.n_ff as u64,
        );
        // f32 buffers: x, xn, proj, q, attn, k, v, gate, up, plus the tile-major staging
        // of the widest matmul group; int8 activations with their scales (~1.2 bytes per
        // value) for the widest input in two layouts; one row of logits (and its staging);
        // the RoPE table (cos and sin per position and pair).
        let f32s = m * (3 * e + 2 * qd + 2 * kvd + 2 * f) + m * (2 * f).max(qd + 2 * kvd);
        let acts = 2 * m * e.max(f).max(qd) * 6 / 5;
        let logits = 2 * cfg.n_vocab as u64 * 4;
        let rope = ctx_tokens as u64 * (cfg.n_rot as u64 / 2) * 8;
        let scratch_bytes = f32s * 4 + acts + logits + rope;
        Ok(MemoryEstimate {
            weights_bytes,
            kv_bytes,
            scratch_bytes,
            total: weights_bytes + kv_bytes + scratch_bytes,
        })
    }
}

const MIB: u64 = 1 << 20;

/// Refuses (with the numbers, in MiB) when `estimate.total` exceeds `available_bytes`
/// (e.g. from [`available_memory`]).
pub fn check_memory(estimate: &MemoryEstimate, available_bytes: u64) -> Result<(), ModelError> {
    if estimate.total <= available_bytes {
        return Ok(());
    }
    Err(ModelError::InsufficientMemory {
        needed_mib: estimate.total.div_ceil(MIB),
        weights_mib: estimate.weights_bytes.div_ceil(MIB),
        kv_mib: estimate.kv_bytes.div_ceil(MIB),
        scratch_mib: estimate.scratch_bytes.div_ceil(MIB),
        available_mib: available_bytes / MIB,
    })
}

/// `MemAvailable` from `/proc/meminfo`, in bytes (`None` where unavailable).
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

/// The `MemAvailable:` line of a `/proc/meminfo` text, in bytes.
pub fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?;
    let mut parts = line.split_whitespace();
    let value: u64 = parts.next()?.parse().ok()?;
    let scale = match parts.next() {
        Some("kB") | Some("KB") | Some("kb") => 1024,
        None => 1,
        Some(_) => return None,
    };
    value.checked_mul(scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_parses_kilobytes() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(parse_mem_available(text), Some(2048 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
    }

    #[test]
    fn check_memory_refuses_with_mib_numbers() {
        let est = MemoryEstimate {
            weights_bytes: 900 * MIB,
            kv_bytes: 200 * MIB,
            scratch_bytes: 50 * MIB,
            total: 1150 * MIB,
        };
        assert!(check_memory(&est, 2000 * MIB).is_ok());
        let msg = check_memory(&est, 1000 * MIB).unwrap_err().to_string();
        assert!(msg.contains("1150 MiB"), "{msg}");
        assert!(msg.contains("only 1000 MiB"), "{msg}");
        assert!(msg.contains("KV cache 200 MiB"), "{msg}");
    }
}
