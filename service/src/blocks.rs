//! The generation's [`Piece`]s as a sequence of output blocks, for the APIs whose answers are lists of typed
//! blocks or items (the Responses API's `output` items, the Messages API's `content` blocks): a block is the
//! reasoning, an answer text or one tool call; it opens with its first piece, grows by deltas and closes when a
//! piece of another kind arrives or the turn ends. Streamed and non-streamed answers read the same
//! [`BlockEvent`]s, so both have the same blocks.
//!
//! Whitespace-only answer text (the newlines the model writes between its thinking and a tool call) opens no
//! block: it is held until text with something else in it arrives, and dropped if none does.
//!
//! Stop sequences: the engine stops at them (the text before the match is the answer); to say which one matched
//! (`stop_sequence` of the Messages API) the tracker reads the raw bytes of every token (the generation asks for
//! log-probabilities when there are stop sequences, and each token's entry carries its bytes) and looks for them.

use crate::generation::{Piece, StopMatcher};
use crate::openai::{FinishReason, Usage};

/// What a block holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockKind {
    /// The model's thinking.
    Reasoning,
    /// Answer text.
    Text,
    /// A tool call: the parser's id and the function name; its text is the arguments JSON.
    ToolCall {
        /// The call's id (`call_…`, or the prefix the handler set).
        id: String,
        /// The function the model called.
        name: String,
    },
}

/// A closed block: its kind and its whole text (reasoning, answer, or the arguments object as JSON).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// What it is.
    pub kind: BlockKind,
    /// Its text.
    pub text: String,
}

/// One step of the turn, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum BlockEvent {
    /// Block `index` (0, 1, … in the turn) opened.
    Start {
        /// Position of the block in the turn.
        index: usize,
        /// What it holds.
        kind: BlockKind,
    },
    /// More text of the open block.
    Delta {
        /// Position of the block.
        index: usize,
        /// The text to append.
        text: String,
    },
    /// Block `index` closed; `block` is all of it.
    Stop {
        /// Position of the block.
        index: usize,
        /// The whole block.
        block: Block,
    },
    /// The turn ended (after the last block closed).
    Done {
        /// Why.
        finish_reason: FinishReason,
        /// Token counts (cached prompt tokens included).
        usage: Usage,
        /// The stop sequence that ended the turn, if one did.
        stop_sequence: Option<String>,
    },
    /// Generation failed; the message says why. Nothing follows.
    Failed(String),
}

/// Turns one choice's pieces into block events (see the module docs).
#[derive(Debug, Default)]
pub struct BlockTracker {
    open: Option<(usize, Block)>,
    next_index: usize,
    held_space: String,
    stops: Vec<String>,
    raw: Vec<u8>,
}

impl BlockTracker {
    /// A tracker for a turn ended by any of `stops` (the engine stops; the tracker names the one that matched).
    pub fn new(stops: Vec<String>) -> Self {
        Self { stops, ..Self::default() }
    }

    /// The events of `piece`.
    pub fn push(&mut self, piece: Piece) -> Vec<BlockEvent> {
        let mut out = Vec::new();
        match piece {
            Piece::Progress => {}
            Piece::Logprob(lp) => {
                if !self.stops.is_empty() {
                    self.raw.extend(lp.bytes.unwrap_or_else(|| lp.token.into_bytes()));
                }
            }
            Piece::Reasoning(text) => self.append(BlockKind::Reasoning, text, &mut out),
            Piece::Content(text) => {
                let continuing = matches!(&self.open, Some((_, b)) if b.kind == BlockKind::Text);
                if !continuing && text.trim().is_empty() {
                    self.held_space.push_str(&text);
                } else {
                    let text = std::mem::take(&mut self.held_space) + &text;
                    self.append(BlockKind::Text, text, &mut out);
                }
            }
            Piece::ToolCallStart { id, name, .. } => {
                self.close(&mut out);
                self.open_block(BlockKind::ToolCall { id, name }, &mut out);
            }
            Piece::ToolCallArguments { fragment, .. } => {
                if let Some((index, block)) = &mut self.open
                    && matches!(block.kind, BlockKind::ToolCall { .. })
                {
                    block.text.push_str(&fragment);
                    out.push(BlockEvent::Delta { index: *index, text: fragment });
                }
            }
            Piece::ToolCall { id, name, arguments, .. } => {
                self.close(&mut out);
                self.open_block(BlockKind::ToolCall { id, name }, &mut out);
                self.append_open(arguments, &mut out);
                self.close(&mut out);
            }
            Piece::Done { finish_reason, usage, .. } => {
                self.close(&mut out);
                let stop_sequence = self.matched_stop(finish_reason);
                out.push(BlockEvent::Done { finish_reason, usage, stop_sequence });
            }
            Piece::Failed(message) => out.push(BlockEvent::Failed(message)),
        }
        out
    }

    /// The stop sequence in the raw output, when the turn ended by a stop.
    fn matched_stop(&self, finish_reason: FinishReason) -> Option<String> {
        if finish_reason != FinishReason::Stop || self.stops.is_empty() {
            return None;
        }
        let text = String::from_utf8_lossy(&self.raw);
        let mut matcher = StopMatcher::new(self.stops.clone());
        let (before, matched) = matcher.push(&text);
        if !matched {
            return None;
        }
        let rest = &text[before.len()..];
        self.stops.iter().filter(|s| rest.starts_with(s.as_str())).max_by_key(|s| s.len()).cloned()
    }

