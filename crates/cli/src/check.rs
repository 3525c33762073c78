//! `lockstep check`: the logit fingerprint of a generation, for comparing two runs with
//! `diff` (other thread counts, speculation on and off, another build or machine).
//!
//! One line `POS SHA256` per generated position — the absolute position and the hex SHA-256
//! of the full-vocabulary f32 logits (little-endian bytes) that chose its token — then one
//! line `digest SHA256` over all the lines before it (their bytes, newlines included).

use std::fmt::Write as _;
use std::io::Write;

use clap::Args;
use sha2::{Digest, Sha256};

use crate::args::{ModelArgs, SamplingArgs, StopArgs};
use crate::constraint_args::ConstraintArgs;
use crate::session::{self, PromptArgs, Session};

/// Arguments of `lockstep check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    prompt: PromptArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    stop: StopArgs,
    #[command(flatten)]
    constraint: ConstraintArgs,
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// The `POS SHA256` line of one position.
pub fn position_line(position: usize, digest: &[u8; 32]) -> String {
    format!("{position} {}\n", hex(digest))
}

/// The final line: `digest` and the SHA-256 of every line before it.
pub fn final_line(lines: &str) -> String {
    format!("digest {}\n", hex(&Sha256::digest(lines.as_bytes())))
}

/// Runs `lockstep check`.
pub fn run(args: &CheckArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let requested = args.constraint.prepare()?;
    let session = Session::open(&args.model, args.prompt.chat)?;
    let prompt = session.prompt_tokens(&args.prompt)?;
    let grammar = match &requested {
        Some(r) => Some(r.compile(&session, args.prompt.chat, &prompt)?),
        None => None,
    };
    let seed = args.sampling.seed_or_random();
    let mut req = session::request(prompt, &args.sampling, &args.stop, seed)?;
    req.constraint = grammar.as_ref().map(|g| g.request_constraint());
    req.logit_digests = true;
    let mut lines = String::new();
    let generation = session.generate(req, |ev| {
        let Some(digest) = &ev.logit_sha256 else {
            anyhow::bail!(
                "the engine sent no logit digest for position {}",
                ev.position
            );
        };
        let line = position_line(ev.position, digest);
        out.write_all(line.as_bytes())?;
        out.flush()?;
        lines.push_str(&line);
        Ok(())
    })?;
    out.write_all(final_line(&lines).as_bytes())?;
    out.flush()?;
    eprintln!("{}", generation.summary(seed));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_position_and_lowercase_hex() {
        let mut d = [0u8; 32];
        d[0] = 0xAB;
        d[31] = 0x01;
        let line = position_line(5, &d);
        assert_eq!(line.len(), 2 + 64 + 1);
        assert!(line.starts_with("5 ab00"));
        assert!(line.ends_with("01\n"));
    }

    #[test]
    fn final_digest_covers_every_line() {
        let a = final_line("5 00\n6 11\n");
        let b = final_line("5 00\n6 12\n");
        assert_ne!(a, b);
        // SHA-256 of the empty string.
        assert_eq!(
            final_line(""),
            "digest e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855\n"
        );
    }
}
