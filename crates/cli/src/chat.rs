//! `lockstep chat`: a multi-turn conversation on stdin/stdout.
//!
//! Each line read is a user message; the whole history is re-rendered through the chat
//! template every turn (the engine's prefix cache reuses the KV of the unchanged start), and
//! the reply is streamed; with the prompt cache on disk (`--disk-cache`, on by default as
//! for `run`) a conversation's start is also read back in a later process. `/reset` clears
//! the history, `/exit` or end of input (Ctrl-D)
//! ends. When stdin is not a terminal no prompts or banners are printed, so the command
//! can be scripted and tested.

use std::io::{BufRead, IsTerminal, Write};

use clap::Args;

use crate::args::{ModelArgs, SamplingArgs, StopArgs};
use crate::session::{self, Session};
use crate::spec_args::SpecReport;

/// Arguments of `lockstep chat`.
#[derive(Debug, Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    stop: StopArgs,
    #[command(flatten)]
    disk_cache: crate::disk_cache_args::DiskCacheArgs,
    #[command(flatten)]
    spec: crate::spec_args::SpecArgs,

    /// A system message at the start of the conversation (kept by /reset)
    #[arg(long, value_name = "TEXT")]
    system: Option<String>,

    /// Print timing and token counts on stderr after each reply
    #[arg(long)]
    verbose: bool,
}

/// What a line of input asks for.
#[derive(Debug, PartialEq, Eq)]
enum Input<'a> {
    /// Nothing (an empty line).
    Empty,
    /// `/exit` or `/quit`.
    Exit,
    /// `/reset`: forget the conversation.
    Reset,
    /// `/help`.
    Help,
    /// An unknown `/command`.
    Unknown(&'a str),
    /// A user message.
    Message(&'a str),
}

fn parse_line(line: &str) -> Input<'_> {
    let trimmed = line.trim_end_matches(['\n', '\r']);
    match trimmed.trim() {
        "" => Input::Empty,
        "/exit" | "/quit" | "/bye" => Input::Exit,
        "/reset" | "/clear" => Input::Reset,
        "/help" | "/?" => Input::Help,
        cmd if cmd.starts_with('/') && !cmd.contains(char::is_whitespace) && cmd.len() > 1 => {
            Input::Unknown(cmd)
        }
        _ => Input::Message(trimmed),
    }
}

const HELP: &str = "commands: /reset clears the conversation, /exit (or Ctrl-D) ends";

/// Runs `lockstep chat`, reading lines from `input`.
pub fn run(args: &ChatArgs, input: &mut dyn BufRead, out: &mut dyn Write) -> anyhow::Result<()> {
    let session = Session::open_with(&args.model, true, Some(&args.spec), Some(&args.disk_cache))?;
    let interactive = std::io::stdin().is_terminal() && std::io::stdout().is_terminal();
    let seed = args.sampling.seed_or_random();
    let system: Vec<chat::Message> = args
        .system
        .iter()
        .map(|s| chat::Message::new("system", s.as_str()))
        .collect();
    let mut history = system.clone();
    if interactive {
        eprintln!("chatting with {} (seed {seed}); {HELP}", session.name);
    }
    let mut line = String::new();
    loop {
        if interactive {
            write!(out, "> ")?;
            out.flush()?;
        }
        line.clear();
        if input.read_line(&mut line)? == 0 {
            if interactive {
                writeln!(out)?;
            }
            break;
        }
        match parse_line(&line) {
            Input::Empty => continue,
            Input::Exit => break,
            Input::Help => eprintln!("{HELP}"),
            Input::Unknown(cmd) => eprintln!("unknown command {cmd}; {HELP}"),
            Input::Reset => {
                history = system.clone();
                eprintln!("(conversation cleared)");
            }
            Input::Message(text) => {
                history.push(chat::Message::new("user", text));
                match reply(&session, &history, args, seed, out) {
                    Ok(generation) => {
                        if args.verbose {
                            eprintln!("{}", generation.summary(seed));
                        }
                        if args.spec.stats {
                            match &generation.spec {
                                Some(s) => eprintln!("{}", SpecReport::of(s).line()),
                                None => eprintln!("spec: off"),
                            }
                        }
                        history.push(chat::Message::new("assistant", generation.text));
                    }
                    Err(e) => {
                        // Keep the conversation usable: forget the message that failed.
                        history.pop();
                        eprintln!("error: {e:#} (/reset starts a new conversation)");
                    }
                }
            }
        }
    }
    out.flush()?;
    Ok(())
}

/// Generates and streams the assistant's reply to `history`.
fn reply(
    session: &Session,
    history: &[chat::Message],
    args: &ChatArgs,
    seed: u64,
    out: &mut dyn Write,
) -> anyhow::Result<session::Generation> {
    let prompt = session.chat_tokens(history)?;
    let req = session::request(prompt, &args.sampling, &args.stop, seed)?;
    let generation = session.generate(req, |ev| {
        if !ev.text.is_empty() {
            out.write_all(ev.text.as_bytes())?;
            out.flush()?;
        }
        Ok(())
    })?;
    writeln!(out, "{}", generation.tail)?;
    out.flush()?;
    Ok(generation)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_commands_or_messages() {
        assert_eq!(parse_line("\n"), Input::Empty);
        assert_eq!(parse_line("  /exit \n"), Input::Exit);
        assert_eq!(parse_line("/reset\r\n"), Input::Reset);
        assert_eq!(parse_line("/frobnicate\n"), Input::Unknown("/frobnicate"));
        assert_eq!(parse_line("hello there\n"), Input::Message("hello there"));
        assert_eq!(
            parse_line("/path/to file please\n"),
            Input::Message("/path/to file please")
        );
    }
}