    fn append(&mut self, kind: BlockKind, text: String, out: &mut Vec<BlockEvent>) {
        if text.is_empty() {
            return;
        }
        if !matches!(&self.open, Some((_, b)) if b.kind == kind) {
            self.close(out);
            self.open_block(kind, out);
        }
        self.append_open(text, out);
    }

    fn append_open(&mut self, text: String, out: &mut Vec<BlockEvent>) {
        if let Some((index, block)) = &mut self.open
            && !text.is_empty()
        {
            block.text.push_str(&text);
            out.push(BlockEvent::Delta { index: *index, text });
        }
    }

    fn open_block(&mut self, kind: BlockKind, out: &mut Vec<BlockEvent>) {
        let index = self.next_index;
        self.next_index += 1;
        out.push(BlockEvent::Start { index, kind: kind.clone() });
        self.open = Some((index, Block { kind, text: String::new() }));
    }

    fn close(&mut self, out: &mut Vec<BlockEvent>) {
        if let Some((index, block)) = self.open.take() {
            out.push(BlockEvent::Stop { index, block });
        }
    }
}

/// Reads a whole turn (non-streamed answers): its blocks in order and how it ended. If the client goes away,
/// this future is dropped with `pieces`, which cancels the generation.
///
/// Errors: the generation failed (the message), or ended without a `Done`.
pub async fn collect_blocks(
    mut pieces: tokio::sync::mpsc::Receiver<(usize, Piece)>,
    stops: Vec<String>,
) -> Result<(Vec<Block>, FinishReason, Usage, Option<String>), String> {
    let mut tracker = BlockTracker::new(stops);
    let mut blocks = Vec::new();
    while let Some((_, piece)) = pieces.recv().await {
        for event in tracker.push(piece) {
            match event {
                BlockEvent::Stop { block, .. } => blocks.push(block),
                BlockEvent::Done { finish_reason, usage, stop_sequence } => {
                    return Ok((blocks, finish_reason, usage, stop_sequence));
                }
                BlockEvent::Failed(message) => return Err(message),
                BlockEvent::Start { .. } | BlockEvent::Delta { .. } => {}
            }
        }
    }
    Err("the generation ended unexpectedly".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::{Timings, TokenLogprob};

    fn done(reason: FinishReason) -> Piece {
        Piece::Done { finish_reason: reason, usage: Usage::new(5, 3), timings: Timings::default() }
    }

    fn run(stops: &[&str], pieces: Vec<Piece>) -> Vec<BlockEvent> {
        let mut t = BlockTracker::new(stops.iter().map(|s| s.to_string()).collect());
        pieces.into_iter().flat_map(|p| t.push(p)).collect()
    }

    #[test]
    fn pieces_become_blocks_in_order() {
        let events = run(
            &[],
            vec![
                Piece::Reasoning("Need ".into()),
                Piece::Reasoning("weather.".into()),
                Piece::Content("\n\n".into()),
                Piece::ToolCallStart { index: 0, id: "call_0".into(), name: "get_weather".into() },
                Piece::ToolCallArguments { index: 0, fragment: "{\"city\": \"Paris\"".into() },
                Piece::ToolCallArguments { index: 0, fragment: "}".into() },
                done(FinishReason::ToolCalls),
            ],
        );
        let stops: Vec<&Block> = events
            .iter()
            .filter_map(|e| if let BlockEvent::Stop { block, .. } = e { Some(block) } else { None })
            .collect();
        assert_eq!(stops.len(), 2, "{events:?}");
        assert_eq!(stops[0], &Block { kind: BlockKind::Reasoning, text: "Need weather.".into() });
        assert_eq!(stops[1].text, "{\"city\": \"Paris\"}");
        assert!(matches!(events[0], BlockEvent::Start { index: 0, kind: BlockKind::Reasoning }));
        assert!(matches!(events.last(), Some(BlockEvent::Done { finish_reason: FinishReason::ToolCalls, .. })));
    }

    #[test]
    fn held_whitespace_joins_the_text_that_follows() {
        let events = run(&[], vec![Piece::Content("\n".into()), Piece::Content("Hi".into()), done(FinishReason::Stop)]);
        assert!(
            events
                .contains(&BlockEvent::Stop { index: 0, block: Block { kind: BlockKind::Text, text: "\nHi".into() } })
        );
    }

    #[test]
    fn the_matched_stop_sequence_is_named() {
        let lp = |t: &str| {
            Piece::Logprob(TokenLogprob {
                token: t.into(),
                logprob: 0.0,
                bytes: Some(t.as_bytes().to_vec()),
                top_logprobs: vec![],
            })
        };
        let events = run(
            &["END", "xyz"],
            vec![lp("one "), Piece::Content("one ".into()), lp("EN"), lp("D"), done(FinishReason::Stop)],
        );
        assert!(matches!(events.last(), Some(BlockEvent::Done { stop_sequence: Some(s), .. }) if s == "END"));
        let events = run(&["END"], vec![lp("one"), Piece::Content("one".into()), done(FinishReason::Stop)]);
        assert!(matches!(events.last(), Some(BlockEvent::Done { stop_sequence: None, .. })));
    }
}
