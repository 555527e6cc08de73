//! SentencePiece vocabularies (GGUF `tokenizer.ggml.model = "llama"`: Llama 2, Mistral, Gemma,
//! Phi-3), encoded and decoded as llama.cpp does.
//!
//! Encoding: special-token text is cut out of the input first (longest token first, each
//! token's occurrences left to right); every stretch of plain text between them gets a leading
//! space when `add_space_prefix` is set and it starts the input or follows a special token, has
//! its spaces written as `▁` (U+2581), and is split into UTF-8 characters. Then, repeatedly, the
//! adjacent pair whose concatenation is a vocabulary token with the highest score is merged
//! (equal scores: the leftmost pair). Pieces left that are not tokens become one `<0xHH>` byte
//! token per byte.
//!
//! Decoding: normal tokens with `▁` as a space, byte tokens as their byte, control, unknown and
//! user-defined tokens as their text (control and unknown ones only when special tokens are
//! shown), unused and undefined ones as nothing. When `add_space_prefix` is set, one leading
//! space of the first token is dropped, except after a BOS that `skip_special_tokens` removed.
//!
//! Invariants:
//! - Encoding and decoding give llama.cpp's ids and text (`llama_tokenize` with special-token
//!   parsing, `llama_detokenize`), including for text that needs byte fallback.
//! - Time is O(n log n) in the input length: a priority queue of candidate pairs and hash
//!   look-ups; special tokens are found with a trie, not by scanning the vocabulary.
//! - A vocabulary with duplicate token texts, a byte token not spelt `<0xHH>`, or fewer scores
//!   or types than tokens is refused when built, never half-used.
//!
//! Not reproduced: llama.cpp orders special tokens of equal length in an unspecified way (here:
//! by id), which matters only when two of them overlap in the text; its fill-in-the-middle token
//! ids from metadata keys (here only their usual texts end generation); and its rules for
//! byte-level vocabularies (gpt-oss, Gemma 4) that no SentencePiece file triggers.

use std::collections::{BTreeMap, BinaryHeap, HashMap};

/// llama.cpp's token attributes (bit flags).
mod attr {
    pub const UNKNOWN: u16 = 1 << 0;
    pub const UNUSED: u16 = 1 << 1;
    pub const NORMAL: u16 = 1 << 2;
    pub const CONTROL: u16 = 1 << 3;
    pub const USER_DEFINED: u16 = 1 << 4;
    pub const BYTE: u16 = 1 << 5;
    pub const LSTRIP: u16 = 1 << 7;
    pub const RSTRIP: u16 = 1 << 8;
}

/// Token texts that end generation, as llama.cpp recognises them when the file does not say.
const END_OF_GENERATION: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    // Fill-in-the-middle padding, repository and file separators also end generation.
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<|file_sep|>",
];

/// Other token texts llama.cpp treats as control tokens whatever the file's type says.
const CONTROL_BY_TEXT: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<PRE>",
    "▁<PRE>",
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<SUF>",
    "▁<SUF>",
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<MID>",
    "▁<MID>",
];

