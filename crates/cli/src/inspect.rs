//! `lockstep inspect FILE`: what a GGUF file holds and roughly what it needs to run.
//!
//! Header facts, every metadata key on one line (arrays summarised, the chat template by
//! length), a per-type table of tensor bytes, and memory for the weights plus an f16 KV
//! cache.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use anyhow::Context;
use gguf::{GgufFile, Value};

/// Strings longer than this are shown shortened, with their length.
const MAX_SHOWN_STRING: usize = 80;
/// Tokens the KV-cache estimate is given for.
const KV_TOKENS: u64 = 1024;

/// Prints a summary of the GGUF file at `path` to `out`.
pub fn run(path: &Path, out: &mut dyn Write) -> anyhow::Result<()> {
    let file = GgufFile::open(path).with_context(|| format!("inspecting {}", path.display()))?;

    writeln!(out, "file:          {}", path.display())?;
    writeln!(out, "size:          {}", human_bytes(file.file_len()))?;
    writeln!(out, "GGUF version:  {}", file.version())?;
    let arch = file.architecture().ok();
    writeln!(out, "architecture:  {}", arch.unwrap_or("(none)"))?;
    writeln!(
        out,
        "name:          {}",
        file.get_str("general.name").unwrap_or("(none)")
    )?;
    writeln!(out, "alignment:     {}", file.alignment())?;

    writeln!(out, "metadata:      {} keys", file.metadata().len())?;
    for (key, value) in file.metadata() {
        writeln!(
            out,
            "  {key} ({}) = {}",
            value.type_description(),
            show_value(key, value)
        )?;
    }

    writeln!(out, "tensors:       {}", file.tensors().len())?;
    let mut by_type: BTreeMap<&'static str, (u64, u64)> = BTreeMap::new();
    for t in file.tensors() {
        let e = by_type.entry(t.ggml_type.name()).or_default();
        e.0 += 1;
        e.1 = e.1.saturating_add(t.n_bytes);
    }
    let total: u64 = file
        .tensors()
        .iter()
        .fold(0u64, |a, t| a.saturating_add(t.n_bytes));
    let mut rows: Vec<_> = by_type.into_iter().collect();
    rows.sort_by(|a, b| b.1.1.cmp(&a.1.1).then(a.0.cmp(b.0)));
    writeln!(
        out,
        "  {:<8} {:>6} {:>16} {:>7}",
        "type", "count", "bytes", "share"
    )?;
    for (name, (count, bytes)) in rows {
        let share = if total == 0 {
            0.0
        } else {
            bytes as f64 * 100.0 / total as f64
        };
        writeln!(
            out,
            "  {name:<8} {count:>6} {:>16} {share:>6.1}%",
            group_digits(bytes)
        )?;
    }
    writeln!(out, "weights:       {}", human_bytes(total))?;

    match arch.and_then(|a| kv_bytes_per_token(&file, a)) {
        Some(per_token) => {
            let kv = per_token.saturating_mul(KV_TOKENS);
            writeln!(
                out,
                "KV cache f16:  {} per token, {} per {KV_TOKENS} tokens (upper bound: every layer full attention)",
                human_bytes(per_token),
                human_bytes(kv)
            )?;
            writeln!(
                out,
                "memory:        {} for weights + {KV_TOKENS} tokens of KV cache",
                human_bytes(total.saturating_add(kv))
            )?;
        }
        None => writeln!(
            out,
            "KV cache f16:  unknown (attention metadata missing); weights alone {}",
            human_bytes(total)
        )?,
    }
    Ok(())
}

/// One metadata value for display: the chat template by length, long strings shortened,
/// arrays as type, length and first items.
fn show_value(key: &str, value: &Value) -> String {
    match value {
        Value::String(s) if key == "tokenizer.chat_template" => {
            format!("<chat template, {} bytes>", s.len())
        }
        Value::String(s) if s.chars().count() > MAX_SHOWN_STRING => {
            let head: String = s.chars().take(MAX_SHOWN_STRING).collect();
            format!("{head:?}... ({} bytes)", s.len())
        }
        v => v.to_string(),
    }
}

/// Bytes of f16 K and V per token over all layers:
/// `sum over layers of head_count_kv * (key_length + value_length) * 2`.
/// `None` when the attention shape is not in the metadata.
fn kv_bytes_per_token(file: &GgufFile, arch: &str) -> Option<u64> {
    let key = |k: &str| format!("{arch}.{k}");
    let layers = file.get_u64(&key("block_count")).ok()?;
    let heads = file.get_u64(&key("attention.head_count")).ok();
    let head_dim = |len_key: &str| -> Option<u64> {
        file.get_u64(&key(len_key)).ok().or_else(|| {
            let embd = file.get_u64(&key("embedding_length")).ok()?;
            embd.checked_div(heads?)
        })
    };
    let k_len = head_dim("attention.key_length")?;
    let v_len = head_dim("attention.value_length")?;
    // head_count_kv: one number for all layers, or one per layer; defaults to head_count.
    let kv_heads_total = match file.get(&key("attention.head_count_kv")) {
        Some(Value::Array(a)) => a
            .to_i64s()?
            .iter()
            .try_fold(0u64, |acc, &h| acc.checked_add(u64::try_from(h).ok()?))?,
        Some(v) => v.as_u64()?.checked_mul(layers)?,
        None => heads?.checked_mul(layers)?,
    };
    kv_heads_total
        .checked_mul(k_len.checked_add(v_len)?)?
        .checked_mul(2)
}

/// `98362432` → `"98,362,432"`.
fn group_digits(n: u64) -> String {
    let digits = n.to_string();
    let mut grouped = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            grouped.push(',');
        }
        grouped.push(c);
    }
    grouped
}

/// `98362432` → `"98,362,432 bytes (93.8 MiB)"`.
fn human_bytes(n: u64) -> String {
    let grouped = group_digits(n);
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut size = n as f64;
    let mut unit = None;
    for u in UNITS {
        if size < 1024.0 {
            break;
        }
        size /= 1024.0;
        unit = Some(u);
    }
    match unit {
        Some(u) => format!("{grouped} bytes ({size:.1} {u})"),
        None => format!("{grouped} bytes"),
    }
}
