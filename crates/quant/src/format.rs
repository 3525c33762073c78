//! The block formats: names, ggml type ids, block geometry and byte offsets of the fields
//! that the kernels read. Layouts follow ggml's `ggml-common.h` byte for byte.

use crate::QuantError;

/// Number of weights in one k-quant super-block.
pub const QK_K: usize = 256;
/// Number of weights in one legacy block (Q4_0 … Q8_0).
pub const QK_LEGACY: usize = 32;

/// A tensor element format, as ggml stores it.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// IEEE binary32, little-endian.
    F32,
    /// IEEE binary16, little-endian.
    F16,
    /// bfloat16 (upper half of a binary32), little-endian.
    BF16,
    /// 32 weights: f16 `d`, 16 bytes of 4-bit codes; `w = d·(q − 8)`.
    Q4_0,
    /// 32 weights: f16 `d`, f16 `m`, 16 bytes of 4-bit codes; `w = d·q + m`.
    Q4_1,
    /// 32 weights: f16 `d`, 32 high bits, 16 bytes of low nibbles; `w = d·(q − 16)`.
    Q5_0,
    /// 32 weights: f16 `d`, f16 `m`, 32 high bits, 16 bytes of low nibbles; `w = d·q + m`.
    Q5_1,
    /// 32 weights: f16 `d`, 32 signed bytes; `w = d·q`.
    Q8_0,
    /// 256 weights: 16 bytes of 4-bit scale/min pairs, 64 bytes of 2-bit codes, f16 `d`, f16 `dmin`.
    Q2_K,
    /// 256 weights: 32 bytes high-bit mask, 64 bytes of 2-bit codes, 12 bytes of 6-bit scales, f16 `d`.
    Q3_K,
    /// 256 weights: f16 `d`, f16 `dmin`, 12 bytes of packed 6-bit scales/mins, 128 bytes of nibbles.
    Q4_K,
    /// 256 weights: f16 `d`, f16 `dmin`, 12 bytes of scales/mins, 32 bytes of high bits, 128 bytes of nibbles.
    Q5_K,
    /// 256 weights: 128 bytes low nibbles, 64 bytes of high 2-bit pairs, 16 signed scales, f16 `d`.
    Q6_K,
    /// 256 weights: f16 `d`, then 8 groups of 32 as two u32 each: four 8-bit grid indices
    /// (`iq2xxs_grid`, 8 magnitudes each), then four 7-bit sign indices (`ksigns_iq2xs`)
    /// and a 4-bit scale `s` in the top bits; `w = d·(0.5 + s)·0.25·grid·sign`.
    IQ2_XXS,
    /// 32 weights: one E8M0 exponent byte `e`, 16 bytes of 4-bit E2M1 codes (low nibbles
    /// are weights 0..16, high nibbles 16..32); `w = kvalues_mxfp4[q]·2^(e−128)`.
    MXFP4,
}

/// How the activations that feed a weight format are represented.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActLayout {
    /// Float weights take the f32 activations unquantized.
    Float,
    /// Legacy formats and MXFP4: int8 codes in blocks of 32 with an f32 scale and a code sum.
    Blocks32,
    /// k-quants and IQ2_XXS: int8 codes in blocks of 256 with an f32 scale and code sums
    /// per 16 and per 32.
    Blocks256,
}

impl ActLayout {
    /// Elements per activation block (1 for [`ActLayout::Float`]).
    pub fn block_len(self) -> usize {
        match self {
            ActLayout::Float => 1,
            ActLayout::Blocks32 => QK_LEGACY,
            ActLayout::Blocks256 => QK_K,
        }
    }
}

impl Format {
    /// Every supported format, in ggml type-id order.
    pub const ALL: [Format; 15] = [
        Format::F32,
        Format::F16,
        Format::Q4_0,
        Format::Q4_1,
        Format::Q5_0,
        Format::Q5_1,
        Format::Q8_0,
        Format::Q2_K,
        Format::Q3_K,
        Format::Q4_K,
        Format::Q5_K,
        Format::Q6_K,
        Format::IQ2_XXS,
        Format::BF16,
        Format::MXFP4,
    ];

