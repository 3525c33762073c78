//! The ggml tensor type table: ids as stored in GGUF files, block lengths and bytes per block.
//!
//! Values follow ggml's `type_traits` (mirrored in gguf-py's `GGML_QUANT_SIZES`). Ids that
//! ggml removed from GGUF files (4, 5, 31–33, 36–38) are unknown here on purpose.

use std::fmt;

/// Super-block length of the k-quants and the i-quants.
const QK_K: u64 = 256;

/// A ggml tensor element type, as identified by the `u32` id in a GGUF tensor table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// 4-bit, blocks of 32, f16 scale.
    Q4_0,
    /// 4-bit, blocks of 32, f16 scale and minimum.
    Q4_1,
    /// 5-bit, blocks of 32, f16 scale.
    Q5_0,
    /// 5-bit, blocks of 32, f16 scale and minimum.
    Q5_1,
    /// 8-bit, blocks of 32, f16 scale.
    Q8_0,
    /// 8-bit, blocks of 32, f32 scale and sum (activation format).
    Q8_1,
    /// 2-bit k-quant, super-blocks of 256.
    Q2_K,
    /// 3-bit k-quant, super-blocks of 256.
    Q3_K,
    /// 4-bit k-quant, super-blocks of 256.
    Q4_K,
    /// 5-bit k-quant, super-blocks of 256.
    Q5_K,
    /// 6-bit k-quant, super-blocks of 256.
    Q6_K,
    /// 8-bit k-quant, super-blocks of 256 (activation format).
    Q8_K,
    /// 2.06-bit i-quant.
    IQ2_XXS,
    /// 2.31-bit i-quant.
    IQ2_XS,
    /// 3.06-bit i-quant.
    IQ3_XXS,
    /// 1.56-bit i-quant.
    IQ1_S,
    /// 4.5-bit non-linear quant, blocks of 32.
    IQ4_NL,
    /// 3.44-bit i-quant.
    IQ3_S,
    /// 2.5-bit i-quant.
    IQ2_S,
    /// 4.25-bit non-linear quant, super-blocks of 256.
    IQ4_XS,
    /// 8-bit signed integer.
    I8,
    /// 16-bit signed integer.
    I16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// 64-bit IEEE float.
    F64,
    /// 1.75-bit i-quant.
    IQ1_M,
    /// bfloat16.
    BF16,
    /// Ternary, 1.69 bits.
    TQ1_0,
    /// Ternary, 2.06 bits.
    TQ2_0,
    /// MXFP4 (OCP microscaling FP4), blocks of 32 with an E8M0 scale.
    MXFP4,
    /// NVFP4, blocks of 64 (four sub-blocks of 16 with E4M3 scales).
    NVFP4,
    /// 1-bit, blocks of 128 with an f16 scale.
    Q1_0,
}

