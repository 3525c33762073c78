//! Metadata values: the thirteen GGUF value types, with arrays stored as typed vectors so
//! that large tokenizer tables (hundreds of thousands of strings, scores, token types) stay
//! compact.

use std::fmt;

/// The type tag of a GGUF metadata value, as stored in the file (`u32`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ValueType {
    /// Tag 0.
    U8,
    /// Tag 1.
    I8,
    /// Tag 2.
    U16,
    /// Tag 3.
    I16,
    /// Tag 4.
    U32,
    /// Tag 5.
    I32,
    /// Tag 6.
    F32,
    /// Tag 7.
    Bool,
    /// Tag 8.
    String,
    /// Tag 9.
    Array,
    /// Tag 10.
    U64,
    /// Tag 11.
    I64,
    /// Tag 12.
    F64,
}

impl ValueType {
    /// The type with this tag, or `None` for an unknown tag.
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The tag stored in the file.
    pub fn id(self) -> u32 {
        use ValueType::*;
        match self {
            U8 => 0,
            I8 => 1,
            U16 => 2,
            I16 => 3,
            U32 => 4,
            I32 => 5,
            F32 => 6,
            Bool => 7,
            String => 8,
            Array => 9,
            U64 => 10,
            I64 => 11,
            F64 => 12,
        }
    }

    /// A short lower-case name (`"u32"`, `"string"`, `"array"`).
    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }

    /// Encoded size of one value of this type, for the fixed-size types.
    pub fn fixed_size(self) -> Option<u64> {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }

    /// The fewest bytes one encoded value of this type can take (a string is at least its
    /// 8-byte length, an array its 4-byte element type and 8-byte count).
    pub fn min_encoded_size(self) -> u64 {
        match self {
            ValueType::String => 8,
            ValueType::Array => 12,
            fixed => fixed.fixed_size().unwrap_or(1),
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `u8`.
    U8(u8),
    /// `i8`.
    I8(i8),
    /// `u16`.
    U16(u16),
    /// `i16`.
    I16(i16),
    /// `u32`.
    U32(u32),
    /// `i32`.
    I32(i32),
    /// `f32`.
    F32(f32),
    /// `bool`.
    Bool(bool),
    /// A UTF-8 string.
    String(String),
    /// A typed array (possibly of arrays).
    Array(Array),
    /// `u64`.
    U64(u64),
    /// `i64`.
    I64(i64),
    /// `f64`.
    F64(f64),
}

impl Value {
    /// The value's type tag.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// A type description for messages: `"u32"`, or `"array of string"`.
    pub fn type_description(&self) -> String {
        match self {
            Value::Array(a) => format!("array of {}", a.element_type()),
            v => v.value_type().name().to_string(),
        }
    }

    /// The string, if this is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// Any integer value as `i128` (every GGUF integer type fits).
    fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// Whether this is one of the eight integer types.
    pub fn is_integer(&self) -> bool {
        self.as_i128().is_some()
    }

    /// Any integer value that fits in `u64`.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_i128().and_then(|v| u64::try_from(v).ok())
    }

    /// Any integer value that fits in `u32`.
    pub fn as_u32(&self) -> Option<u32> {
        self.as_i128().and_then(|v| u32::try_from(v).ok())
    }

    /// Any integer value that fits in `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_i128().and_then(|v| i64::try_from(v).ok())
    }

    /// An `f32` value (an `f64` is narrowed).
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    /// An `f32` or `f64` value as `f64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    /// The boolean, if this is a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The array, if this is an array.
    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// A metadata array: all elements share one type, stored as a typed vector.
#[derive(Debug, Clone, PartialEq)]
pub enum Array {
    /// `u8` elements.
    U8(Vec<u8>),
    /// `i8` elements.
    I8(Vec<i8>),
    /// `u16` elements.
    U16(Vec<u16>),
    /// `i16` elements.
    I16(Vec<i16>),
    /// `u32` elements.
    U32(Vec<u32>),
    /// `i32` elements.
    I32(Vec<i32>),
    /// `f32` elements.
    F32(Vec<f32>),
    /// `bool` elements.
    Bool(Vec<bool>),
    /// String elements.
    String(Vec<String>),
    /// Nested arrays (each may have its own element type).
    Array(Vec<Array>),
    /// `u64` elements.
    U64(Vec<u64>),
    /// `i64` elements.
    I64(Vec<i64>),
    /// `f64` elements.
    F64(Vec<f64>),
}