    /// The `ggml_type` enum value of this format (as stored in GGUF tensor tables).
    pub fn ggml_type_id(self) -> u32 {
        match self {
            Format::F32 => 0,
            Format::F16 => 1,
            Format::Q4_0 => 2,
            Format::Q4_1 => 3,
            Format::Q5_0 => 6,
            Format::Q5_1 => 7,
            Format::Q8_0 => 8,
            Format::Q2_K => 10,
            Format::Q3_K => 11,
            Format::Q4_K => 12,
            Format::Q5_K => 13,
            Format::Q6_K => 14,
            Format::IQ2_XXS => 16,
            Format::BF16 => 30,
            Format::MXFP4 => 39,
        }
    }

    /// The format with this `ggml_type` id, if this crate supports it.
    pub fn from_ggml_type_id(id: u32) -> Option<Format> {
        Format::ALL.into_iter().find(|f| f.ggml_type_id() == id)
    }

    /// ggml's name for the format ("q4_K", "f16", …).
    pub fn name(self) -> &'static str {
        match self {
            Format::F32 => "f32",
            Format::F16 => "f16",
            Format::BF16 => "bf16",
            Format::Q4_0 => "q4_0",
            Format::Q4_1 => "q4_1",
            Format::Q5_0 => "q5_0",
            Format::Q5_1 => "q5_1",
            Format::Q8_0 => "q8_0",
            Format::Q2_K => "q2_K",
            Format::Q3_K => "q3_K",
            Format::Q4_K => "q4_K",
            Format::Q5_K => "q5_K",
            Format::Q6_K => "q6_K",
            Format::IQ2_XXS => "iq2_xxs",
            Format::MXFP4 => "mxfp4",
        }
    }

    /// Weights per block (1 for float formats).
    pub fn block_len(self) -> usize {
        match self {
            Format::F32 | Format::F16 | Format::BF16 => 1,
            Format::Q4_0
            | Format::Q4_1
            | Format::Q5_0
            | Format::Q5_1
            | Format::Q8_0
            | Format::MXFP4 => QK_LEGACY,
            Format::Q2_K
            | Format::Q3_K
            | Format::Q4_K
            | Format::Q5_K
            | Format::Q6_K
            | Format::IQ2_XXS => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Format::F32 => 4,
            Format::F16 | Format::BF16 => 2,
            Format::Q4_0 => 18,
            Format::Q4_1 => 20,
            Format::Q5_0 => 22,
            Format::Q5_1 => 24,
            Format::Q8_0 => 34,
            Format::Q2_K => 84,
            Format::Q3_K => 110,
            Format::Q4_K => 144,
            Format::Q5_K => 176,
            Format::Q6_K => 210,
            Format::IQ2_XXS => 66,
            Format::MXFP4 => 17,
        }
    }

    /// True for F32, F16 and BF16.
    pub fn is_float(self) -> bool {
        matches!(self, Format::F32 | Format::F16 | Format::BF16)
    }

    /// The activation representation that this weight format consumes.
    pub fn act_layout(self) -> ActLayout {
        match self.block_len() {
            1 => ActLayout::Float,
            QK_LEGACY => ActLayout::Blocks32,
            _ => ActLayout::Blocks256,
        }
    }

    /// Bytes of one row of `k` weights; an error unless `k` is a multiple of the block length.
    pub fn row_bytes(self, k: usize) -> Result<usize, QuantError> {
        let bl = self.block_len();
        if !k.is_multiple_of(bl) {
            return Err(QuantError::RaggedRow {
                format: self,
                k,
                block_len: bl,
            });
        }
        (k / bl)
            .checked_mul(self.block_bytes())
            .ok_or(QuantError::TooLarge)
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