impl GgmlType {
    /// Every known type, in id order.
    pub const ALL: [GgmlType; 34] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::IQ2_XXS,
        GgmlType::IQ2_XS,
        GgmlType::IQ3_XXS,
        GgmlType::IQ1_S,
        GgmlType::IQ4_NL,
        GgmlType::IQ3_S,
        GgmlType::IQ2_S,
        GgmlType::IQ4_XS,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::IQ1_M,
        GgmlType::BF16,
        GgmlType::TQ1_0,
        GgmlType::TQ2_0,
        GgmlType::MXFP4,
        GgmlType::NVFP4,
        GgmlType::Q1_0,
    ];

    /// The type with this GGUF id, or `None` for an unknown or removed id.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Self::ALL.iter().copied().find(|t| t.id() == id)
    }

    /// The id stored in GGUF files.
    pub fn id(self) -> u32 {
        self.traits().0
    }

    /// ggml's name for the type (`"q4_K"`, `"f16"`, ...).
    pub fn name(self) -> &'static str {
        self.traits().1
    }

    /// Elements per block (1 for plain scalar types).
    pub fn block_len(self) -> u64 {
        self.traits().2
    }

    /// Bytes per block.
    pub fn type_size(self) -> u64 {
        self.traits().3
    }

    /// Bytes of one row of `ne0` elements, or `None` when `ne0` is not a multiple of
    /// [`block_len`](Self::block_len) or the size overflows `u64`.
    pub fn row_bytes(self, ne0: u64) -> Option<u64> {
        if !ne0.is_multiple_of(self.block_len()) {
            return None;
        }
        (ne0 / self.block_len()).checked_mul(self.type_size())
    }

    /// Bytes of a tensor with these dimensions (`ne0` first, as in GGUF; an empty slice is a
    /// scalar): `ne0 / block_len * type_size * ne1 * ne2 * ...`. `None` when `ne0` is not a
    /// whole number of blocks, or the element count exceeds `i64::MAX` (ggml's limit), or
    /// the size overflows.
    pub fn tensor_bytes(self, dims: &[u64]) -> Option<u64> {
        let mut elements: u64 = 1;
        for &d in dims {
            elements = elements.checked_mul(d)?;
        }
        if elements > i64::MAX as u64 {
            return None;
        }
        let ne0 = dims.first().copied().unwrap_or(1);
        let mut bytes = self.row_bytes(ne0)?;
        for &d in dims.iter().skip(1) {
            bytes = bytes.checked_mul(d)?;
        }
        Some(bytes)
    }

    /// (id, name, block length, bytes per block).
    fn traits(self) -> (u32, &'static str, u64, u64) {
        use GgmlType::*;
        match self {
            F32 => (0, "f32", 1, 4),
            F16 => (1, "f16", 1, 2),
            Q4_0 => (2, "q4_0", 32, 2 + 16),
            Q4_1 => (3, "q4_1", 32, 2 + 2 + 16),
            Q5_0 => (6, "q5_0", 32, 2 + 4 + 16),
            Q5_1 => (7, "q5_1", 32, 2 + 2 + 4 + 16),
            Q8_0 => (8, "q8_0", 32, 2 + 32),
            Q8_1 => (9, "q8_1", 32, 4 + 4 + 32),
            Q2_K => (10, "q2_K", QK_K, 2 + 2 + QK_K / 16 + QK_K / 4),
            Q3_K => (11, "q3_K", QK_K, 2 + QK_K / 4 + QK_K / 8 + 12),
            Q4_K => (12, "q4_K", QK_K, 2 + 2 + QK_K / 2 + 12),
            Q5_K => (13, "q5_K", QK_K, 2 + 2 + QK_K / 2 + QK_K / 8 + 12),
            Q6_K => (14, "q6_K", QK_K, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16),
            Q8_K => (15, "q8_K", QK_K, 4 + QK_K + QK_K / 8),
            IQ2_XXS => (16, "iq2_xxs", QK_K, 2 + QK_K / 4),
            IQ2_XS => (17, "iq2_xs", QK_K, 2 + QK_K / 4 + QK_K / 32),
            IQ3_XXS => (18, "iq3_xxs", QK_K, 2 + QK_K / 4 + QK_K / 8),
            IQ1_S => (19, "iq1_s", QK_K, 2 + QK_K / 8 + QK_K / 16),
            IQ4_NL => (20, "iq4_nl", 32, 2 + 16),
            IQ3_S => (21, "iq3_s", QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4),
            IQ2_S => (22, "iq2_s", QK_K, 2 + QK_K / 4 + QK_K / 16),
            IQ4_XS => (23, "iq4_xs", QK_K, 2 + 2 + QK_K / 2 + QK_K / 64),
            I8 => (24, "i8", 1, 1),
            I16 => (25, "i16", 1, 2),
            I32 => (26, "i32", 1, 4),
            I64 => (27, "i64", 1, 8),
            F64 => (28, "f64", 1, 8),
            IQ1_M => (29, "iq1_m", QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32),
            BF16 => (30, "bf16", 1, 2),
            TQ1_0 => (34, "tq1_0", QK_K, 2 + 4 * 13),
            TQ2_0 => (35, "tq2_0", QK_K, 2 + 64),
            MXFP4 => (39, "mxfp4", 32, 1 + 16),
            NVFP4 => (40, "nvfp4", 64, 4 + 32),
            Q1_0 => (41, "q1_0", 128, 2 + 16),
        }
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_are_unique() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
        }
        let mut ids: Vec<u32> = GgmlType::ALL.iter().map(|t| t.id()).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), GgmlType::ALL.len());
    }

    #[test]
    fn removed_ids_are_unknown() {
        for id in [4, 5, 31, 32, 33, 36, 37, 38, 42, u32::MAX] {
            assert_eq!(GgmlType::from_id(id), None, "id {id}");
        }
    }

    #[test]
    fn block_sizes_match_ggml_type_traits() {
        // (type, block length, bytes per block) as in ggml.c's type_traits.
        let expected = [
            (GgmlType::Q4_0, 32, 18),
            (GgmlType::Q4_1, 32, 20),
            (GgmlType::Q5_0, 32, 22),
            (GgmlType::Q5_1, 32, 24),
            (GgmlType::Q8_0, 32, 34),
            (GgmlType::Q8_1, 32, 40),
            (GgmlType::Q2_K, 256, 84),
            (GgmlType::Q3_K, 256, 110),
            (GgmlType::Q4_K, 256, 144),
            (GgmlType::Q5_K, 256, 176),
            (GgmlType::Q6_K, 256, 210),
            (GgmlType::Q8_K, 256, 292),
            (GgmlType::IQ2_XXS, 256, 66),
            (GgmlType::IQ2_XS, 256, 74),
            (GgmlType::IQ3_XXS, 256, 98),
            (GgmlType::IQ1_S, 256, 50),
            (GgmlType::IQ4_NL, 32, 18),
            (GgmlType::IQ3_S, 256, 110),
            (GgmlType::IQ2_S, 256, 82),
            (GgmlType::IQ4_XS, 256, 136),
            (GgmlType::IQ1_M, 256, 56),
            (GgmlType::TQ1_0, 256, 54),
            (GgmlType::TQ2_0, 256, 66),
            (GgmlType::MXFP4, 32, 17),
            (GgmlType::NVFP4, 64, 36),
            (GgmlType::Q1_0, 128, 18),
        ];
        for (t, bl, ts) in expected {
            assert_eq!((t.block_len(), t.type_size()), (bl, ts), "{t}");
        }
    }

    #[test]
    fn row_bytes_requires_whole_blocks_and_does_not_overflow() {
        assert_eq!(GgmlType::Q4_K.row_bytes(512), Some(288));
        assert_eq!(GgmlType::Q4_K.row_bytes(100), None);
        assert_eq!(GgmlType::F32.row_bytes(u64::MAX), None);
        assert_eq!(GgmlType::F32.row_bytes(0), Some(0));
    }
}
