//! Character classes the pre-tokenizers use, and GPT-2's byte-to-unicode mapping.
//!
//! The classes follow llama.cpp's `unicode_cpt_flags`: `\p{L}` and `\p{N}` are the Unicode
//! general categories L* and N*, and whitespace is the fixed `White_Space` set below (ASCII
//! 0x1C–0x1F are *not* whitespace). The general categories come from the
//! `unicode-general-category` tables; llama.cpp's table may be of an older Unicode version,
//! which can only differ on code points assigned since.

use unicode_general_category::{GeneralCategory, get_general_category};

/// `\p{L}`.
pub(crate) const LETTER: u8 = 1;
/// `\p{N}`.
pub(crate) const NUMBER: u8 = 2;
/// `\s`.
pub(crate) const WHITESPACE: u8 = 4;

/// Classes of the 128 ASCII characters, computed at compile time.
const ASCII_CLASSES: [u8; 128] = {
    let mut t = [0u8; 128];
    let mut i = 0;
    while i < 128 {
        let c = i as u8;
        t[i] = if c.is_ascii_alphabetic() {
            LETTER
        } else if c.is_ascii_digit() {
            NUMBER
        } else if matches!(c, 0x09..=0x0D | 0x20) {
            WHITESPACE
        } else {
            0
        };
        i += 1;
    }
    t
};

/// The non-ASCII members of the whitespace set (Unicode `White_Space`).
fn is_non_ascii_whitespace(c: char) -> bool {
    matches!(
        c,
        '\u{85}' | '\u{A0}' | '\u{1680}' | '\u{2000}'
            ..='\u{200A}' | '\u{2028}' | '\u{2029}' | '\u{202F}' | '\u{205F}' | '\u{3000}'
    )
}

/// The class bits of a character: at most one of [`LETTER`], [`NUMBER`], [`WHITESPACE`].
pub(crate) fn class_of(c: char) -> u8 {
    if c.is_ascii() {
        return ASCII_CLASSES[c as usize];
    }
    if is_non_ascii_whitespace(c) {
        return WHITESPACE;
    }
    use GeneralCategory as G;
    match get_general_category(c) {
        G::UppercaseLetter
        | G::LowercaseLetter
        | G::TitlecaseLetter
        | G::ModifierLetter
        | G::OtherLetter => LETTER,
        G::DecimalNumber | G::LetterNumber | G::OtherNumber => NUMBER,
        _ => 0,
    }
}

/// Whether a printable byte maps to itself in GPT-2's byte-to-unicode table.
const fn byte_is_printable(b: u8) -> bool {
    matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// GPT-2's byte-to-unicode table: printable bytes map to the same code point, the other 68
/// bytes to U+0100.. in byte order.
pub(crate) const BYTE_TO_CHAR: [char; 256] = {
    let mut t = ['\0'; 256];
    let mut n = 0u32;
    let mut b = 0usize;
    while b < 256 {
        let cp = if byte_is_printable(b as u8) {
            b as u32
        } else {
            n += 1;
            256 + n - 1
        };
        t[b] = match char::from_u32(cp) {
            Some(c) => c,
            None => '\0',
        };
        b += 1;
    }
    t
};

/// The non-printable bytes in order: `HIGH_TO_BYTE[k]` is the byte mapped to U+0100 + k.
const HIGH_TO_BYTE: [u8; 68] = {
    let mut t = [0u8; 68];
    let mut k = 0;
    let mut b = 0usize;
    while b < 256 {
        if !byte_is_printable(b as u8) {
            t[k] = b as u8;
            k += 1;
        }
        b += 1;
    }
    t
};

/// The byte a GPT-2 byte-level character stands for, if it is one of the 256.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    let cp = c as u32;
    if cp < 256 {
        let b = cp as u8;
        return byte_is_printable(b).then_some(b);
    }
    HIGH_TO_BYTE.get((cp - 256) as usize).copied()
}

/// Appends the GPT-2 byte-level encoding of `bytes` to `out`.
pub(crate) fn byte_encode_into(bytes: &[u8], out: &mut String) {
    for &b in bytes {
        out.push(BYTE_TO_CHAR[b as usize]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_a_bijection_onto_256_chars() {
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            let c = BYTE_TO_CHAR[b as usize];
            assert!(seen.insert(c), "duplicate char for byte {b}");
            assert_eq!(char_to_byte(c), Some(b));
        }
        assert_eq!(BYTE_TO_CHAR[b' ' as usize], 'Ġ');
        assert_eq!(BYTE_TO_CHAR[b'\n' as usize], 'Ċ');
        assert_eq!(char_to_byte('a'), Some(b'a'));
        assert_eq!(char_to_byte('\u{144}'), None);
        assert_eq!(char_to_byte(' '), None);
    }

    #[test]
    fn classes_follow_general_categories_and_the_whitespace_set() {
        assert_eq!(class_of('a'), LETTER);
        assert_eq!(class_of('é'), LETTER);
        assert_eq!(class_of('中'), LETTER);
        assert_eq!(class_of('7'), NUMBER);
        assert_eq!(class_of('²'), NUMBER);
        assert_eq!(class_of('①'), NUMBER);
        assert_eq!(class_of(' '), WHITESPACE);
        assert_eq!(class_of('\u{3000}'), WHITESPACE);
        assert_eq!(class_of('\u{85}'), WHITESPACE);
        assert_eq!(class_of('\u{1C}'), 0);
        assert_eq!(class_of('\u{200B}'), 0);
        assert_eq!(class_of('\u{301}'), 0); // combining acute: a mark, not a letter
        assert_eq!(class_of('!'), 0);
        assert_eq!(class_of('😀'), 0);
    }
}