/// What a SentencePiece vocabulary is built from: the `tokenizer.*` metadata, read out.
pub(super) struct SpmSpec {
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores`; empty: every score 0.
    pub scores: Vec<f32>,
    /// `tokenizer.ggml.token_type` (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
    /// 6 byte); empty: every token normal.
    pub token_types: Vec<i32>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub unk_id: Option<u32>,
    /// Further ids the file says end generation (`eot_token_id`, `eom_token_id`).
    pub extra_eog_ids: Vec<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
    /// `general.name`: llama.cpp strips whitespace after Phi-3's special tokens, by name.
    pub model_name: Option<String>,
}

/// A SentencePiece vocabulary ready to encode and decode.
pub(super) struct Spm {
    text: Vec<Box<str>>,
    score: Vec<f32>,
    attr: Vec<u16>,
    ids: HashMap<Box<str>, u32>,
    /// The token of each byte value, `<0xHH>` (256 entries).
    byte_ids: Vec<Option<u32>>,
    specials: SpecialTrie,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    unk_id: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    eog_ids: Vec<u32>,
}

impl std::fmt::Debug for Spm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spm")
            .field("vocab_size", &self.text.len())
            .field("bos_id", &self.bos_id)
            .field("eos_id", &self.eos_id)
            .field("add_space_prefix", &self.add_space_prefix)
            .finish()
    }
}

impl Spm {
    /// Checks and indexes a vocabulary. Errors are messages for the caller to attach the file to.
    pub(super) fn new(spec: SpmSpec) -> Result<Spm, String> {
        let n = spec.tokens.len();
        if n == 0 {
            return Err("tokenizer.ggml.tokens is empty".into());
        }
        if u32::try_from(n).is_err() {
            return Err(format!("{n} tokens do not fit 32-bit ids"));
        }
        if !spec.scores.is_empty() && spec.scores.len() < n {
            return Err(format!("{} scores for {n} tokens", spec.scores.len()));
        }
        if !spec.token_types.is_empty() && spec.token_types.len() < n {
            return Err(format!("{} token types for {n} tokens", spec.token_types.len()));
        }
        for (name, id) in [("bos", spec.bos_id), ("eos", spec.eos_id), ("unknown", spec.unk_id)] {
            if let Some(id) = id {
                if id as usize >= n {
                    return Err(format!("{name} token id {id} >= vocabulary size {n}"));
                }
            }
        }

        let mut text: Vec<Box<str>> = Vec::with_capacity(n);
        let mut ids: HashMap<Box<str>, u32> = HashMap::with_capacity(n);
        for (i, t) in spec.tokens.into_iter().enumerate() {
            // llama.cpp names an empty token by its id so it can never match text.
            let t: Box<str> = if t.is_empty() { format!("[EMPTY_{i}]").into() } else { t.into() };
            if let Some(first) = ids.insert(t.clone(), i as u32) {
                return Err(format!("token `{t}` appears twice (ids {first} and {i})"));
            }
            text.push(t);
        }
        let score = if spec.scores.is_empty() { vec![0.0; n] } else { spec.scores[..n].to_vec() };
        let mut attrs: Vec<u16> = (0..n)
            .map(|i| match spec.token_types.get(i) {
                None => attr::NORMAL,
                Some(1) => attr::NORMAL,
                Some(2) => attr::UNKNOWN,
                Some(3) => attr::CONTROL,
                Some(4) => attr::USER_DEFINED,
                Some(5) => attr::UNUSED,
                Some(6) => attr::BYTE,
                Some(_) => 0,
            })
            .collect();
        for (i, t) in text.iter().enumerate() {
            if attrs[i] & attr::BYTE != 0 && byte_of(t).is_none() {
                return Err(format!("byte token {i} is `{t}`, not <0xHH>"));
            }
        }

        // End-of-generation ids: the file's, then those llama.cpp recognises by their text,
        // which also become control tokens (matched in text, hidden when skipping specials).
        let mut eog_ids: Vec<u32> = spec.eos_id.into_iter().collect();
        for id in spec.extra_eog_ids {
            if (id as usize) < n && !eog_ids.contains(&id) {
                eog_ids.push(id);
            }
        }
        let mut by_text: Vec<u32> = END_OF_GENERATION.iter().filter_map(|t| ids.get(*t).copied()).collect();
        by_text.sort_unstable();
        for &id in &by_text {
            attrs[id as usize] |= attr::CONTROL;
            if !eog_ids.contains(&id) {
                eog_ids.push(id);
            }
        }
        for t in CONTROL_BY_TEXT {
            if let Some(&id) = ids.get(*t) {
                attrs[id as usize] |= attr::CONTROL;
            }
        }

        let is_special = |a: u16| a & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0;
        let name = spec.model_name.unwrap_or_default().to_lowercase();
        if name.contains("phi-3") || name.contains("phi3") {
            for a in attrs.iter_mut().filter(|a| is_special(**a)) {
                *a |= attr::RSTRIP;
            }
            if let Some(&id) = ids.get("</s>") {
                attrs[id as usize] |= attr::RSTRIP;
            }
            for t in ["<unk>", "<s>", "<|endoftext|>"] {
                if let Some(&id) = ids.get(t) {
                    attrs[id as usize] &= !attr::RSTRIP;
                }
            }
        }

        let mut byte_ids = vec![None; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = ids.get(format!("<0x{b:02X}>").as_str()).copied().or_else(|| {
                // llama.cpp falls back to the byte itself as a one-character token.
                char::from_u32(b as u32)
                    .filter(char::is_ascii)
                    .and_then(|c| ids.get(c.to_string().as_str()).copied())
            });
        }

        let specials = SpecialTrie::new(
            text.iter()
                .enumerate()
                .filter(|&(i, _)| is_special(attrs[i]))
                .map(|(i, t)| (i as u32, t.as_bytes())),
        );
        Ok(Spm {
            text,
            score,
            attr: attrs,
            ids,
            byte_ids,
            specials,
            bos_id: spec.bos_id,
            eos_id: spec.eos_id,
            unk_id: spec.unk_id,
            add_bos: spec.add_bos,
            add_eos: spec.add_eos,
            add_space_prefix: spec.add_space_prefix,
            eog_ids,
        })
    }

    pub(super) fn vocab_size(&self) -> usize {
        self.text.len()
    }

    /// Ids that end generation: EOS first, then the file's end-of-turn ids and those recognised
    /// by their text.
    pub(super) fn eog_ids(&self) -> &[u32] {
        &self.eog_ids
    }

    pub(super) fn token_to_id(&self, token: &str) -> Option<u32> {
        self.ids.get(token).copied()
    }

    /// The vocabulary's spelling of `id` (with `▁`, `<0xHH>`).
    pub(super) fn id_to_token(&self, id: u32) -> Option<&str> {
        self.text.get(id as usize).map(|t| &**t)
    }

    /// Ids for `text`; with `add_special`, BOS first and EOS last when the vocabulary says so.
    /// Special-token text is always matched as that token.
    pub(super) fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, String> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.push(self.bos_id.ok_or("add_bos_token is set but the vocabulary has no BOS")?);
        }
        let mut prev_special = true;
        let mut buf = String::new();
        for frag in self.partition(text) {
            match frag {
                Fragment::Text(s) => {
                    buf.clear();
                    if self.add_space_prefix && prev_special {
                        buf.push('▁');
                    }
                    for c in s.chars() {
                        buf.push(if c == ' ' { '▁' } else { c });
                    }
                    self.encode_text(&buf, &mut out)?;
                    prev_special = false;
                }
                Fragment::Special(id) => {
                    out.push(id);
                    prev_special = true;
                }
            }
        }
        if add_special && self.add_eos {
            out.push(self.eos_id.ok_or("add_eos_token is set but the vocabulary has no EOS")?);
        }
        Ok(out)
    }

    /// Text for `ids`, which the caller has checked lie inside the vocabulary.
    pub(super) fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        let mut ids = ids;
        let mut remove_space = self.add_space_prefix;
        if skip_special_tokens && self.add_bos && self.bos_id.is_some() && ids.first() == self.bos_id.as_ref()
        {
            ids = &ids[1..];
            remove_space = false;
        }
        if skip_special_tokens && self.add_eos && self.eos_id.is_some() && ids.last() == self.eos_id.as_ref()
        {
            ids = &ids[..ids.len() - 1];
        }
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let start = out.len();
            self.push_piece(id, !skip_special_tokens, &mut out);
            if remove_space && out.get(start) == Some(&b' ') {
                out.remove(start);
            }
            remove_space = false;
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    /// What one token stands for on its own, special tokens shown (a lone byte of a multi-byte
    /// character as U+FFFD); no leading space is dropped.
    pub(super) fn token_text(&self, id: u32) -> String {
        String::from_utf8_lossy(&self.token_bytes(id)).into_owned()
    }

    /// The bytes one token stands for on its own (special tokens as their text).
    pub(super) fn token_bytes(&self, id: u32) -> Vec<u8> {
        let mut out = Vec::new();
        self.push_piece(id, true, &mut out);
        out
    }

    /// Whether the token is a control, unknown or unused one: never text of the output.
    pub(super) fn is_special(&self, id: u32) -> bool {
        self.attr.get(id as usize).is_some_and(|&a| a & (attr::UNKNOWN | attr::CONTROL | attr::UNUSED) != 0)
    }

    fn push_piece(&self, id: u32, show_special: bool, out: &mut Vec<u8>) {
        let (Some(t), Some(&a)) = (self.text.get(id as usize), self.attr.get(id as usize)) else { return };
        if !show_special && a & (attr::UNKNOWN | attr::CONTROL) != 0 {
            return;
        }
        if a & (attr::UNKNOWN | attr::CONTROL | attr::USER_DEFINED) != 0 {
            out.extend_from_slice(t.as_bytes());
        } else if a & attr::NORMAL != 0 {
            let mut rest = &**t;
            while let Some(i) = rest.find('▁') {
                out.extend_from_slice(&rest.as_bytes()[..i]);
                out.push(b' ');
                rest = &rest[i + '▁'.len_utf8()..];
            }
            out.extend_from_slice(rest.as_bytes());
        } else if a & attr::BYTE != 0 {
            out.extend(byte_of(t));
        }
    }

    /// The input cut into plain text and special tokens, as llama.cpp's partition does: special
    /// tokens by decreasing length (then id), each taking its leftmost occurrences that do not
    /// overlap a token already taken; whitespace next to a token with LSTRIP/RSTRIP goes with it.
    fn partition<'t>(&self, text: &'t str) -> Vec<Fragment<'t>> {
        let bytes = text.as_bytes();
        let mut found = self.specials.occurrences(bytes);
        if found.is_empty() {
            return if text.is_empty() { Vec::new() } else { vec![Fragment::Text(text)] };
        }
        found.sort_unstable_by_key(|o| (o.rank, o.pos));
        // start of a taken span -> (end, id); spans never overlap.
        let mut taken: BTreeMap<usize, (usize, u32)> = BTreeMap::new();
        for o in found {
            let end = o.pos + o.len;
            let before = taken.range(..=o.pos).next_back().map(|(_, &(e, _))| e);
            let after = taken.range(o.pos + 1..).next().map(|(&s, _)| s);
            if before.is_some_and(|e| e > o.pos) || after.is_some_and(|s| s < end) {
                continue;
            }
            let (lo, hi) = (before.unwrap_or(0), after.unwrap_or(bytes.len()));
            let a = self.attr[o.id as usize];
            let mut start = o.pos;
            if a & attr::LSTRIP != 0 {
                while start > lo && is_c_space(bytes[start - 1]) {
                    start -= 1;
                }
            }
            let mut stop = end;
            if a & attr::RSTRIP != 0 {
                while stop < hi && is_c_space(bytes[stop]) {
                    stop += 1;
                }
            }
            taken.insert(start, (stop, o.id));
        }
        let mut out = Vec::with_capacity(2 * taken.len() + 1);
        let mut at = 0;
        for (start, (stop, id)) in taken {
            if start > at {
                out.push(Fragment::Text(&text[at..start]));
            }
            out.push(Fragment::Special(id));
            at = stop;
        }
        if at < text.len() {
            out.push(Fragment::Text(&text[at..]));
        }
        out
    }

    /// llama.cpp's SentencePiece merge loop over one stretch of text (spaces already `▁`).
    fn encode_text(&self, text: &str, out: &mut Vec<u32>) -> Result<(), String> {
        let mut syms: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            let end = start + c.len_utf8();
            syms.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: (end < text.len()).then_some(i + 1),
            });
        }
        let mut queue = BinaryHeap::with_capacity(syms.len());
        let pair = |syms: &[Symbol], l: usize, r: usize| -> Option<Bigram> {
            let size = syms[l].len + syms[r].len;
            let id = *self.ids.get(&text[syms[l].start..syms[l].start + size])?;
            Some(Bigram { score: self.score[id as usize], left: l, right: r, size })
        };
        for i in 1..syms.len() {
            queue.extend(pair(&syms, i - 1, i));
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (b.left, b.right);
            // Skip pairs one of whose symbols has changed since the pair was queued.
            if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != b.size {
                continue;
            }
            syms[l].len += syms[r].len;
            syms[r].len = 0;
            syms[l].next = syms[r].next;
            if let Some(nx) = syms[r].next {
                syms[nx].prev = Some(l);
            }
            if let Some(p) = syms[l].prev {
                queue.extend(pair(&syms, p, l));
            }
            if let Some(nx) = syms[l].next {
                queue.extend(pair(&syms, l, nx));
            }
        }
        let mut i = if syms.is_empty() { None } else { Some(0) };
        while let Some(k) = i {
            let s = &syms[k];
            let piece = &text[s.start..s.start + s.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        let id = self.byte_ids[b as usize].or(self.unk_id).ok_or_else(|| {
                            format!("no token for byte 0x{b:02X} of `{piece}` and no unknown token")
                        })?;
                        out.push(id);
                    }
                }
            }
            i = s.next;
        }
        Ok(())
    }
}

/// The byte a `<0xHH>` token stands for.
fn byte_of(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// C's `isspace` in the "C" locale.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

enum Fragment<'t> {
    Text(&'t str),
    Special(u32),
}

#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    /// Bytes; 0 once merged into the symbol before it.
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge. The queue pops the highest score first, and of equal scores the
/// leftmost pair.
#[derive(Debug, Clone, Copy)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}

impl Eq for Bigram {}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        // As C++'s `<` on floats: NaN compares equal to everything here.
        self.score
            .partial_cmp(&other.score)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then_with(|| other.left.cmp(&self.left))
    }
}

#[derive(Default)]
struct TrieNode {
    /// (byte, node), sorted by byte.
    children: Vec<(u8, u32)>,
    /// The token whose text ends here.
    token: Option<u32>,
}

impl TrieNode {
    fn child(&self, b: u8) -> Option<usize> {
        self.children.binary_search_by_key(&b, |&(c, _)| c).ok().map(|k| self.children[k].1 as usize)
    }
}

/// One place in the input where a special token's text occurs.
struct Occurrence {
    /// Order in which llama.cpp tries the token: longer texts first, then lower ids.
    rank: u32,
    pos: usize,
    len: usize,
    id: u32,
}

/// The special tokens' texts as a byte trie, to find every occurrence of every special token
/// in one pass over the input.
struct SpecialTrie {
    nodes: Vec<TrieNode>,
    /// Rank of each token in the trie, by id.
    rank: HashMap<u32, u32>,
}

impl SpecialTrie {
    fn new<'a>(tokens: impl Iterator<Item = (u32, &'a [u8])>) -> SpecialTrie {
        let mut tokens: Vec<(u32, &[u8])> = tokens.filter(|(_, t)| !t.is_empty()).collect();
        tokens.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(&b.0)));
        let mut nodes = vec![TrieNode::default()];
        let mut rank = HashMap::with_capacity(tokens.len());
        for (r, &(id, t)) in tokens.iter().enumerate() {
            rank.insert(id, r as u32);
            let mut node = 0usize;
            for &b in t {
                node = match nodes[node].children.binary_search_by_key(&b, |&(c, _)| c) {
                    Ok(k) => nodes[node].children[k].1 as usize,
                    Err(k) => {
                        let new = nodes.len();
                        nodes[node].children.insert(k, (b, new as u32));
                        nodes.push(TrieNode::default());
                        new
                    }
                };
            }
            nodes[node].token = Some(id);
        }
        SpecialTrie { nodes, rank }
    }

    fn occurrences(&self, text: &[u8]) -> Vec<Occurrence> {
        let mut out = Vec::new();
        if self.nodes[0].children.is_empty() {
            return out;
        }
        for pos in 0..text.len() {
            let mut node = 0usize;
            for (k, &b) in text[pos..].iter().enumerate() {
                match self.nodes[node].child(b) {
                    Some(next) => node = next,
                    None => break,
                }
                if let Some(id) = self.nodes[node].token {
                    out.push(Occurrence { rank: self.rank[&id], pos, len: k + 1, id });
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary of the given pieces (score = given), byte tokens for every byte, and
    /// `<unk>`, `<s>`, `</s>` as ids 0, 1, 2.
    fn vocab(pieces: &[(&str, f32)], add_space_prefix: bool) -> Spm {
        let mut tokens = vec!["<unk>".to_owned(), "<s>".to_owned(), "</s>".to_owned()];
        let mut types = vec![2, 3, 3];
        let mut scores = vec![0.0, 0.0, 0.0];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
            scores.push(0.0);
        }
        for &(p, s) in pieces {
            tokens.push(p.to_owned());
            types.push(1);
            scores.push(s);
        }
        Spm::new(SpmSpec {
            tokens,
            scores,
            token_types: types,
            bos_id: Some(1),
            eos_id: Some(2),
            unk_id: Some(0),
            extra_eog_ids: Vec::new(),
            add_bos: true,
            add_eos: false,
            add_space_prefix,
            model_name: None,
        })
        .unwrap()
    }

    fn pieces(v: &Spm, ids: &[u32]) -> Vec<String> {
        ids.iter().map(|&i| v.id_to_token(i).unwrap().to_owned()).collect()
    }

    #[test]
    fn highest_score_merges_first_and_ties_go_left() {
        let v =
            vocab(&[("▁", -1.0), ("a", -1.0), ("b", -1.0), ("ab", -5.0), ("bb", -2.0), ("abb", -3.0)], false);
        // "bb" (-2) beats "ab" (-5); then "a"+"bb" = "abb" (-3).
        assert_eq!(pieces(&v, &v.encode("abb", false).unwrap()), ["abb"]);
        // Equal scores: "bb" at 0 and at 2 of "bbbb" tie, the leftmost merges first, then the next.
        assert_eq!(pieces(&v, &v.encode("bbbb", false).unwrap()), ["bb", "bb"]);
        // "bbb": the left pair wins the tie, leaving "b".
        assert_eq!(pieces(&v, &v.encode("bbb", false).unwrap()), ["bb", "b"]);
    }

    #[test]
    fn space_prefix_byte_fallback_and_decoding() {
        let v = vocab(&[("▁", -1.0), ("h", -1.0), ("i", -1.0), ("▁h", -2.0), ("▁hi", -3.0)], true);
        let ids = v.encode("hi hi", true).unwrap();
        assert_eq!(pieces(&v, &ids), ["<s>", "▁hi", "▁hi"]);
        // BOS shown, its following space kept; without BOS the first token's space is dropped.
        assert_eq!(v.decode(&ids, false), "<s> hi hi");
        assert_eq!(v.decode(&ids, true), " hi hi");
        assert_eq!(v.decode(&ids[1..], false), "hi hi");
        // "é" is not a piece: its two UTF-8 bytes come out as byte tokens and decode back.
        let ids = v.encode("é", false).unwrap();
        assert_eq!(pieces(&v, &ids), ["▁", "<0xC3>", "<0xA9>"]);
        assert_eq!(v.decode(&ids, false), "é");
        assert_eq!(v.decode(&ids[..2], false), "\u{FFFD}");
        assert_eq!(v.token_text(ids[0]), " ");
        // Empty input: only BOS.
        assert_eq!(v.encode("", true).unwrap(), [1]);
        assert!(v.encode("", false).unwrap().is_empty());
    }

    #[test]
    fn special_tokens_longest_first_and_space_after_them() {
        let mut v = vocab(&[("▁", -1.0), ("x", -1.0), ("▁x", -2.0)], true);
        let base = v.text.len() as u32;
        // Rebuild with two control tokens, one a prefix of the other.
        let mut tokens: Vec<String> = v.text.iter().map(|t| t.to_string()).collect();
        tokens.push("<a>".into());
        tokens.push("<a><b>".into());
        let mut types: Vec<i32> = v
            .attr
            .iter()
            .map(|&a| {
                if a & attr::BYTE != 0 {
                    6
                } else if a & attr::UNKNOWN != 0 {
                    2
                } else if a & attr::CONTROL != 0 {
                    3
                } else {
                    1
                }
            })
            .collect();
        types.extend([3, 3]);
        let mut scores = v.score.clone();
        scores.extend([0.0, 0.0]);
        v = Spm::new(SpmSpec {
            tokens,
            scores,
            token_types: types,
            bos_id: Some(1),
            eos_id: Some(2),
            unk_id: Some(0),
            extra_eog_ids: Vec::new(),
            add_bos: false,
            add_eos: false,
            add_space_prefix: true,
            model_name: None,
        })
        .unwrap();
        let ids = v.encode("x<a><b>x<a>", true).unwrap();
        assert_eq!(pieces(&v, &ids), ["▁x", "<a><b>", "▁x", "<a>"]);
        assert_eq!(ids[1], base + 1);
        assert_eq!(v.decode(&ids, true), "x x");
        assert_eq!(v.decode(&ids, false), "x<a><b> x<a>");
        // `</s>` is recognised as ending generation by its text.
        assert_eq!(v.eog_ids(), [2]);
    }

    #[test]
    fn phi3_strips_whitespace_after_special_tokens() {
        let mut tokens = vec!["<unk>".to_owned(), "<s>".to_owned(), "</s>".to_owned(), "<|end|>".to_owned()];
        tokens.extend(["▁", "a", "\n", "▁a"].map(str::to_owned));
        let spec = |name: &str| SpmSpec {
            tokens: tokens.clone(),
            scores: vec![0.0, 0.0, 0.0, 0.0, -1.0, -1.0, -1.0, -2.0],
            token_types: vec![2, 3, 3, 4, 1, 1, 1, 1],
            bos_id: Some(1),
            eos_id: Some(2),
            unk_id: Some(0),
            extra_eog_ids: Vec::new(),
            add_bos: false,
            add_eos: false,
            add_space_prefix: false,
            model_name: Some(name.to_owned()),
        };
        let phi = Spm::new(spec("Phi3 Mini")).unwrap();
        assert_eq!(phi.encode("a<|end|>\n a", false).unwrap(), [5, 3, 5]);
        let other = Spm::new(spec("Other")).unwrap();
        assert_eq!(other.encode("a<|end|>\n a", false).unwrap(), [5, 3, 6, 7]);
        // `<|end|>` ends generation and, found by its text, becomes a control token.
        assert_eq!(other.eog_ids(), [2, 3]);
        assert_eq!(other.decode(&[5, 3], true), "a");
    }

    #[test]
    fn malformed_vocabularies_are_refused() {
        let spec = |tokens: &[&str], types: Vec<i32>| SpmSpec {
            tokens: tokens.iter().map(|t| t.to_string()).collect(),
            scores: Vec::new(),
            token_types: types,
            bos_id: None,
            eos_id: None,
            unk_id: None,
            extra_eog_ids: Vec::new(),
            add_bos: false,
            add_eos: false,
            add_space_prefix: true,
            model_name: None,
        };
        assert!(Spm::new(spec(&["a", "a"], vec![])).unwrap_err().contains("twice"));
        assert!(Spm::new(spec(&["a", "<0xZZ>"], vec![1, 6])).unwrap_err().contains("<0xHH>"));
        assert!(Spm::new(spec(&["a", "b"], vec![1])).unwrap_err().contains("token types"));
        let mut bad = spec(&["a"], vec![]);
        bad.eos_id = Some(1);
        assert!(Spm::new(bad).unwrap_err().contains("eos"));
        // No byte token and no unknown token: text outside the vocabulary is an error.
        let v = Spm::new(spec(&["▁", "a"], vec![])).unwrap();
        assert_eq!(v.encode("a", false).unwrap(), [0, 1]);
        assert!(v.encode("b", false).unwrap_err().contains("0x62"));
    }
}