macro_rules! slice_accessor {
    ($(#[$doc:meta] $name:ident, $variant:ident, $ty:ty;)*) => {
        $(
            #[$doc]
            pub fn $name(&self) -> Option<&[$ty]> {
                match self {
                    Array::$variant(v) => Some(v),
                    _ => None,
                }
            }
        )*
    };
}

impl Array {
    /// The element type tag.
    pub fn element_type(&self) -> ValueType {
        match self {
            Array::U8(_) => ValueType::U8,
            Array::I8(_) => ValueType::I8,
            Array::U16(_) => ValueType::U16,
            Array::I16(_) => ValueType::I16,
            Array::U32(_) => ValueType::U32,
            Array::I32(_) => ValueType::I32,
            Array::F32(_) => ValueType::F32,
            Array::Bool(_) => ValueType::Bool,
            Array::String(_) => ValueType::String,
            Array::Array(_) => ValueType::Array,
            Array::U64(_) => ValueType::U64,
            Array::I64(_) => ValueType::I64,
            Array::F64(_) => ValueType::F64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` as a [`Value`] (cloned), or `None` past the end.
    pub fn get(&self, i: usize) -> Option<Value> {
        Some(match self {
            Array::U8(v) => Value::U8(*v.get(i)?),
            Array::I8(v) => Value::I8(*v.get(i)?),
            Array::U16(v) => Value::U16(*v.get(i)?),
            Array::I16(v) => Value::I16(*v.get(i)?),
            Array::U32(v) => Value::U32(*v.get(i)?),
            Array::I32(v) => Value::I32(*v.get(i)?),
            Array::F32(v) => Value::F32(*v.get(i)?),
            Array::Bool(v) => Value::Bool(*v.get(i)?),
            Array::String(v) => Value::String(v.get(i)?.clone()),
            Array::Array(v) => Value::Array(v.get(i)?.clone()),
            Array::U64(v) => Value::U64(*v.get(i)?),
            Array::I64(v) => Value::I64(*v.get(i)?),
            Array::F64(v) => Value::F64(*v.get(i)?),
        })
    }

    slice_accessor! {
        /// The elements, if they are `u8`.
        as_u8s, U8, u8;
        /// The elements, if they are `i8`.
        as_i8s, I8, i8;
        /// The elements, if they are `u16`.
        as_u16s, U16, u16;
        /// The elements, if they are `i16`.
        as_i16s, I16, i16;
        /// The elements, if they are `u32`.
        as_u32s, U32, u32;
        /// The elements, if they are `i32`.
        as_i32s, I32, i32;
        /// The elements, if they are `f32`.
        as_f32s, F32, f32;
        /// The elements, if they are `bool`.
        as_bools, Bool, bool;
        /// The elements, if they are strings.
        as_strings, String, String;
        /// The elements, if they are arrays.
        as_arrays, Array, Array;
        /// The elements, if they are `u64`.
        as_u64s, U64, u64;
        /// The elements, if they are `i64`.
        as_i64s, I64, i64;
        /// The elements, if they are `f64`.
        as_f64s, F64, f64;
    }

    /// Integer elements of any integer type as `i64`, or `None` for non-integer elements
    /// or a `u64` element above `i64::MAX`.
    pub fn to_i64s(&self) -> Option<Vec<i64>> {
        fn conv<T: Copy>(v: &[T], f: impl Fn(T) -> Option<i64>) -> Option<Vec<i64>> {
            v.iter().map(|&x| f(x)).collect()
        }
        match self {
            Array::U8(v) => conv(v, |x| Some(x.into())),
            Array::I8(v) => conv(v, |x| Some(x.into())),
            Array::U16(v) => conv(v, |x| Some(x.into())),
            Array::I16(v) => conv(v, |x| Some(x.into())),
            Array::U32(v) => conv(v, |x| Some(x.into())),
            Array::I32(v) => conv(v, |x| Some(x.into())),
            Array::U64(v) => conv(v, |x| i64::try_from(x).ok()),
            Array::I64(v) => Some(v.clone()),
            _ => None,
        }
    }
}

impl fmt::Display for Value {
    /// Scalars print plainly, strings quoted (escaped), arrays as their summary.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::U8(v) => write!(f, "{v}"),
            Value::I8(v) => write!(f, "{v}"),
            Value::U16(v) => write!(f, "{v}"),
            Value::I16(v) => write!(f, "{v}"),
            Value::U32(v) => write!(f, "{v}"),
            Value::I32(v) => write!(f, "{v}"),
            Value::F32(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::String(s) => write!(f, "{s:?}"),
            Value::Array(a) => write!(f, "{a}"),
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
        }
    }
}

impl fmt::Display for Array {
    /// `[string; 49152] ["<|endoftext|>", "<|im_start|>", ...]`: type, length and the
    /// first few elements.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 5;
        write!(f, "[{}; {}] [", self.element_type(), self.len())?;
        for i in 0..self.len().min(SHOWN) {
            if i > 0 {
                f.write_str(", ")?;
            }
            match self.get(i) {
                Some(v) => write!(f, "{v}")?,
                None => break,
            }
        }
        if self.len() > SHOWN {
            f.write_str(", ...")?;
        }
        f.write_str("]")
    }
}

macro_rules! from_scalar {
    ($($ty:ty => $variant:ident),* $(,)?) => {
        $(
            impl From<$ty> for Value {
                fn from(v: $ty) -> Value {
                    Value::$variant(v)
                }
            }
            impl From<Vec<$ty>> for Array {
                fn from(v: Vec<$ty>) -> Array {
                    Array::$variant(v)
                }
            }
            impl From<Vec<$ty>> for Value {
                fn from(v: Vec<$ty>) -> Value {
                    Value::Array(Array::$variant(v))
                }
            }
        )*
    };
}

from_scalar! {
    u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32,
    bool => Bool, String => String, u64 => U64, i64 => I64, f64 => F64,
}

impl From<&str> for Value {
    fn from(v: &str) -> Value {
        Value::String(v.to_string())
    }
}

impl From<Array> for Value {
    fn from(v: Array) -> Value {
        Value::Array(v)
    }
}

impl From<Vec<&str>> for Value {
    fn from(v: Vec<&str>) -> Value {
        Value::Array(Array::String(v.into_iter().map(str::to_string).collect()))
    }
}

impl From<Vec<Array>> for Array {
    fn from(v: Vec<Array>) -> Array {
        Array::Array(v)
    }
}
